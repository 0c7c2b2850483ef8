"""Issue 35, the runtime items: cuda-python pins and no blocking waits while holding (7), handle accessors
and the calibration copy (10), activation memory per slot and unified memory (11), errors by code (12),
data-dependent outputs (14). On `fake_tensorrt` + `fake_cudart` (TensorRT cannot run here), the real
TensorRT-RTX 1.7 module where it has the API (error recorders and output allocators; a runtime without a
GPU), mypy against tensorrt-stubs 10.13 for the rest.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import fake_tensorrt
import numpy as np
import pytest
from engine_fixtures import gpu_fp, store_engine
from fake_cudart import FakeCudart, FakeHandle
from packaging.requirements import Requirement

from engines.cuda.buffers import Stream, cuda_allocator
from engines.cuda.handles import handle_of
from engines.runtimes.base import BackendError, PlanRefusedError
from engines.runtimes.slots import SlotPool
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi
from engines.trt.runtime import TrtErrorRecord, device_failure

ROOT = Path(__file__).resolve().parent.parent
NANODET = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"
BATCH = np.zeros((2, 3, 416, 416), np.float32)


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    rt = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: rt)
    return rt


def backend(tmp_path: Path, mod: ModuleType, contexts: int = 1) -> TensorRTBackend:
    api = TrtApi(mod)
    fp = gpu_fp(api)
    store = EngineStore(tmp_path / "engines")
    m = store_engine(store, "det", BuildSettings(onnx=NANODET, contexts=contexts, precision="fp16"), fp)
    assert m.key is not None
    return TensorRTBackend(store, "det", m.key, api=api, fingerprint=fp, contexts=contexts)


def _slots(b: TensorRTBackend) -> list[Any]:
    assert b._pool is not None
    return b._pool.slots


# --- 7: cuda-python pinned per platform; no host wait while holding what another thread needs -------------
@pytest.mark.parametrize("extra", ["cuda", "nvdec"])
def test_cuda_python_is_pinned_per_platform(extra: str) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras[extra]]
    cuda = [r for r in reqs if r.name == "cuda-python"]

    def allowed(machine: str, version: str) -> bool:
        env = {"platform_machine": machine}
        applies = [r for r in cuda if r.marker is None or r.marker.evaluate(env)]
        assert len(applies) == 1, f"{extra} on {machine}: {applies}"
        return applies[0].specifier.contains(version)

    # JetPack 6 = CUDA 12.x: 13.x needs driver >= 580; before 12.9.1 synchronize holds the GIL.
    assert allowed("aarch64", "12.9.1") and allowed("aarch64", "12.9.4")
    assert not allowed("aarch64", "13.0.0") and not allowed("aarch64", "12.6.0")
    # An x86 CUDA 13 box may take 13.
    assert allowed("x86_64", "13.0.1") and allowed("x86_64", "12.9.1")
    assert not allowed("x86_64", "12.8.0")


def test_a_profile_switch_queues_no_host_wait(cudart: FakeCudart) -> None:
    """set_optimization_profile_async is stream-ordered with the batch on the slot's stream: the only
    host wait of a batch is the one for its outputs."""
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2
    engine = mod.ICudaEngine(mod.ENGINE_IO)
    pool = SlotPool.create(engine, _io_specs(mod), 1, "p.plan", profiles_per_context=2, api=TrtApi(mod))
    slot = pool.slots[0]
    assert slot.active == 1  # sizing the buffers visited both profiles
    cudart.syncs.clear()
    pool.run(BATCH)  # fits profile 0 first: a switch
    assert slot.active == 0
    assert cudart.syncs == ["stream"]
    pool.close()


def test_a_slot_blocked_in_synchronize_does_not_stop_another(cudart: FakeCudart) -> None:
    """A synchronize that blocks (a long batch; cuda-python < 12.9.1 even held the GIL) holds only its own
    slot: the other slot takes and finishes a batch meanwhile."""
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2
    engine = mod.ICudaEngine(mod.ENGINE_IO)
    pool = SlotPool.create(engine, _io_specs(mod), 2, "p.plan", profiles_per_context=1, api=TrtApi(mod))
    first_waiting, second_done = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def on_synchronize(what: str) -> None:
        if threading.current_thread().name == "first" and not first_waiting.is_set():
            first_waiting.set()
            seen["second finished while first waited"] = second_done.wait(30)

    cudart.on_synchronize = on_synchronize
    first = threading.Thread(target=pool.run, args=(BATCH,), name="first")
    first.start()
    assert first_waiting.wait(30)
    pool.run(BATCH)  # this thread, on the other slot
    second_done.set()
    first.join(30)
    assert seen == {"second finished while first waited": True}
    pool.close()


def _io_specs(mod: ModuleType) -> list[Any]:
    from engines.runtimes.slots import IoSpec

    specs = [
        IoSpec(name, mode == 1, np.dtype(mod.nptype(mod.DataType(dt))))
        for name, mode, _shape, dt, _p in mod.ENGINE_IO
    ]
    return sorted(specs, key=lambda s: not s.is_input)


# --- 10: handles through getPtr(); calibration batches through pinned memory ------------------------------
def test_handle_of_uses_getptr_not_the_deprecated_int() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert handle_of(FakeHandle(0x1234)) == 0x1234
        assert handle_of(0) == 0 and handle_of(None) == 0 and handle_of(77) == 77
        stream = Stream(FakeCudart())
        # getPtr() is where the handle is stored, not the handle (cuda-bindings 13.3.1 on the GPU box)
        assert stream.handle == stream.raw._value != stream.raw.getPtr()
    with pytest.warns(DeprecationWarning):  # what the fake makes of int(): cuda-bindings 12.9.1's warning
        int(FakeHandle(1))


def test_handle_of_falls_back_to_int_before_getptr() -> None:
    class OldHandle:  # cuda-python before getPtr
        def __int__(self) -> int:
            return 99

    assert handle_of(OldHandle()) == 99


def test_nvdec_primary_context_through_handle_of(monkeypatch: pytest.MonkeyPatch) -> None:
    nvdec = pytest.importorskip("pipelines.sources.nvdec")

    class Driver(ModuleType):
        def cuInit(self, flags: int) -> tuple[int]:
            return (0,)

        def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:
            return 0, ordinal

        def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, FakeHandle]:
            return 0, FakeHandle(0xC0FFEE)

    real_import = nvdec.importlib.import_module
    monkeypatch.setattr(
        nvdec.importlib,
        "import_module",
        lambda name: Driver(name) if name == "cuda.bindings.driver" else real_import(name),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert nvdec._primary_context(0) == 0xC0FFEE


def test_calibration_batches_reach_the_device_through_pinned_memory() -> None:
    """cudaMemcpy from pageable memory returns before the DMA is done; from pinned memory it does not."""
    rt = FakeCudart()
    buf = cuda_allocator(rt)(4 * 3 * 8 * 8)
    batch = np.arange(3 * 8 * 8, dtype=np.float32).reshape(1, 3, 8, 8)
    buf.copy_from_host(batch)
    dst, src, nbytes, kind, pinned = rt.copies[-1]
    assert (dst, nbytes, kind) == (buf.ptr, batch.nbytes, "cudaMemcpyHostToDevice")
    assert pinned and src != batch.ctypes.data
    back = np.empty_like(batch)
    ctypes.memmove(back.ctypes.data, buf.ptr, batch.nbytes)
    assert np.array_equal(back, batch)
    buf.free()
    assert rt.live == 0  # the staging buffer went with it


# --- 11: one activation block per slot, sized for its profiles; unified memory: no device copies --------
def test_each_slot_owns_its_activation_block(tmp_path: Path, cudart: FakeCudart) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2
    b = backend(tmp_path, mod, contexts=2)
    b.load()
    slots = _slots(b)
    assert len(slots) == 2
    blocks = [s.activations for s in slots]
    assert all(blk is not None for blk in blocks) and len({blk.ptr for blk in blocks}) == 2
    engine = b._engine
    for s, blk in zip(slots, blocks, strict=True):
        assert s.context._strategy.name == "USER_MANAGED"
        assert s.context.device_memory == blk.ptr
        assert blk.nbytes == max(engine.get_device_memory_size_for_profile_v2(p) for p, *_ in s.profiles)
    assert mod._static_context_bytes == 0  # TensorRT allocated no activation memory of its own
    out = b.infer(BATCH)
    assert out["scores"].shape == (2, 3598, 80)
    b.close()
    assert cudart.live == 0


def test_a_user_managed_context_without_its_block_fails_by_code(tmp_path: Path, cudart: FakeCudart) -> None:
    mod = fake_tensorrt.make("10.3.0")
    b = backend(tmp_path, mod)
    b.load()
    slot = _slots(b)[0]
    slot.context._device_memory_bytes = 0
    with pytest.raises(BackendError, match=r"execute_async_v3 failed \(TensorRT refused it\): INVALID_STATE"):
        b.infer(BATCH)
    b.close()


def _per_slot_device_bytes(tmp_path: Path, integrated: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    rt = FakeCudart(integrated=integrated)
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: rt)
    b = backend(tmp_path / str(integrated), fake_tensorrt.make("10.3.0"))
    b.load()
    rt.copies.clear()
    b.infer(BATCH)
    if integrated:  # the device read the input and wrote the outputs in place
        assert rt.copies == []
    n = rt.device_bytes
    b.close()
    assert rt.live == 0
    return n


def test_unified_memory_keeps_no_device_copy_of_the_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device memory per slot, the fake's model (416x416 detector, batch 1..8, fp32 scores + fp16 boxes):
    before = TensorRT's STATIC block + IO device buffers; after, discrete = our block + IO device buffers;
    after, Jetson = our block only (the IO is mapped pinned memory)."""
    mod = fake_tensorrt.make("10.3.0")
    engine = mod.ICudaEngine(mod.ENGINE_IO)
    activations = engine.device_memory_size_v2
    io = 8 * 3 * 416 * 416 * 4 + 8 * 3598 * 80 * 4 + 8 * 3598 * 32 * 2
    discrete = _per_slot_device_bytes(tmp_path, False, monkeypatch)
    jetson = _per_slot_device_bytes(tmp_path, True, monkeypatch)
    assert discrete == activations + io  # before, STATIC: the same bytes, allocated by TensorRT
    assert jetson == activations
    print(f"per slot: before {activations + io} B, discrete after {discrete} B, Jetson after {jetson} B")


