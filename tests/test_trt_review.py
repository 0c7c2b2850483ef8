"""The TensorRT review's build-side defects (issue 22), one test or more each, against fake_tensorrt, which
models the TensorRT behaviour behind each defect (see its docstring). Each of these failed before the fix:

- INT8 that is not INT8: calibration skipped by TensorRT 7.1-8.0 on BOOL/loop networks went unnoticed;
  the grafted FP32 island was calibrated through; an "int8" engine without INT8 layers was accepted.
- FP32 island half pinned (comparisons reading floats left free); OBEY and PREFER both set.
- Plugins never registered before parsing.
- Unchecked returns: a refused timing cache recorded as a hit, a refused profile (-1) ignored,
  queryKeys() raising out of the build.
- DLA: FP32 and dynamic shapes not refused, layers silently on the GPU.
- "fp32" built with TF32 allowed.
Written to the TensorRT docs (TensorRT <= 10 cannot run here); the RTX paths run for real elsewhere.
"""

from __future__ import annotations

import logging
from pathlib import Path

import fake_tensorrt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engines.build.builder import build
from engines.errors import BuildError
from engines.fingerprint import Fingerprint
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

MODEL = "det"
CAL = {"method": "entropy", "samples": 4}
SHAPE = (1, 3, 8, 8)


def fp_for(api: TrtApi, gpu: str | None = "Orin", dla_cores: int = 0) -> Fingerprint:
    return Fingerprint(
        api.flavor, api.version, gpu, "8.7", "540.3", "12.6", None, None, "linux-aarch64", dla_cores
    )


