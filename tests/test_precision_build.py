"""Precision on the TensorRT build side.

Real (tensorrt_rtx, CPU AOT): FP16 builds; a Q/DQ NanoDet made here with ORT quantize_static parses and
fails to build with a clear error (raw tf2onnx graph) or builds (constants folded first); calibration
records in the manifest and `check`; `best` refused.
Written to the TensorRT docs, not run here (fake_tensorrt + FakeAllocator): calibrators for TensorRT <= 10,
the calibration cache, INT8+FP16 flags and per-layer precision constraints.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import fake_tensorrt
import numpy as np
import onnx
import pytest

from engines.build.builder import build
from engines.build.calibrator import BatchFeeder, CalibrationCache, make_calibrator, npy_batches
from engines.build.compat import check
from engines.build.layer_precision import select_layers
from engines.cuda.buffers import CudaError, DeviceBuffer, cuda_call
from engines.errors import BuildError, UnavailableError
from engines.fingerprint import Fingerprint
from engines.settings import BuildSettings
from engines.store import EngineStore, sha256_file
from engines.trt import TrtApi

ROOT = Path(__file__).resolve().parent.parent
NANODET = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"
CLIP = ROOT / "agent" / "assets" / "bikes.mp4"
MODEL = "det"
SHAPE = (1, 3, 416, 416)
CAL = {"method": "entropy", "samples": 8}


# --- shared helpers ----------------------------------------------------------------------------------
def frames(n: int = 8) -> list[np.ndarray]:
    """n frames of the bundled clip, preprocessed the NanoDet way: BGR, letterbox 416, (x-mean)/std."""
    cv2 = pytest.importorskip("cv2")
    mean = np.array([103.53, 116.28, 123.675], np.float32)
    std = np.array([57.375, 57.12, 58.395], np.float32)
    cap = cv2.VideoCapture(str(CLIP))
    out, i = [], 0
    while len(out) < n:
        ok, img = cap.read()
        if not ok:
            break
        if i % 10 == 0:
            h, w = img.shape[:2]
            s = min(416 / h, 416 / w)
            nh, nw = round(h * s), round(w * s)
            box = np.full((416, 416, 3), 114, np.uint8)
            box[:nh, :nw] = cv2.resize(img, (nw, nh))
            out.append((((box.astype(np.float32) - mean) / std).transpose(2, 0, 1))[None].copy())
        i += 1
    cap.release()
    assert len(out) == n, f"only {len(out)} frames in {CLIP}"
    return out


def quantize(src: Path, dst: Path, batches: list[np.ndarray]) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            b = next(self.it, None)
            return None if b is None else {"input_1:0": b}

    logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" warnings
    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["Conv"],
        extra_options={"QuantizeBias": False, "ActivationSymmetric": True, "WeightSymmetric": True},
    )
    return dst


def fp_for(api: TrtApi, gpu: str | None = "Orin", cc: str = "8.7") -> Fingerprint:
    return Fingerprint(api.flavor, api.version, gpu, cc, "12.6", "12.6", "R36.4.0", None, "linux-aarch64")


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


# --- real tensorrt_rtx ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rtx():
    pytest.importorskip("tensorrt_rtx")
    from engines.fingerprint import probe_fingerprint
    from engines.trt import import_trt

    api = import_trt("tensorrt_rtx")
    return api, probe_fingerprint(api)


@pytest.fixture(scope="module")
def qdq(tmp_path_factory):
    """(raw Q/DQ NanoDet, Q/DQ NanoDet quantised after ONNX Runtime's basic graph optimisation)."""
    pytest.importorskip("onnxruntime.quantization")
    import onnxruntime as ort

    d = tmp_path_factory.mktemp("qdq")
    batches = frames(8)
    raw = quantize(NANODET, d / "nanodet-qdq.onnx", batches)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(d / "folded.onnx")
    ort.InferenceSession(str(NANODET), so, providers=["CPUExecutionProvider"])
    folded = quantize(d / "folded.onnx", d / "nanodet-folded-qdq.onnx", batches)
    return raw, folded


@pytest.fixture(scope="module")
def rtx_store(tmp_path_factory, rtx):
    """A store holding a real FP32 and FP16 engine."""
    api, fp = rtx
    store = EngineStore(tmp_path_factory.mktemp("rtx-engines"))
    fp32 = build(store, MODEL, BuildSettings(onnx=NANODET), api=api, fingerprint=fp)
    fp16 = build(store, MODEL, BuildSettings(onnx=NANODET, precision="fp16"), api=api, fingerprint=fp)
    return store, fp32, fp16


def test_rtx_fp16_builds_smaller_than_fp32(rtx_store, rtx):
    store, fp32, fp16 = rtx_store
    assert fp16.built and fp16.manifest.build.precision == "fp16"
    assert fp16.manifest.build.calibration is None  # only int8 carries a calibration record
    assert fp16.plan_path.stat().st_size < 0.75 * fp32.plan_path.stat().st_size
    # Calibration settings do not touch fp16 engines (same key, still up to date).
    same = BuildSettings(onnx=NANODET, precision="fp16", calibration=CAL)
    assert check(store, MODEL, same, rtx[1]).ok


def test_rtx_int8_qdq_parses_but_build_fails_clearly(rtx_store, rtx, qdq):
    store, _, _ = rtx_store
    api, fp = rtx
    raw, _ = qdq
    logger = api.logger()
    builder = api.mod.Builder(logger)
    network = builder.create_network(api.network_flags())
    parser = api.mod.OnnxParser(network, logger)
    assert parser.parse_from_file(str(raw)) and parser.num_errors == 0
    layers, _ = api.network_layers(network)
    assert sum(layer.type == "DEQUANTIZE" for layer in layers) > 30

    before = tree(store.root)
    settings = BuildSettings(onnx=NANODET, precision="int8", qdq_onnx=raw, calibration=CAL)
    with pytest.raises(BuildError) as err:
        build(store, MODEL, settings, api=api, fingerprint=fp)
    text = str(err.value)
    assert text.startswith(
        f"cannot build the INT8 (Q/DQ) engine from {raw}: {api.label} hit an internal error"
    )
    assert "ORT_ENABLE_BASIC" in text and "use precision fp16" in text
    assert "TensorRT said: " in text and "Internal Error" in text  # TensorRT's raw words kept as detail
    print("RTX INT8 error:", text)
    # Nothing changed in the store but the (shared) timing cache: RTX writes it, empty, on every build.
    after = tree(store.root)
    assert {k: v for k, v in after.items() if not k.startswith("timing/")} == {
        k: v for k, v in before.items() if not k.startswith("timing/")
    }


def test_rtx_int8_folded_qdq_builds_and_records_calibration(rtx_store, rtx, qdq, tmp_path):
    _, fp32, _ = rtx_store
    api, fp = rtx
    _, folded = qdq
    store = EngineStore(tmp_path / "engines")
    settings = BuildSettings(onnx=NANODET, precision="int8", qdq_onnx=folded, calibration=CAL)
    res = build(store, MODEL, settings, api=api, fingerprint=fp)
    b = res.manifest.build
    assert res.built and b.precision == "int8"
    assert b.onnx_sha256 == sha256_file(NANODET)  # the source ONNX, not the Q/DQ copy
    assert b.calibration == {**CAL, "cache_sha256": sha256_file(folded)}
    assert res.plan_path.stat().st_size < 0.75 * fp32.plan_path.stat().st_size
    assert check(store, MODEL, settings, fp).ok

    # Another calibration record: rebuild, "calibration changed" (other samples -> other key).
    other = BuildSettings(
        onnx=NANODET, precision="int8", qdq_onnx=folded, calibration={"method": "minmax", "samples": 8}
    )
    res2 = check(store, MODEL, other, fp)
    assert (res2.status, res2.reasons) == ("rebuild", ["calibration changed"])
    # The manifest of the same key says another Q/DQ file was used: "calibration changed" too.
    path = store.manifest_path(MODEL, res.key)
    data = json.loads(path.read_text())
    data["build"]["calibration"]["cache_sha256"] = "0" * 64
    path.write_text(json.dumps(data))
    assert check(store, MODEL, settings, fp).reasons == ["calibration changed"]
    # A recorded hash that the Q/DQ file no longer has is refused, naming both.
    stale = BuildSettings(
        onnx=NANODET, precision="int8", qdq_onnx=folded, calibration={**CAL, "cache_sha256": "ab" * 32}
    )
    with pytest.raises(
        BuildError, match=rf"calibration.cache_sha256 abab.* does not match qdq_onnx {folded}"
    ):
        check(store, MODEL, stale, fp)


def test_rtx_refusals(rtx, tmp_path):
    api, fp = rtx
    store = EngineStore(tmp_path)
    with pytest.raises(BuildError, match=r"precision 'best' of model 'det' must be resolved by the agent"):
        build(store, MODEL, BuildSettings(onnx=NANODET, precision="best"), api=api, fingerprint=fp)
    with pytest.raises(UnavailableError, match=r"int8' on TensorRT-RTX .* needs a Q/DQ ONNX of .*qdq_onnx"):
        build(
            store,
            MODEL,
            BuildSettings(onnx=NANODET, precision="int8", calibration=CAL),
            api=api,
            fingerprint=fp,
        )
    with pytest.raises(BuildError, match=r"precision int8 of .* needs BuildSettings.calibration"):
        build(
            store,
            MODEL,
            BuildSettings(onnx=NANODET, precision="int8", qdq_onnx=NANODET),
            api=api,
            fingerprint=fp,
        )
    assert not list(store.root.rglob("*.plan"))


def test_head_selection_on_the_real_nanodet_network(rtx):
    api, _ = rtx
    logger = api.logger()
    network = api.mod.Builder(logger).create_network(api.network_flags())
    parser = api.mod.OnnxParser(network, logger)
    assert parser.parse_from_file(str(NANODET))
    layers, outputs = api.network_layers(network)
    chosen = select_layers(layers, outputs, ("@first_conv", "@head"))
    convs = {layers[i].name: why for i, why in chosen.items() if layers[i].type == "CONVOLUTION"}
    first_conv = next(layer.name for layer in layers if layer.type == "CONVOLUTION")
    # The stem plus one conv per output pair (3 strides, scores+boxes split after one conv each).
    assert convs.pop(first_conv) == "@first_conv" and len(convs) == 3 and set(convs.values()) == {"@head"}
    assert sum(layers[i].type == "ACTIVATION" for i in chosen) == 3  # the three sigmoids


# --- fake TensorRT <= 10 (written to the docs, not run here) ---------------------------------------
def batches_of(n: int, batch: int = 1, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, *SHAPE[1:])).astype(np.float32) for _ in range(n)]