# --- 12: errors by code ---------------------------------------------------------------------------------
OOM = (
    "FAILED_ALLOCATION",
    "Requested amount of GPU memory (4294967296 bytes) could not be allocated. There may not be enough free "
    "memory for allocation to succeed.",
)


def test_an_allocation_failure_is_the_device_not_the_plan(tmp_path: Path, cudart: FakeCudart) -> None:
    """TensorRT's out-of-memory text names no CUDA error: only its code tells (a PlanRefusedError would
    have the agent rebuild the engine, in vain)."""
    mod = fake_tensorrt.make("10.3.0")
    mod._load_failure = OOM
    with pytest.raises(BackendError, match=r"could not be allocated.*\[FAILED_ALLOCATION\]") as e:
        backend(tmp_path, mod).load()
    assert not isinstance(e.value, PlanRefusedError)


def test_a_refused_plan_by_code_keeps_its_reason(tmp_path: Path, cudart: FakeCudart) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.refuse_loads = 1
    b = backend(tmp_path, mod)
    with pytest.raises(PlanRefusedError, match=r"UNSPECIFIED_ERROR") as e:
        b.load()
    assert e.value.reason == mod.refusal


def test_device_failure_by_code_then_by_tensorrts_category() -> None:
    serialization = TrtErrorRecord(
        "UNSPECIFIED_ERROR",
        "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization assertion "
        "header.magicTag == kEXPECTED_MAGIC_TAG failed.)",
    )
    driver = TrtErrorRecord(
        "UNSPECIFIED_ERROR",
        "[checkMacros.cpp::catchCudaError::250] Error Code 1: Cuda Runtime (cudaError 35: CUDA driver "
        "version is insufficient for CUDA runtime version)",
    )
    assert not device_failure([serialization])
    assert device_failure([serialization, driver])
    assert device_failure([TrtErrorRecord(*OOM)])
    assert not device_failure([TrtErrorRecord("INVALID_CONFIG", "Error Code 2: Cuda Runtime? no: config")])
    assert not device_failure([])