def tiny_onnx(path: Path, *, island: bool = False, plugin: bool = False, batch: int | str = 1) -> Path:
    """images [N,3,8,8] -> Conv -> scores; with `island` a grafted-style tail (keep_fp32/ nodes: a comparison
    with a BOOL output); with `plugin` an EfficientNMS_TRT node (TensorRT's plugin library)."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 1, 1], np.ones(12, np.float32).tolist())
    nodes = [helper.make_node("Conv", ["images", "w"], ["scores"], name="stem/Conv")]
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)]
    inits = [w]
    if island:
        inits.append(helper.make_tensor("thr", TensorProto.FLOAT, [], [0.25]))
        nodes.append(helper.make_node("Greater", ["scores", "thr"], ["keep"], name="keep_fp32/Greater"))
        outputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, None))
    if plugin:
        nodes.append(helper.make_node("EfficientNMS_TRT", ["scores"], ["nms"], name="nms", domain=""))
        outputs.append(helper.make_tensor_value_info("nms", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, 8, 8])],
        outputs,
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(n)]


def fake_build(tmp_path: Path, mod, onnx_path: Path, *, fp=None, data=None, **kw):
    api = TrtApi(mod)
    store = EngineStore(tmp_path / "engines")
    mod.calls.clear()
    result = build(
        store,
        MODEL,
        BuildSettings(onnx=onnx_path, **kw),
        api=api,
        fingerprint=fp or fp_for(api),
        force=True,
        calibration_batches=data,
        device_allocator=fake_tensorrt.FakeAllocator(),
    )
    builds = [c[1] for c in mod.calls if c[0] == "build"]
    return api, store, result, builds


# --- 1. INT8 calibration that provably happened ---------------------------------------------------
def test_skipped_calibration_fails_the_build(tmp_path):
    """TensorRT 8.0 never calls the calibrator on a network with BOOL tensors: the build must fail, not
    record an "int8" engine (before: built, manifest precision int8, no INT8 anywhere)."""
    bool_net = [*fake_tensorrt.DETECTOR_LAYERS, ("cmp", "ELEMENTWISE", ["scores", "thr"], [("m", "BOOL")])]
    mod = fake_tensorrt.make("8.0.1", int8=True, layers=bool_net)
    with pytest.raises(BuildError, match=r"INT8 calibration of .* did not happen: TensorRT asked for no"):
        fake_build(
            tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"), data=batches(4), precision="int8", calibration=CAL
        )
    assert ("calib_skipped", "bool/loop network") in mod.calls
    assert not EngineStore(tmp_path / "engines").entries(MODEL)
    # The same network on 8.2+ calibrates (the fake only skips where TensorRT did).
    mod = fake_tensorrt.make("8.2.0", int8=True, layers=bool_net)
    _, _, res, _ = fake_build(
        tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"), data=batches(4), precision="int8", calibration=CAL
    )
    assert res.manifest.build.int8["batches_fed"] == 4 and res.manifest.build.int8["cache_read"] is False


def test_island_is_calibrated_without_its_tail_and_the_full_build_reads_the_cache(tmp_path):
    mod = fake_tensorrt.make("10.3.0", int8=True)
    onnx_path = tiny_onnx(tmp_path / "grafted.onnx", island=True)
    _api, _store, res, builds = fake_build(
        tmp_path, mod, onnx_path, data=batches(4), precision="int8", calibration=CAL
    )
    # Two builds: the calibration pass (parsed from bytes: the graph without keep_fp32/ nodes, so no island
    # layers) fed 4 batches; the full build (parsed from the file, island included) read its cache only.
    assert len(builds) == 2
    parses = [c for c in mod.calls if c[0] == "parse"]
    assert parses[0][1] == "bytes" and parses[1] == ("parse", "file", str(onnx_path))
    first_build = mod.calls.index(("build", builds[0]))
    assert len([c for c in mod.calls[:first_build] if c[0] == "calib_batch"]) == 0  # fed during build
    fed = [i for i, c in enumerate(mod.calls) if c[0] == "calib_batch"]
    read = [i for i, c in enumerate(mod.calls) if c[0] == "calib_cache_read"]
    second_build = mod.calls.index(("build", builds[1]))
    assert len(fed) == 4 and all(i < second_build for i in fed) and read and read[0] > second_build
    int8 = res.manifest.build.int8
    assert (
        int8["calibrated_graph"] == "without_fp32_island" and int8["batches_fed"] == 4 and int8["cache_read"]
    )
    # The full network's island layers are pinned to FP32, the comparison included (it reads floats).
    layers = {layer.name: layer for layer in mod.last_network.layers}
    assert layers["keep_fp32/Greater"].precision == mod.DataType.FLOAT
    assert layers["keep_fp32/Greater"].output_types == {}  # its BOOL output keeps its type
    # And the engine has INT8 layers, counted from the inspector of the deserialised plan.
    assert int8["int8_layers"] == res.manifest.build.layers["precisions"]["INT8"] > 0


def test_island_graph_on_tensorrt_8_0_is_refused_not_recorded_as_int8(tmp_path):
    """8.0 calibrates the tail-less graph but skips calibration (and so the cache) on the full BOOL/loop
    network: the build fails and the plan moves on (no silent FP16 engine called int8)."""
    mod = fake_tensorrt.make("8.0.1", int8=True)
    with pytest.raises(BuildError, match="did not happen"):
        fake_build(
            tmp_path,
            mod,
            tiny_onnx(tmp_path / "g.onnx", island=True),
            data=batches(4),
            precision="int8",
            calibration=CAL,
        )


def test_int8_engine_without_int8_layers_is_refused(tmp_path):
    """Every convolution kept out of INT8 (a keep pattern matching all): calibration happens, but the
    engine has no INT8 layer; refused so the plan's next step (fp16) is tried."""
    mod = fake_tensorrt.make("10.3.0", int8=True)
    with pytest.raises(BuildError, match=r"has no INT8 layer .*refused"):
        fake_build(
            tmp_path,
            mod,
            tiny_onnx(tmp_path / "m.onnx"),
            data=batches(4),
            precision="int8",
            calibration=CAL,
            int8_keep_layers=("Conv",),
        )
    assert not EngineStore(tmp_path / "engines").entries(MODEL)


# --- 2. island pinning and one constraint flag ----------------------------------------------------
def test_obey_and_island_set_exactly_one_constraint_flag(tmp_path):
    """INT8 with constraints obey on a graph with an island: before, OBEY (INT8 kept layers) and PREFER
    (island) were both set, which TensorRT refuses (the fake fails such builds)."""
    mod = fake_tensorrt.make("10.3.0", int8=True)
    _, _, _res, builds = fake_build(
        tmp_path,
        mod,
        tiny_onnx(tmp_path / "g.onnx", island=True),
        data=batches(4),
        precision="int8",
        calibration=CAL,
        precision_constraints="obey",
    )
    names = {mod.BuilderFlag(f).name for f in builds[-1].flags_set}
    assert "OBEY_PRECISION_CONSTRAINTS" in names and "PREFER_PRECISION_CONSTRAINTS" not in names
    # FP16 with an island: PREFER alone.
    _, _, _, builds = fake_build(tmp_path, mod, tiny_onnx(tmp_path / "g.onnx", island=True), precision="fp16")
    names = {mod.BuilderFlag(f).name for f in builds[-1].flags_set}
    assert "PREFER_PRECISION_CONSTRAINTS" in names and "OBEY_PRECISION_CONSTRAINTS" not in names