def fake_int8_build(tmp_path, mod, *, batches=None, force=True, allocator=None, **kw):
    api = TrtApi(mod)
    store = EngineStore(tmp_path / "engines")
    settings = BuildSettings(onnx=NANODET, precision="int8", **{"calibration": CAL, **kw})
    mod.calls.clear()
    result = build(
        store,
        MODEL,
        settings,
        api=api,
        fingerprint=fp_for(api),
        force=force,
        calibration_batches=batches,
        device_allocator=allocator if allocator is not None else fake_tensorrt.FakeAllocator(),
    )
    config = next(c[1] for c in mod.calls if c[0] == "build")
    return api, store, settings, result, config


def test_feeder_feeds_in_order_copies_bytes_and_drops_partial_batch():
    alloc = fake_tensorrt.FakeAllocator()
    # Caller batches of 3, 1, 4 samples; calibration batch 2; samples 7 -> [0,1] [2,3] [4,5], drop [6].
    data = batches_of(3, batch=3)[0], batches_of(1, seed=1)[0], batches_of(1, batch=4, seed=2)[0]
    flat = np.concatenate(data)
    feeder = BatchFeeder(data, (2, 3, 416, 416), samples=7, allocator=alloc)
    ptrs = [feeder.next_pointer() for _ in range(4)]
    assert ptrs[:3] == [alloc.buffers[0].ptr] * 3 and ptrs[3] is None and feeder.error is None
    assert len(alloc.buffers) == 1 and alloc.buffers[0].nbytes == 2 * 3 * 416 * 416 * 4  # allocated once
    assert [raw for _, raw in alloc.copies] == [flat[i : i + 2].tobytes() for i in (0, 2, 4)]
    assert (feeder.batches_fed, feeder.samples_taken, feeder.dropped) == (3, 7, 1)
    feeder.close()
    assert alloc.buffers[0].freed and feeder.next_pointer() is None


