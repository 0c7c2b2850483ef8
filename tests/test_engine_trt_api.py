"""Version probes and runtime loading against `fake_tensorrt` (what cannot run here), plus the
real tensorrt_rtx answers where they exist on this machine."""

from __future__ import annotations

from pathlib import Path

import fake_tensorrt
import numpy as np
import pytest

from engines.build.builder import build
from engines.errors import BuildError, UnavailableError
from engines.fingerprint import Fingerprint
from engines.runtimes.base import BackendError
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

NANODET = Path(__file__).resolve().parent.parent / "agent" / "assets" / "nanodet-m-416.onnx"


def gpu_fp(api: TrtApi, gpu: str | None = "Orin", cc: str = "8.7") -> Fingerprint:
    return Fingerprint(api.flavor, api.version, gpu, cc, "12.6", "12.6", "R36.4.0", None, "linux-aarch64")


def fake_build(tmp_path, mod, **settings_kw):
    api = TrtApi(mod)
    store = EngineStore(tmp_path / "engines")
    events: list[tuple[str, int, int]] = []
    result = build(
        store,
        "det",
        BuildSettings(onnx=NANODET, **settings_kw),
        api=api,
        fingerprint=gpu_fp(api),
        on_progress=lambda *e: events.append(e),
        force=True,
    )
    config = next(c[1] for c in mod.calls if c[0] == "build")
    return api, store, result, config, events


def test_weakly_typed_tensorrt10_fp16_uses_builder_flag(tmp_path):
    mod = fake_tensorrt.make("10.3.0")
    api, _, result, config, events = fake_build(tmp_path, mod, precision="fp16", optimization_level=5)
    assert api.flavor == "tensorrt" and api.weakly_typed
    # EXPLICIT_BATCH where the module has it; no STRONGLY_TYPED on a weakly typed build.
    assert ("create_network", 1 << 0) in mod.calls
    assert mod.BuilderFlag.FP16 in config.flags_set and ("parse", "file", str(NANODET)) in mod.calls
    assert config.pool_limits == {mod.MemoryPoolType.WORKSPACE: 1 << 30}
    assert config.builder_optimization_level == 5
    assert (
        ("Building engine", 2, 2) in events and events[0] == ("parse", 0, 1) and events[-1] == ("save", 1, 1)
    )
    assert result.manifest.fingerprint["gpu_name"] == "Orin" and result.manifest.build.precision == "fp16"
    assert result.manifest.build.timing_cache["hit"] is False
    # The saved timing cache (merged, atomically) is loaded by the next build: a real hit.
    _, _, again, _, _ = fake_build(tmp_path, mod, precision="fp16", optimization_level=5)
    assert again.manifest.build.timing_cache["hit"] is True
    assert Path(again.manifest.build.timing_cache["path"]).read_bytes() == b"trt10.3.0@gpu0;conv1,conv2"


def test_strongly_typed_tensorrt11_fp16_converts_the_onnx(tmp_path):
    mod = fake_tensorrt.make("11.0.0", weak=False, explicit_batch=False)
    api, _, result, config, _ = fake_build(tmp_path, mod, precision="fp16")
    assert api.strongly_typed
    assert ("create_network", 1 << 1) in mod.calls  # STRONGLY_TYPED only
    assert config.flags_set == []
    parsed = [c for c in mod.calls if c[0] == "parse"]
    assert parsed and parsed[0][1] == "bytes"  # the FP16-converted graph, not the file
    assert result.built


def test_old_tensorrt_fallbacks_and_unavailable_features(tmp_path):
    mod = fake_tensorrt.make(
        "8.2.0",
        memory_pool=False,
        opt_level=False,
        progress=False,
        node_names=False,
        strongly_typed_flag=False,
    )
    _, _, _, config, events = fake_build(tmp_path, mod)
    assert config.max_workspace_size == 1 << 30  # pre-8.4 workspace knob
    assert [e[0] for e in events] == [
        "parse",
        "parse",
        "build",
        "build",
        "serialize",
        "serialize",
        "save",
        "save",
    ]
    with pytest.raises(
        UnavailableError, match=r"builder optimization level 5 is not available on tensorrt 8\.2\.0"
    ):
        fake_build(tmp_path, mod, optimization_level=5)
    with pytest.raises(UnavailableError, match=r"precision 'int8' is not available on tensorrt 8\.2\.0"):
        fake_build(tmp_path, mod, precision="int8")
    bad = fake_tensorrt.make("8.2.0", node_names=False, parse_errors=[("", "", "No importer registered")])
    with pytest.raises(
        BuildError, match=rf"cannot parse ONNX model {NANODET}: node #3: UNSUPPORTED_NODE: No importer"
    ):
        fake_build(tmp_path, bad)


def test_parse_error_names_node_and_op(tmp_path):
    mod = fake_tensorrt.make("10.3.0", parse_errors=[("fancy_node", "FancyOp", "Plugin not found")])
    with pytest.raises(
        BuildError, match=r"node fancy_node \(op FancyOp\): UNSUPPORTED_NODE: Plugin not found"
    ):
        fake_build(tmp_path, mod)