def test_set_precision_constraints_replaces_the_other_flag():
    mod = fake_tensorrt.make("10.3.0", int8=True)
    api = TrtApi(mod)
    config = mod.IBuilderConfig()
    api.set_precision_constraints(config, "prefer")
    api.set_precision_constraints(config, "obey")
    assert [mod.BuilderFlag(f).name for f in config.flags_set] == ["OBEY_PRECISION_CONSTRAINTS"]


# --- 3. plugins -----------------------------------------------------------------------------------
def test_plugins_registered_once_before_parsing(tmp_path):
    mod = fake_tensorrt.make("10.3.0")
    path = tiny_onnx(tmp_path / "p.onnx", plugin=True)
    fake_build(tmp_path, mod, path, precision="fp16")
    registered = [i for i, c in enumerate(mod.calls) if c[0] == "init_libnvinfer_plugins"]
    parsed = [i for i, c in enumerate(mod.calls) if c[0] == "parse"]
    assert len(registered) == 1 and registered[0] < parsed[0]
    fake_build(tmp_path, mod, path, precision="fp16")  # same process, same module: not again
    assert not [c for c in mod.calls if c[0] == "init_libnvinfer_plugins"]


def test_fake_parser_refuses_plugin_ops_without_registration(tmp_path):
    """The behaviour the fix is for: an unregistered plugin op does not parse."""
    mod = fake_tensorrt.make("10.3.0")
    net = mod.Builder(None).create_network(0)
    parser = mod.OnnxParser(net, None)
    assert not parser.parse_from_file(str(tiny_onnx(tmp_path / "p.onnx", plugin=True)))
    assert "EfficientNMS_TRT" in parser.get_error(0).desc()


# --- 5. return values -----------------------------------------------------------------------------
def test_timing_cache_of_another_version_is_not_a_hit(tmp_path, caplog):
    mod = fake_tensorrt.make("10.3.0")
    onnx_path = tiny_onnx(tmp_path / "m.onnx")
    _api, _store, res, _ = fake_build(tmp_path, mod, onnx_path)
    cache = Path(res.manifest.build.timing_cache["path"])
    assert res.manifest.build.timing_cache["status"] == "empty"
    _, _, again, _ = fake_build(tmp_path, mod, onnx_path)
    assert again.manifest.build.timing_cache == {**again.manifest.build.timing_cache, "hit": True}
    assert again.manifest.build.timing_cache["status"] == "loaded"
    cache.write_bytes(b"trt10.0.0;conv1,conv2")  # a cache another TensorRT made, under this cache's name
    with caplog.at_level(logging.WARNING, logger="engines.trt"):
        _, _, mismatched, _ = fake_build(tmp_path, mod, onnx_path)
    tc = mismatched.manifest.build.timing_cache
    assert tc["hit"] is False and tc["status"] == "mismatch"
    assert "refused the saved timing cache" in caplog.text
    cache.write_bytes(b"\x00garbage")
    _, _, unreadable, _ = fake_build(tmp_path, mod, onnx_path)
    assert unreadable.manifest.build.timing_cache["status"] == "unreadable"


def test_refused_profile_fails_the_build_naming_it(tmp_path):
    mod = fake_tensorrt.make("10.3.0")
    api = TrtApi(mod)
    config = mod.IBuilderConfig()
    bad = mod.Builder(None).create_optimization_profile()
    bad.set_shape("images", (4, 3, 8, 8), (2, 3, 8, 8), (1, 3, 8, 8))  # min > max
    with pytest.raises(
        BuildError, match=r"refused optimisation profile 0 \(images\) \(add_optimization_profile -> -1\)"
    ):
        api.add_profile(config, bad, "0 (images)")
    good = mod.Builder(None).create_optimization_profile()
    good.set_shape("images", (1, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8))
    assert api.add_profile(config, good, "0") == 0


def test_query_keys_raising_is_unknown_not_fatal(caplog):
    api = TrtApi(fake_tensorrt.make("10.3.0"))

    class Broken:
        def queryKeys(self) -> list[str]:
            raise RuntimeError("cannot enumerate")

    with caplog.at_level(logging.WARNING, logger="engines.trt"):
        assert api.timing_cache_entries(Broken()) == -1
    assert "cannot count timing cache entries" in caplog.text


def test_calibration_profile_refusal_is_an_error():
    mod = fake_tensorrt.make("10.3.0", int8=True)
    api = TrtApi(mod)

    class Config:
        def set_calibration_profile(self, profile: object) -> bool:
            return False

    with pytest.raises(BuildError, match="refused the calibration profile"):
        api.set_calibration_profile(Config(), object())