def test_real_rtx_error_recorder_gets_the_errors_by_code() -> None:
    """TensorRT-RTX 1.7 here (no GPU driver): a garbage plan gives a serialisation error and cudaError 35,
    both UNSPECIFIED_ERROR, to the recorder (not to the logger); the CUDA one makes it the device's."""
    trt = pytest.importorskip("tensorrt_rtx")
    api = TrtApi(trt, "tensorrt_rtx")
    recorder = api.error_recorder()
    logger = api.logger()
    runtime, engine = api.deserialize(b"not a plan" * 64, logger, None, recorder)
    assert engine is None and runtime.error_recorder is recorder
    records = recorder.records()
    assert recorder.num_errors() == len(records) > 0
    assert {r.code for r in records} == {"UNSPECIFIED_ERROR"}
    assert any("Serialization" in r.desc for r in records)
    assert device_failure(records) == any("Cuda Runtime" in r.desc for r in records)
    assert logger.errors == []
    assert recorder.drain() == records and recorder.num_errors() == 0


# --- 14: outputs of data-dependent shape ---------------------------------------------------------------
def _nms_engine(mod: ModuleType, rows: int) -> None:
    """An NMS-terminated export: [N, 6] detections (x1 y1 x2 y2 score class), N decided by the data."""
    mod.ENGINE_IO = [mod.ENGINE_IO[0], ("detections", 2, (-1, 6), 0, None)]
    mod._ENGINE_DDS = {"detections": rows}


