"""TensorRT / TensorRT-RTX runtime: load a stored plan (sha256 verified), run it on execution slots.

    backend = TensorRTBackend(store, "detector", check_result.key, contexts=2)
    backend.load()       # BackendError naming the plan: no GPU, corrupt, out of memory; PlanRefusedError
                         # when TensorRT refuses the plan itself (a rebuild can fix that one); the two
                         # are told apart by the codes an IErrorRecorder on the runtime receives
    backend.infer(batch) # any thread; slots (engines.runtimes.slots) overlap on their own streams;
                         # batch: a host array or a DeviceTensor (GPU preprocessing, no host copy)
    backend.last_gpu_ms  # device time of the last batch (CUDA events)
    backend.set_profiler(p); backend.layer_information()   # per-layer view (engines.runtimes.trt_layers)

Loading follows the manifest: a DLA engine's core is set on the runtime before deserialising, the slots
own the profile sets the build made (build.profiles_per_context), and serving contexts run at NVTX
verbosity LAYER_NAMES_ONLY although the engine is built DETAILED (for the inspector and `edge-agent
profile`, whose set_profiler goes back to DETAILED): TensorRT's docs say DETAILED slows enqueueV3.

Written to the TensorRT docs (Runtime.deserialize_cuda_engine, the tensor IO API); TensorRT cannot run
on this project's CI (no supported GPU). There the "no GPU" refusal, the logic around TensorRT
(tests/fake_tensorrt.py) and the attributes used (against the real tensorrt_rtx module) are tested, load()
end to end with a fake CUDA runtime (tests/test_engine_loading.py); the slots run on a GPU with a `fake_`
engine (tests/test_slots_gpu.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from engines.errors import EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.runtimes.base import Backend, BackendError, Batch, PlanRefusedError, TensorSpec
from engines.runtimes.slots import IoSpec, SlotPool
from engines.runtimes.trt_layers import engine_information
from engines.store import EngineStore
from engines.trt import IoTensor, TrtApi, import_trt
from engines.trt.runtime import device_failure

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

log = logging.getLogger(__name__)

# Only for a TensorRT without IErrorRecorder (errors by code: engines.trt.runtime.device_failure): its
# log when deserialisation fails for CUDA's sake, not the plan's: "Error Code 1: Cuda Runtime (...
# cudaError 35: CUDA driver version is insufficient ...)", "Cuda Driver (...)", "OutOfMemory (...)".
_CUDA_MARKS = ("cuda runtime", "cuda driver", "cudaerror", "outofmemory", "out of memory")


def _cuda_failure(errors: list[str]) -> bool:
    return any(mark in e.lower() for e in errors for mark in _CUDA_MARKS)


class TensorRTBackend(Backend):
    name = "tensorrt"
    accepts_device_input = True  # a DeviceTensor is bound as the input tensor (engines.runtimes.slots)

    def __init__(
        self,
        store: EngineStore,
        model: str,
        key: str,
        *,
        api: TrtApi | None = None,
        fingerprint: Fingerprint | None = None,
        precision: str | None = None,
        contexts: int = 1,
    ) -> None:
        if precision is None:
            try:
                manifest = store.manifest(model, key)
            except EngineError:  # reported by load(), which reads the manifest again
                manifest = None
            precision = manifest.build.precision if manifest else "fp32"
        super().__init__(precision)
        self.store, self.model, self.key = store, model, key
        self._api = api
        self._fingerprint = fingerprint
        self._runtime: trt.Runtime | None = None
        self._engine: trt.ICudaEngine | None = None
        self._contexts = contexts
        self._pool: SlotPool | None = None
        self._io: list[IoTensor] = []
        self._recorder: Any | None = None  # the runtime's IErrorRecorder (engine and contexts inherit it)
        # NVTX verbosity of the execution contexts ("layer_names_only" while serving), None where the
        # TensorRT has no such setting; the build's (manifest build.profiling_verbosity).
        self.nvtx_verbosity: str | None = None
        self._built_verbosity: str | None = None

    @property
    def plan_path(self) -> str:
        return str(self.store.plan_path(self.model, self.key))

    def _load_impl(self) -> None:
        try:
            api = self._api or import_trt()
            fp = self._fingerprint or probe_fingerprint(api)
        except EngineError as e:
            raise BackendError(f"{self.name}: cannot load {self.plan_path}: {e}") from e
        self.name = api.flavor
        self._api = api
        if not fp.has_gpu:
            # Deserialising needs a CUDA GPU for every flavour; say so instead of TensorRT's cudaError 35.
            raise BackendError(
                f"{api.flavor}: cannot load {self.plan_path}: no CUDA GPU is visible "
                "(install cuda-python or pynvml, check the driver)"
            )
        try:
            manifest = self.store.manifest(self.model, self.key)
            plan = self.store.read_plan(self.model, self.key)  # sha256 verified before TensorRT sees it
        except EngineError as e:
            raise BackendError(f"{api.flavor}: {e}") from e
        built = manifest.build if manifest is not None else None
        dla_core = manifest.fingerprint.get("dla_core") if manifest is not None else None
        runtime, engine = self._deserialize(api, plan, dla_core)
        io, specs = self._io_specs(api, engine)
        per_context = built.profiles_per_context if built is not None else None
        if per_context is None:
            log.warning(
                "%s: manifest %s has no build.profiles_per_context (built before it was recorded); "
                "the profile sets per execution context are guessed from %d contexts",
                self.plan_path,
                self.store.manifest_path(self.model, self.key),
                self._contexts,
            )
        try:
            pool = SlotPool.create(
                engine, specs, self._contexts, self.plan_path, profiles_per_context=per_context, api=api
            )
        except EngineError as e:  # CUDA out of memory and friends, naming the call
            records = self._recorder.drain() if self._recorder is not None else []
            said = "".join(f"; {r}" for r in records)  # e.g. FAILED_ALLOCATION creating a context
            where = f"{api.flavor}: cannot set up execution for {self.plan_path}"
            raise BackendError(f"{where}: {e}{said}") from e
        self._lower_nvtx(api, pool)
        self._built_verbosity = built.profiling_verbosity if built is not None else None
        # The runtime objects keep each other alive in this order (runtime -> engine -> slots).
        self._runtime, self._engine, self._pool, self._io = runtime, engine, pool, io

    def _deserialize(
        self, api: TrtApi, plan: bytes, dla_core: int | None
    ) -> tuple[trt.Runtime, trt.ICudaEngine]:
        """(runtime, engine); PlanRefusedError when TensorRT refuses the plan itself, BackendError when
        CUDA failed it (this device, not the plan: a rebuild would not help)."""
        logger = api.logger()
        # Kept as long as the runtime: TensorRT holds a raw pointer to it.
        self._recorder = recorder = api.error_recorder()
        # TrtApi wraps whichever module is installed (untyped); the TensorRT API is typed from here on.
        runtime, engine = cast(
            "tuple[trt.Runtime, trt.ICudaEngine | None]", api.deserialize(plan, logger, dla_core, recorder)
        )
        if engine is None:
            records = recorder.drain() if recorder is not None else []
            errors = [r.desc for r in records] or list(logger.errors)
            reason = "; ".join(errors) or "no reason given"
            codes = ", ".join(sorted({r.code for r in records}))
            message = f"{api.flavor}: TensorRT refused {self.plan_path}: {reason}" + (
                f" [{codes}]" if codes else ""
            )
            if device_failure(records) if records else _cuda_failure(errors):
                raise BackendError(message)  # this device (memory, CUDA), not the plan
            raise PlanRefusedError(message, self.plan_path, reason)
        return runtime, engine

    def _io_specs(self, api: TrtApi, engine: trt.ICudaEngine) -> tuple[list[IoTensor], list[IoSpec]]:
        """The engine's IO tensors, and the slots' view of them (inputs first); one NCHW input or
        BackendError."""
        io = api.io_tensors(engine)
        inputs = [t for t in io if t.is_input]
        if len(inputs) != 1 or len(inputs[0].shape) != 4:
            raise BackendError(
                f"{api.flavor}: {self.plan_path} has inputs "
                f"{[(t.name, t.shape) for t in inputs]}; expected exactly one NCHW input"
            )
        specs = [
            IoSpec(t.name, t.is_input, np.dtype(t.dtype)) for t in sorted(io, key=lambda t: not t.is_input)
        ]
        return io, specs

    def _lower_nvtx(self, api: TrtApi, pool: SlotPool) -> None:
        """Serving contexts leave the DETAILED NVTX verbosity of the build (it slows enqueue); set_profiler
        restores it for `edge-agent profile`."""
        self.nvtx_verbosity = None
        try:
            for slot in pool.slots:
                self.nvtx_verbosity = api.serving_nvtx(slot.context, detailed=False)
        except Exception as e:  # only a speed-up: never a reason not to serve (nor to leak the slots)
            log.warning("%s: NVTX verbosity not lowered for serving: %s", self.plan_path, e)

    def _close_impl(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self._pool = None
        self._engine = self._runtime = None
        self._recorder = None  # after the runtime that pointed at it
        self._io = []

    @property
    def trt_api(self) -> TrtApi:
        """The TensorRT module the engine was loaded with."""
        if self._api is None or self._engine is None:
            raise BackendError(f"{self.name}: {self.plan_path} is not loaded; call load() first")
        return self._api

    def set_profiler(self, profiler: trt.IProfiler) -> None:
        """Report per-layer times of every execution on every slot to `profiler` (IProfiler). Execution
        becomes slower while one is attached: for `edge-agent profile`, never while serving."""
        if self._pool is None:
            raise BackendError(f"{self.name}: {self.plan_path} is not loaded; call load() first")
        for slot in self._pool.slots:
            context = slot.context
            context.profiler = profiler
            # NVTX back at the build's DETAILED (never above what the engine was built with).
            if self._built_verbosity == "detailed":
                self.nvtx_verbosity = self.trt_api.serving_nvtx(context, detailed=True)

    def layer_information(self) -> str | None:
        """The engine inspector's JSON (layers as detailed as the build's profiling verbosity), with the
        first slot's context so dynamic shapes are resolved; None before TensorRT 8.2."""
        if self._pool is None or self._engine is None:
            raise BackendError(f"{self.name}: {self.plan_path} is not loaded; call load() first")
        return engine_information(self.trt_api, self._engine, self._pool.slots[0].context)

    def _require(self) -> list[IoTensor]:
        if not self._io:
            raise BackendError(f"{self.name}: {self.plan_path} is not loaded; call load() first")
        return self._io

    @staticmethod
    def _spec(t: IoTensor) -> TensorSpec:
        return TensorSpec(t.name, tuple(d if d >= 0 else None for d in t.shape), np.dtype(t.dtype))

    @property
    def input_spec(self) -> TensorSpec:
        return self._spec(next(t for t in self._require() if t.is_input))

    @property
    def output_specs(self) -> list[TensorSpec]:
        return [self._spec(t) for t in self._require() if not t.is_input]

    @property
    def max_batch(self) -> int:
        """Batch dim of the profile's max shape (a fixed-batch engine: its fixed batch)."""
        inp = next(t for t in self._require() if t.is_input)
        if inp.shape[0] >= 0:
            return int(inp.shape[0])
        assert inp.profile is not None
        return int(inp.profile[2][0])

    @property
    def warmup_shape(self) -> tuple[int, ...]:
        """The input's minimum shape in the first profile."""
        inp = next(t for t in self._require() if t.is_input)
        assert inp.profile is not None
        return tuple(int(d) for d in inp.profile[0])

    @property
    def slots(self) -> int:
        """Execution slots (contexts): batches that run at once, on their own streams."""
        return len(self._pool.slots) if self._pool is not None else 1

    def _infer_impl(self, batch: Batch) -> dict[str, np.ndarray]:
        assert self._pool is not None
        outputs, self.last_gpu_ms = self._pool.run_timed(batch)
        return outputs