# --- 6. DLA ---------------------------------------------------------------------------------------
def test_dla_refuses_fp32_and_dynamic_shapes_and_counts_layers(tmp_path):
    mod = fake_tensorrt.make("10.3.0", int8=True, dla_cores=2)
    api = TrtApi(mod)
    fp = fp_for(api, dla_cores=2)
    with pytest.raises(BuildError, match=r"DLA core 1: DLA runs FP16 and INT8 only, not fp32"):
        fake_build(tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"), fp=fp, dla_core=1)
    dyn = tiny_onnx(tmp_path / "dyn.onnx", batch="N")
    with pytest.raises(BuildError, match=r"DLA needs static shapes, but profile 0 input 'images' ranges"):
        fake_build(tmp_path, mod, dyn, fp=fp, dla_core=1, precision="fp16", batch=(1, 2, 4))
    _, _, res, _ = fake_build(
        tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"), fp=fp, dla_core=1, precision="fp16"
    )
    dla = res.manifest.build.dla
    net = mod.last_network.layers
    on_dla = sum(layer.type.name in fake_tensorrt.DLA_LAYER_TYPES for layer in net)
    assert dla == {
        "core": 1,
        "layers_on_dla": on_dla,
        "layers_on_gpu": len(net) - on_dla,
    } and 0 < on_dla < len(net)


def test_dla_with_every_layer_on_the_gpu_is_refused(tmp_path):
    gpu_only = [
        ("s", "SHAPE", ["images"], [("s0", "INT32")]),
        ("r", "SHUFFLE", ["images", "s0"], [("scores", "FLOAT")]),
    ]
    mod = fake_tensorrt.make(
        "10.3.0",
        int8=True,
        dla_cores=1,
        layers=[*gpu_only, ("b", "SHUFFLE", ["scores"], [("boxes", "FLOAT")])],
    )
    api = TrtApi(mod)
    with pytest.raises(BuildError, match=r"no layer of .* can run on DLA; with GPU fallback all 3 layers"):
        fake_build(
            tmp_path,
            mod,
            tiny_onnx(tmp_path / "m.onnx"),
            fp=fp_for(api, dla_cores=1),
            dla_core=0,
            precision="fp16",
        )


# --- 8. TF32 --------------------------------------------------------------------------------------
def test_fp32_builds_disallow_tf32_reduced_ones_leave_it(tmp_path):
    mod = fake_tensorrt.make("10.3.0")
    mod_flags = mod.BuilderFlag
    _, _, res, builds = fake_build(tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"))
    assert res.manifest.build.tf32 is False
    assert ("clear_flag", mod_flags.TF32) in builds[-1].cleared
    _, _, res16, builds = fake_build(tmp_path, mod, tiny_onnx(tmp_path / "m.onnx"), precision="fp16")
    assert res16.manifest.build.tf32 is None and not builds[-1].cleared


# --- 6. DLA refusals are config errors naming the key ---------------------------------------------
DLA_CONFIG = """
engine_dir: {d}/engines
models:
  det:
    onnx: {onnx}
    format: nanodet
    backend: {backend}
    precision: {precision}
    batch: {{min: 1, opt: {opt}, max: {mx}}}
    engine: {{dla_core: 0}}
cameras: {{}}
"""


@pytest.mark.parametrize(
    ("backend", "precision", "opt", "mx", "error"),
    [
        ("auto", "fp32", 1, 1, r"models\.det\.engine\.dla_core: DLA runs FP16 and INT8 only; precision fp32"),
        (
            "auto",
            "fp16",
            2,
            4,
            r"models\.det\.engine\.dla_core: DLA needs static shapes, but models\.det\.batch",
        ),
        ("onnxruntime", "fp16", 1, 1, r"models\.det\.engine\.dla_core: DLA needs backend tensorrt or auto"),
        ("tensorrt_rtx", "int8", 1, 1, r"models\.det\.engine\.dla_core: DLA needs backend tensorrt or auto"),
    ],
)
def test_dla_config_refusals_name_the_key(tmp_path, backend, precision, opt, mx, error):
    from agent.config import ConfigError, load_config

    onnx_path = tiny_onnx(tmp_path / "m.onnx")
    text = DLA_CONFIG.format(d=tmp_path, onnx=onnx_path, backend=backend, precision=precision, opt=opt, mx=mx)
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{path}: {error}"):
        load_config(path)
    # The same model with what DLA runs loads.
    path.write_text(
        DLA_CONFIG.format(d=tmp_path, onnx=onnx_path, backend="auto", precision="fp16", opt=1, mx=1)
    )
    assert load_config(path).models["det"].engine.dla_core == 0