@pytest.mark.parametrize("integrated", [False, True])
def test_an_nms_terminated_engine_loads_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, integrated: bool
) -> None:
    rt = FakeCudart(integrated=integrated)
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: rt)
    mod = fake_tensorrt.make("10.3.0")
    _nms_engine(mod, rows=5)
    b = backend(tmp_path, mod)
    b.load()
    assert [s.shape for s in b.output_specs] == [(None, 6)]
    out = b.infer(BATCH)
    assert out["detections"].shape == (5, 6)
    assert np.array_equal(out["detections"].ravel(), np.arange(30, dtype=np.float32))
    mod._ENGINE_DDS["detections"] = 0  # nothing detected
    assert b.infer(BATCH)["detections"].shape == (0, 6)
    mod._ENGINE_DDS["detections"] = 7
    assert b.infer(BATCH)["detections"].shape == (7, 6)
    b.close()
    assert rt.live == 0


def test_data_dependent_outputs_without_an_output_allocator_are_refused_clearly(
    tmp_path: Path, cudart: FakeCudart
) -> None:
    mod = fake_tensorrt.make("10.3.0")
    _nms_engine(mod, rows=5)
    del mod.IOutputAllocator
    refusal = r"\['detections'\] have a data-dependent shape .*IOutputAllocator"
    with pytest.raises(BackendError, match=refusal):
        backend(tmp_path, mod).load()
    assert cudart.live == 0


def test_a_failed_output_allocation_fails_the_batch_by_code(tmp_path: Path, cudart: FakeCudart) -> None:
    mod = fake_tensorrt.make("10.3.0")
    _nms_engine(mod, rows=5)
    b = backend(tmp_path, mod)
    b.load()
    slot = _slots(b)[0]
    failing = TrtApi(mod).output_allocator(lambda name, n: (_ for _ in ()).throw(MemoryError("no memory")))
    slot.context.set_output_allocator("detections", failing)
    with pytest.raises(BackendError, match=r"the device failed.*FAILED_ALLOCATION"):
        b.infer(BATCH)
    b.close()


def test_real_rtx_output_allocator_and_context_memory_api() -> None:
    """The TensorRT-RTX 1.7 classes take our subclasses and have the calls the slots make (a context
    needs a GPU: the calls themselves are written to the TensorRT docs)."""
    trt = pytest.importorskip("tensorrt_rtx")
    api = TrtApi(trt, "tensorrt_rtx")
    asked: list[tuple[str, int]] = []
    allocator = api.output_allocator(lambda name, n: asked.append((name, n)) or 0x1000)
    assert isinstance(allocator, trt.IOutputAllocator)
    assert allocator.reallocate_output_async("dets", 0, 2400, 256, 0) == 0x1000
    allocator.notify_shape("dets", trt.Dims([4, 6]))
    assert asked == [("dets", 2400)] and allocator.shapes == {"dets": (4, 6)}
    assert hasattr(trt.ExecutionContextAllocationStrategy, "USER_MANAGED")
    for name in ("set_device_memory", "set_output_allocator", "error_recorder"):
        assert hasattr(trt.IExecutionContext, name), name
    assert hasattr(trt.ICudaEngine, "get_device_memory_size_for_profile_v2")
    assert isinstance(api.error_recorder(), trt.IErrorRecorder)