def test_dla_core_with_gpu_fallback(tmp_path):
    # DLA runs FP16/INT8 only (fp32 is refused: tests/test_trt_review.py); the int8 fake has layers to place.
    mod = fake_tensorrt.make("10.3.0", dla_cores=2, int8=True)
    _, _, result, config, _ = fake_build(tmp_path, mod, dla_core=1, precision="fp16")
    assert config.default_device_type == mod.DeviceType.DLA and config.DLA_core == 1
    assert mod.BuilderFlag.GPU_FALLBACK in config.flags_set
    assert result.manifest.fingerprint["dla_core"] == 1
    with pytest.raises(
        UnavailableError, match=r"DLA core 0 requested but tensorrt 10\.3\.0 reports 0 DLA cores"
    ):
        fake_build(tmp_path, fake_tensorrt.make("10.3.0", dla_cores=0), dla_core=0, precision="fp16")


def test_non_rtx_tensorrt_needs_a_gpu_to_build(tmp_path):
    api = TrtApi(fake_tensorrt.make("10.3.0"))
    with pytest.raises(BuildError, match=r"TensorRT 10\.3\.0 needs a CUDA GPU to build 'det'"):
        build(
            EngineStore(tmp_path),
            "det",
            BuildSettings(onnx=NANODET),
            api=api,
            fingerprint=gpu_fp(api, gpu=None, cc="8.6"),
        )


# --- runtime ---------------------------------------------------------------------------------
def test_tensorrt_backend_load_with_fake(tmp_path):
    mod = fake_tensorrt.make("10.3.0")
    api, store, result, _, _ = fake_build(tmp_path, mod)
    # What the backend describes of the engine (the fake's IO).
    _, engine = api.deserialize(store.read_plan("det", result.key), api.logger())
    io = {t.name: t for t in api.io_tensors(engine)}
    assert io["images"].is_input and io["images"].shape == (-1, 3, 416, 416)
    assert io["images"].profile is not None and io["images"].profile[2] == (8, 3, 416, 416)
    assert [(n, t.dtype) for n, t in io.items() if not t.is_input] == [
        ("scores", np.float32),
        ("boxes", np.float16),
    ]
    # The execution slots need cuda-python and a GPU: here load() says so, naming the plan.
    backend = TensorRTBackend(store, "det", result.key, api=api, fingerprint=gpu_fp(api))
    with pytest.raises(BackendError, match=r"cannot set up execution for .*\.plan: .*cuda-python"):
        backend.load()
    assert not backend.loaded

    with pytest.raises(BackendError, match=r"tensorrt: cannot load .*\.plan: no CUDA GPU is visible"):
        TensorRTBackend(store, "det", result.key, api=api, fingerprint=gpu_fp(api, gpu=None)).load()

    plan = store.plan_path("det", result.key)
    plan.write_bytes(b"X" + plan.read_bytes()[1:])
    with pytest.raises(BackendError, match=r"is corrupted \(sha256 mismatch"):
        TensorRTBackend(store, "det", result.key, api=api, fingerprint=gpu_fp(api)).load()


def test_tensorrt_backend_refused_plan(tmp_path):
    import hashlib
    from dataclasses import replace

    from engines.manifest import Manifest

    mod = fake_tensorrt.make("10.3.0")
    api = TrtApi(mod)
    store = EngineStore(tmp_path)
    _, _, result, _, _ = fake_build(tmp_path / "x", mod)
    m = result.manifest
    plan = b"not a plan"
    store.write(
        "det",
        "k",
        plan,
        Manifest(m.fingerprint, replace(m.build, plan_sha256=hashlib.sha256(plan).hexdigest())),
    )
    with pytest.raises(
        BackendError,
        match=r"TensorRT refused .*/k-[0-9a-f]{12}\.plan: Serialization assertion magicTag failed",
    ):
        TensorRTBackend(store, "det", "k", api=api, fingerprint=gpu_fp(api)).load()


def test_real_rtx_here(tmp_path):
    trt = pytest.importorskip("tensorrt_rtx")
    api = TrtApi(trt)
    assert (
        api.flavor == "tensorrt_rtx"
        and api.strongly_typed
        and api.aot_without_gpu
        and api.has_progress_monitor
    )
    assert not api.weakly_typed and "8.6" in api.compute_capabilities()
    config = trt.Builder(api.logger()).create_builder_config()
    with pytest.raises(
        UnavailableError, match=r"compute capability 7\.0 is not available on tensorrt_rtx .*targets: 7\.5"
    ):
        api.set_target_compute_capability(config, "7.0")
    with pytest.raises(UnavailableError, match="the FP16 builder flag is not available on tensorrt_rtx"):
        api.set_precision_flag(config, "fp16")
    # Runtime loading needs a GPU: refused clearly (the plan is never handed to TensorRT).
    fp = Fingerprint(api.flavor, api.version, None, "8.6", None, None, None, None, "linux-x86_64")
    with pytest.raises(BackendError, match=r"tensorrt_rtx: cannot load .* no CUDA GPU is visible"):
        TensorRTBackend(EngineStore(tmp_path), "det", "0123", api=api, fingerprint=fp).load()


def test_execution_needs_the_tensor_address_api():
    """TensorRT < 8.5 (no IExecutionContext.set_tensor_address / execute_async_v3): a clear refusal that
    `check` and the daemon report; TensorRT-RTX has the API."""
    old = TrtApi(fake_tensorrt.make("8.4.3"))  # the fake module has no execution context API at all
    with pytest.raises(
        UnavailableError, match=r"TensorRT 8\.4\.3 cannot run engines here: .*TensorRT >= 8\.5"
    ):
        old.require_execution()
    rtx = pytest.importorskip("tensorrt_rtx")
    TrtApi(rtx).require_execution()