def test_feeder_errors_are_kept_not_raised():
    bad = BatchFeeder(
        [np.zeros(SHAPE, np.float64)], SHAPE, samples=1, allocator=fake_tensorrt.FakeAllocator()
    )
    assert bad.next_pointer() is None
    assert "calibration batch 0 is float64 [1, 3, 416, 416]; expected float32 [N, 3, 416, 416]" in str(
        bad.error
    )
    short = BatchFeeder(batches_of(2), SHAPE, samples=5, allocator=fake_tensorrt.FakeAllocator())
    assert short.next_pointer() is not None and short.next_pointer() is not None
    assert short.next_pointer() is None
    assert "ended after 2 samples; calibration.samples is 5" in str(short.error)


def test_calibration_cache_atomic_and_identity_checked(tmp_path):
    ident = {"method": "entropy", "samples": 8, "onnx_sha256": "a" * 64}
    cache = CalibrationCache(tmp_path / "k.calib", ident)
    assert cache.load() is None
    sha = cache.save(b"TRT-1003-EntropyCalibration2\ninput: 3c010a14\n")
    assert sha == hashlib.sha256((tmp_path / "k.calib").read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.calib", "k.calib.meta"]  # no temp files left
    assert cache.load() == b"TRT-1003-EntropyCalibration2\ninput: 3c010a14\n"
    for change in ({"method": "minmax"}, {"samples": 9}, {"onnx_sha256": "b" * 64}):
        assert CalibrationCache(tmp_path / "k.calib", {**ident, **change}).load() is None
    (tmp_path / "k.calib").write_bytes(b"edited")  # torn/edited: sha256 no longer matches its meta
    assert cache.load() is None


def test_calibrator_protocol_on_fake_bases(tmp_path):
    api = TrtApi(fake_tensorrt.make("10.3.0", int8=True))
    alloc = fake_tensorrt.FakeAllocator()
    cache = CalibrationCache(tmp_path / "k.calib", {"method": "percentile"})
    cal = make_calibrator(
        api, "percentile", BatchFeeder(batches_of(2), SHAPE, 2, alloc), cache, quantile=0.999
    )
    assert isinstance(cal, api.mod.IInt8LegacyCalibrator) and cal.base_initialised
    assert cal.get_batch_size() == 1 and (cal.get_quantile(), cal.get_regression_cutoff()) == (0.999, 1.0)
    assert cal.read_calibration_cache() is None
    assert cal.get_batch(["input_1:0"]) == [alloc.buffers[0].ptr] and cal.get_batch(["input_1:0"])
    assert cal.get_batch(["input_1:0"]) is None
    cal.write_calibration_cache(memoryview(b"scales"))
    assert cache.load() == b"scales" and cal.cache_sha256 == hashlib.sha256(b"scales").hexdigest()
    assert isinstance(
        make_calibrator(api, "minmax", BatchFeeder([], SHAPE, 1, alloc), cache), api.mod.IInt8MinMaxCalibrator
    )
    with pytest.raises(UnavailableError, match="calibration method 'kl' is unknown"):
        make_calibrator(api, "kl", BatchFeeder([], SHAPE, 1, alloc), cache)
    old = TrtApi(fake_tensorrt.make("10.3.0", int8=True, calibrators=("IInt8EntropyCalibrator2",)))
    with pytest.raises(
        UnavailableError, match=r"IInt8MinMaxCalibrator \(minmax\) is not available on tensorrt"
    ):
        old.calibrator_base("minmax")


def test_weakly_typed_int8_build_flags_calibrator_and_layer_constraints(tmp_path):
    mod = fake_tensorrt.make("10.3.0", int8=True)
    data = batches_of(8)
    alloc = fake_tensorrt.FakeAllocator()
    api, store, settings, res, config = fake_int8_build(tmp_path, mod, batches=data, allocator=alloc)
    F = mod.BuilderFlag
    assert {F.INT8, F.FP16, F.PREFER_PRECISION_CONSTRAINTS} <= set(config.flags_set)
    assert isinstance(config.int8_calibrator, mod.IInt8EntropyCalibrator2)
    assert ("calibration_profile", config.profiles[0]) in mod.calls
    # TensorRT's calibration loop: batch size 1, no cache yet, 8 batches in order, then the cache written.
    assert ("calib_batch_size", 1) in mod.calls
    assert [c for c in mod.calls if c[0] == "calib_batch"] == [("calib_batch", [alloc.buffers[0].ptr])] * 8
    assert [raw for _, raw in alloc.copies] == [b.tobytes() for b in data] and alloc.buffers[0].freed

    kept = {layer.name: layer for layer in mod.last_network.layers if layer.precision is not None}
    assert sorted(kept) == [
        "backbone/Sigmoid_gate",  # by the default name pattern
        "head/box/Conv",
        "head/box/Reshape",
        "head/box/Softmax",
        "head/cls/Conv",
        "head/cls/Reshape",
        "head/cls/Sigmoid",
        "stem/Conv",  # @first_conv
    ]
    assert all(
        x.precision == mod.DataType.HALF and x.output_types == {0: mod.DataType.HALF} for x in kept.values()
    )

    calib = store.calib_path(MODEL, res.key)
    assert calib.read_bytes() == b"FAKE-CALIB-8-batches"
    assert res.manifest.build.calibration == {**CAL, "cache_sha256": sha256_file(calib)}
    assert check(store, MODEL, settings, fp_for(api)).ok

    # Rebuild (forced): the cache matches -> read, no batches needed, no device memory touched.
    alloc2 = fake_tensorrt.FakeAllocator()
    _, _, _, again, _ = fake_int8_build(tmp_path, mod, batches=None, allocator=alloc2)
    assert ("calib_cache_read", b"FAKE-CALIB-8-batches") in mod.calls and not alloc2.buffers
    assert not [c for c in mod.calls if c[0] == "calib_batch"]
    assert again.key == res.key and again.manifest.build.calibration == res.manifest.build.calibration

    # Other samples: other key, the old cache ignored, recalibrated; check names the reason.
    other = BuildSettings(onnx=NANODET, precision="int8", calibration={"method": "entropy", "samples": 4})
    assert check(store, MODEL, other, fp_for(api)).reasons == ["calibration changed"]
    fake_int8_build(tmp_path, mod, batches=data, calibration={"method": "entropy", "samples": 4})
    assert len([c for c in mod.calls if c[0] == "calib_batch"]) == 4


def test_weakly_typed_int8_options_and_fallbacks(tmp_path):
    # OBEY, fp32 for kept layers, a custom pattern list; percentile records its quantile.
    mod = fake_tensorrt.make("10.3.0", int8=True)
    _, _, _, res, config = fake_int8_build(
        tmp_path,
        mod,
        batches=batches_of(8),
        precision_constraints="obey",
        int8_keep_precision="fp32",
        int8_keep_layers=(r"^head/cls/", r"Shape"),
        calibration={"method": "percentile", "samples": 8},
    )
    assert mod.BuilderFlag.OBEY_PRECISION_CONSTRAINTS in config.flags_set
    assert isinstance(config.int8_calibrator, mod.IInt8LegacyCalibrator)
    assert ("calib_quantile", 0.9999, 1.0) in mod.calls
    kept = {x.name: x.precision for x in mod.last_network.layers if x.precision is not None}
    # shape/Shape matches the pattern but has an INT32 output: never constrained.
    assert kept == dict.fromkeys(
        ["head/cls/Conv", "head/cls/Sigmoid", "head/cls/Reshape"], mod.DataType.FLOAT
    )
    assert res.manifest.build.calibration["quantile"] == 0.9999
    # Pre-8.2 TensorRT: STRICT_TYPES is the only way to make layer precisions binding.
    old = fake_tensorrt.make("8.0.0", int8=True, constraint_flags=("STRICT_TYPES",))
    _, _, _, _, config = fake_int8_build(tmp_path / "old", old, batches=batches_of(8))
    assert old.BuilderFlag.STRICT_TYPES in config.flags_set


def test_int8_build_failures_leave_store_untouched(tmp_path):
    mod = fake_tensorrt.make("10.3.0", int8=True)
    fake_int8_build(tmp_path, mod, batches=batches_of(8))
    store = EngineStore(tmp_path / "engines")
    before = tree(store.root)
    with pytest.raises(BuildError, match=r"INT8 calibration failed: calibration batch 0 is float64"):
        fake_int8_build(
            tmp_path, mod, batches=[np.zeros(SHAPE)], calibration={"method": "minmax", "samples": 8}
        )
    with pytest.raises(
        BuildError, match=r"INT8 calibration failed: the calibration set ended after 3 samples"
    ):
        fake_int8_build(tmp_path, mod, batches=batches_of(3), calibration={"method": "minmax", "samples": 8})
    with pytest.raises(
        BuildError, match=r"needs calibration batches .* no reusable calibration cache at .*\.calib"
    ):
        fake_int8_build(tmp_path, mod, batches=None, calibration={"method": "minmax", "samples": 8})
    assert {k: v for k, v in tree(store.root).items() if not k.startswith("timing/")} == {
        k: v for k, v in before.items() if not k.startswith("timing/")
    }  # no engine and no calibration cache from a broken calibration


def qdq_stub() -> onnx.ModelProto:
    """The smallest Q/DQ graph: x -> QuantizeLinear -> DequantizeLinear -> y."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("z", TensorProto.INT8, [], [0]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 416, 416])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 416, 416])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_int8_from_qdq_and_npy_data_and_without_int8_support(tmp_path):
    qdq = tmp_path / "model-qdq.onnx"
    onnx.save(qdq_stub(), str(qdq))  # the fake parser only looks for DequantizeLinear nodes
    cal = {**CAL, "cache_sha256": sha256_file(qdq)}
    # Weakly typed + Q/DQ: INT8 + FP16 flags, no calibrator, no constraints, the Q/DQ file parsed.
    weak = fake_tensorrt.make("10.3.0", int8=True)
    _, _, _, res, config = fake_int8_build(tmp_path / "w", weak, qdq_onnx=qdq, calibration=cal)
    assert set(config.flags_set) == {weak.BuilderFlag.INT8, weak.BuilderFlag.FP16}
    assert config.int8_calibrator is None and ("parse", "file", str(qdq)) in weak.calls
    assert res.manifest.build.calibration == cal
    # Strongly typed (TensorRT 11) + Q/DQ: no precision flags at all.
    strong = fake_tensorrt.make("11.0.0", weak=False, explicit_batch=False, int8=True)
    _, _, _, res, config = fake_int8_build(tmp_path / "s", strong, qdq_onnx=qdq, calibration=cal)
    assert config.flags_set == [] and ("parse", "file", str(qdq)) in strong.calls
    assert not hasattr(config, "int8_calibrator") or config.int8_calibrator is None
    # Calibration data from a .npy file (what a build in a child process reads).
    npy = tmp_path / "calib.npy"
    np.save(npy, np.concatenate(batches_of(8)))
    assert [b.shape for b in npy_batches(npy)] == [(8, 3, 416, 416)]
    alloc = fake_tensorrt.FakeAllocator()
    fake_int8_build(tmp_path / "n", weak, batches=None, calibration_data=npy, allocator=alloc)
    assert len(alloc.copies) == 8
    settings = BuildSettings(
        onnx=NANODET, precision="int8", calibration=CAL, calibration_data=npy, qdq_onnx=qdq
    )
    assert BuildSettings.from_request(json.loads(json.dumps(settings.to_request()))) == settings
    # Weakly typed TensorRT without calibrator classes: int8 is not offered.
    with pytest.raises(UnavailableError, match=r"precision 'int8' is not available on tensorrt 10\.3\.0"):
        fake_int8_build(tmp_path / "x", fake_tensorrt.make("10.3.0"), batches=batches_of(8))
    with pytest.raises(ValueError, match=r"calibration.method 'kl' is not one of"):
        BuildSettings(onnx=NANODET, precision="int8", calibration={"method": "kl", "samples": 8})


# --- cuda_buffers against a fake cuda-python runtime -------------------------------------------------
class FakeCudart:
    """The slice of cuda.bindings.runtime that DeviceBuffer uses: (err, *values) tuples."""

    class cudaError_t(int):
        pass

    cudaError_t.cudaSuccess = cudaError_t(0)  # type: ignore[attr-defined]

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost = 1, 2

    def __init__(self) -> None:
        self.mem: dict[int, bytearray] = {}
        self.calls: list[str] = []

    def cudaMalloc(self, n: int):
        if n > 1 << 40:
            return (self.cudaError_t(2), 0)
        ptr = 0x1000 * (len(self.mem) + 1)
        self.mem[ptr] = bytearray(n)
        return (self.cudaError_t(0), ptr)

    def cudaMemcpy(self, dst: int, src: int, n: int, kind: int):
        import ctypes

        if kind == 1:
            self.mem[dst][:n] = ctypes.string_at(src, n)
        else:
            ctypes.memmove(dst, bytes(self.mem[src][:n]), n)
        return (self.cudaError_t(0),)

    def cudaFree(self, ptr: int):
        self.calls.append(f"free {ptr:#x}")
        del self.mem[ptr]
        return (self.cudaError_t(0),)

    def cudaGetErrorName(self, err):
        return (self.cudaError_t(0), {2: b"cudaErrorMemoryAllocation"}[int(err)])


def test_device_buffer_and_cuda_call_with_fake_runtime():
    rt = FakeCudart()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with DeviceBuffer(a.nbytes, rt) as buf:
        buf.copy_from_host(a)
        assert bytes(rt.mem[buf.ptr]) == a.tobytes()
        assert np.array_equal(buf.copy_to_host(np.empty_like(a)), a)
        with pytest.raises(CudaError, match="does not fit"):
            buf.copy_from_host(np.zeros(13, np.float32))
        ptr = buf.ptr
    assert rt.calls == [f"free {ptr:#x}"] and buf.ptr == 0
    with pytest.raises(
        CudaError, match=r"cudaMalloc\(2199023255552\) failed: cudaErrorMemoryAllocation \(2\)"
    ):
        DeviceBuffer(2 << 40, rt)
    assert cuda_call(rt, "x", (rt.cudaError_t(0), 1, 2)) == (1, 2)


def test_weakly_typed_fp16_pins_the_fp32_island(tmp_path):
    """Grafted decode + NMS (engines.build.islands) must not run in FP16 on TensorRT <= 10: every island layer
    that reads or writes floats (a comparison to BOOL included) is pinned to FP32 with
    PREFER_PRECISION_CONSTRAINTS; only float outputs get an output type; the rest is left alone."""
    island = [
        ("keep_fp32/graft/Mul_7", "ELEMENTWISE", ["scores", "boxes"], [("g0", "FLOAT")]),
        ("keep_fp32/graft/Equal_8", "ELEMENTWISE", ["g0", "g0"], [("g1", "BOOL")]),
    ]
    mod = fake_tensorrt.make("10.3.0", int8=True, layers=[*fake_tensorrt.DETECTOR_LAYERS, *island])
    api = TrtApi(mod)
    settings = BuildSettings(onnx=NANODET, precision="fp16")
    build(EngineStore(tmp_path / "engines"), MODEL, settings, api=api, fingerprint=fp_for(api), force=True)
    config = next(c[1] for c in mod.calls if c[0] == "build")
    assert {mod.BuilderFlag.FP16, mod.BuilderFlag.PREFER_PRECISION_CONSTRAINTS} <= set(config.flags_set)
    layers = {layer.name: layer for layer in mod.last_network.layers}
    mul, eq = layers["keep_fp32/graft/Mul_7"], layers["keep_fp32/graft/Equal_8"]
    assert mul.precision == mod.DataType.FLOAT and mul.output_types == {0: mod.DataType.FLOAT}
    assert eq.precision == mod.DataType.FLOAT and eq.output_types == {}  # reads floats; BOOL out kept
    assert all(x.precision is None for name, x in layers.items() if not name.startswith("keep_fp32/"))

    # FP32 builds (nothing to protect) and builds without an island set no constraint flag.
    plain = fake_tensorrt.make("10.3.0", int8=True)
    api = TrtApi(plain)
    build(EngineStore(tmp_path / "e2"), MODEL, settings, api=api, fingerprint=fp_for(api), force=True)
    config = next(c[1] for c in plain.calls if c[0] == "build")
    assert plain.BuilderFlag.PREFER_PRECISION_CONSTRAINTS not in set(config.flags_set)
