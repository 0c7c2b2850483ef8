"""The runtime part of TrtApi: deserialise a plan, read its IO tensors, NVTX verbosity, DLA cores, a
per-layer profiler, error recorders (errors by code), execution contexts on memory the caller owns, and
output allocators (outputs whose shape only the data decides)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.errors import UnavailableError
from engines.trt.module import TrtModule, enum_name, log


@dataclass(frozen=True)
class IoTensor:
    """One engine IO tensor as the runtime sees it (shape -1 = dynamic)."""

    name: str
    is_input: bool
    shape: tuple[int, ...]
    dtype: np.dtype
    # (min, opt, max) of profile 0 for inputs, None for outputs.
    profile: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None


@dataclass(frozen=True)
class TrtErrorRecord:
    """One error TensorRT reported to an IErrorRecorder: the ErrorCode's name and TensorRT's description."""

    code: str
    desc: str

    def __str__(self) -> str:
        return f"{self.code}: {self.desc}"


# ErrorCodes that say the device failed (memory, CUDA), not the plan: a rebuild would not help.
DEVICE_CODES = frozenset({"FAILED_ALLOCATION", "FAILED_INITIALIZATION", "FAILED_EXECUTION"})
# Codes that do not say which: TensorRT-RTX 1.7 (measured) reports a plan's failed magic tag and a CUDA
# driver failure (cudaError 35) both as UNSPECIFIED_ERROR. Then the category TensorRT puts in its
# description decides: "...: Error Code 1: Cuda Runtime (...)" / "Cuda Driver" / "OutOfMemory".
_VAGUE_CODES = frozenset({"UNSPECIFIED_ERROR", "INTERNAL_ERROR"})
_DEVICE_CATEGORY = re.compile(r"Error Code \d+: (Cuda Runtime|Cuda Driver|Out ?Of ?Memory)\b", re.IGNORECASE)


def device_failure(errors: Sequence[TrtErrorRecord]) -> bool:
    """True when any recorded error is the device's (out of memory, CUDA), not the plan's."""
    return any(
        e.code in DEVICE_CODES or (e.code in _VAGUE_CODES and _DEVICE_CATEGORY.search(e.desc) is not None)
        for e in errors
    )


class RuntimeCalls(TrtModule):
    """Runtime calls, the same on every version (a TrtApi part)."""

    # An error recorder keeps at most this many errors (then has_overflowed); one failing load or batch
    # reports a handful.
    MAX_RECORDED_ERRORS = 64

    def error_recorder(self) -> Any | None:
        """An IErrorRecorder (thread-safe: TensorRT may report from any thread) whose `.records()` are
        TrtErrorRecords and `.drain()` returns and clears them; None where the module has none. TensorRT
        hands errors to the recorder instead of the logger once one is set (TensorRT-RTX 1.7, measured),
        so each is logged here too."""
        base: Any = getattr(self.mod, "IErrorRecorder", None)
        if base is None:
            return None
        limit, label = self.MAX_RECORDED_ERRORS, self.label

        class Recorder(base):  # type: ignore[no-any-unimported]  # the module's own class, found at run time
            def __init__(self) -> None:
                base.__init__(self)  # the pybind11 trampoline needs the base initialised explicitly
                self._lock = threading.Lock()
                self._errors: list[tuple[Any, str]] = []
                self._overflowed = False

            def report_error(self, val: Any, desc: str) -> bool:
                with self._lock:
                    if len(self._errors) < limit:
                        self._errors.append((val, str(desc)))
                    else:
                        self._overflowed = True
                log.error("%s: %s: %s", label, enum_name(val), desc)
                return False  # not fatal by our judgement: TensorRT decides whether it can go on

            def num_errors(self) -> int:
                with self._lock:
                    return len(self._errors)

            def get_error_code(self, index: int) -> Any:
                with self._lock:
                    return self._errors[index][0]

            def get_error_desc(self, index: int) -> str:
                with self._lock:
                    return self._errors[index][1]

            def has_overflowed(self) -> bool:
                return self._overflowed

            def clear(self) -> None:
                with self._lock:
                    self._errors.clear()
                    self._overflowed = False

            def records(self) -> list[TrtErrorRecord]:
                with self._lock:
                    return [TrtErrorRecord(enum_name(c), d) for c, d in self._errors]

            def drain(self) -> list[TrtErrorRecord]:
                with self._lock:
                    out = [TrtErrorRecord(enum_name(c), d) for c, d in self._errors]
                    self._errors.clear()
                    self._overflowed = False
                return out

        return Recorder()

    def create_context(self, engine: Any, user_memory: bool) -> tuple[Any, bool]:
        """(execution context, True when its activation memory is the caller's to provide).

        `user_memory`: create it without device memory (TensorRT 10:
        create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED); 8.x:
        create_execution_context_without_device_memory), so the caller allocates and frees the block
        (set_context_memory); otherwise, or where neither exists, TensorRT allocates it (STATIC)."""
        strategies = getattr(self.mod, "ExecutionContextAllocationStrategy", None)
        if user_memory and strategies is not None and hasattr(strategies, "USER_MANAGED"):
            return engine.create_execution_context(strategies.USER_MANAGED), True
        if user_memory and hasattr(engine, "create_execution_context_without_device_memory"):
            return engine.create_execution_context_without_device_memory(), True
        return engine.create_execution_context(), False

    @staticmethod
    def context_memory_size(engine: Any, profiles: Sequence[int]) -> int:
        """Activation bytes a context running only `profiles` needs: the largest of those profiles'
        (get_device_memory_size_for_profile[_v2]), else the engine's size over every profile."""
        for name in ("get_device_memory_size_for_profile_v2", "get_device_memory_size_for_profile"):
            per_profile = getattr(engine, name, None)
            if per_profile is not None and profiles:
                return max(int(per_profile(p)) for p in profiles)
        for name in ("device_memory_size_v2", "device_memory_size"):  # TensorRT-RTX: v2 only
            size = getattr(engine, name, None)
            if size is not None:
                return int(size)
        raise UnavailableError("the engine reports no device memory size")

    @staticmethod
    def set_context_memory(context: Any, ptr: int, nbytes: int) -> None:
        """Give a user-managed context its activation block (TensorRT 10: set_device_memory(ptr, size);
        8.x: the device_memory property)."""
        if hasattr(context, "set_device_memory"):
            context.set_device_memory(int(ptr), int(nbytes))
        elif hasattr(context, "device_memory"):
            context.device_memory = int(ptr)
        else:
            raise UnavailableError("the execution context takes no device memory")

    def output_allocator(self, reallocate: Callable[[str, int], int]) -> Any | None:
        """An IOutputAllocator for outputs whose shape only the data decides (NonZero/NMS-terminated
        exports: [N, 6] detections). During execute_async_v3 TensorRT asks reallocate_output[_async] for
        at least `size` bytes (an upper bound) and then tells notify_shape the real shape; `reallocate(name,
        nbytes)` returns the device address (0 fails the batch). `.shapes` {name: shape} holds what
        notify_shape said, `.clear()` forgets it before each batch. None where the module has none."""
        base: Any = getattr(self.mod, "IOutputAllocator", None)
        if base is None:
            return None

        class OutputAllocator(base):  # type: ignore[no-any-unimported]  # likewise
            def __init__(self) -> None:
                base.__init__(self)
                self.shapes: dict[str, tuple[int, ...]] = {}

            def reallocate_output(self, tensor_name: str, memory: int, size: int, alignment: int) -> int:
                try:
                    return int(reallocate(tensor_name, int(size)))
                except Exception as e:  # never into TensorRT's C++ caller: 0 fails the batch instead
                    log.error("cannot allocate %d bytes for output %r: %s", size, tensor_name, e)
                    return 0

            def reallocate_output_async(
                self, tensor_name: str, memory: int, size: int, alignment: int, stream: int
            ) -> int:
                # Every allocation of a slot is made before the batch, on the host: the stream needs none.
                return self.reallocate_output(tensor_name, memory, size, alignment)

            def notify_shape(self, tensor_name: str, shape: Any) -> None:
                self.shapes[tensor_name] = tuple(int(d) for d in shape)

            def clear(self) -> None:
                self.shapes.clear()

        return OutputAllocator()

    def layer_profiler(self) -> Any | None:
        """An IProfiler that keeps every report_layer_time(layer, ms) in `.times` {layer: [ms, ...]}, in
        call order (once per layer per execution); None where the module has no IProfiler."""
        if not hasattr(self.mod, "IProfiler"):
            return None
        base = self.mod.IProfiler

        class LayerTimes(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                base.__init__(self)  # the pybind11 trampoline needs the base initialised explicitly
                self.times: dict[str, list[float]] = {}

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                self.times.setdefault(layer_name, []).append(float(ms))

        return LayerTimes()

    def num_dla_cores(self) -> int:
        """DLA cores TensorRT sees, asked of a Runtime (the runtime library only: probing with a Builder
        would load the builder library into the daemon). 0 where DLA does not exist or TensorRT fails."""
        if not (self.has_dla and self._has("Runtime", "num_DLA_cores")):
            return 0
        try:
            return int(self.mod.Runtime(self.logger()).num_DLA_cores)
        except Exception:  # no GPU / driver: no DLA either, never a failed probe
            return 0

    def deserialize(
        self, plan: bytes, logger: Any, dla_core: int | None = None, recorder: Any | None = None
    ) -> tuple[Any, Any]:
        """(runtime, engine); engine is None when TensorRT refuses the plan: see `recorder` (an
        error_recorder(), set on the runtime, so the engine and its contexts inherit it), else
        logger.errors. The caller keeps `recorder` alive as long as the runtime (TensorRT holds a pointer).

        As trtexec does: the bundled plugins are registered first (a plan with plugin layers does not load
        in a fresh process otherwise), and an engine built for DLA core `dla_core` gets that core on the
        runtime (IRuntime::setDLACore) before it is deserialised."""
        self.init_plugins()
        runtime = self.mod.Runtime(logger)
        if recorder is not None and hasattr(runtime, "error_recorder"):
            runtime.error_recorder = recorder
        if dla_core is not None:
            if hasattr(runtime, "DLA_core"):
                runtime.DLA_core = int(dla_core)
            else:
                log.warning("%s: the runtime has no DLA_core; DLA core %d not selected", self.label, dla_core)
        return runtime, runtime.deserialize_cuda_engine(plan)

    # Serving lowers the engine's NVTX verbosity to this (names stay visible in Nsight Systems timelines).
    SERVING_NVTX = "LAYER_NAMES_ONLY"

    def serving_nvtx(self, context: Any, detailed: bool) -> str | None:
        """Set an execution context's NVTX verbosity: DETAILED (as built: `edge-agent profile`) or
        SERVING_NVTX. Engines are built DETAILED for the inspector, and TensorRT's docs say so: "Building
        with DETAILED verbosity will generally increase latency in enqueueV3()"; the context's setting
        cannot exceed the build's and does not change what the engine inspector sees. Returns the level
        now in effect ("detailed", "layer_names_only"), None where TensorRT has no such setting."""
        levels = getattr(self.mod, "ProfilingVerbosity", None)
        wanted = getattr(levels, "DETAILED" if detailed else self.SERVING_NVTX, None)
        if wanted is None or not hasattr(context, "nvtx_verbosity"):
            return None
        context.nvtx_verbosity = wanted
        return enum_name(context.nvtx_verbosity).lower()

    def _nptype(self, trt_dtype: Any) -> np.dtype:
        if hasattr(self.mod, "nptype"):
            dtype: np.dtype = np.dtype(self.mod.nptype(trt_dtype))
            return dtype
        names = {
            "FLOAT": np.float32,
            "HALF": np.float16,
            "INT8": np.int8,
            "INT32": np.int32,
            "INT64": np.int64,
            "BOOL": np.bool_,
            "UINT8": np.uint8,
        }
        return np.dtype(names[str(trt_dtype).split(".")[-1]])

    def io_tensors(self, engine: Any) -> list[IoTensor]:
        if not hasattr(engine, "num_io_tensors"):  # TensorRT < 8.5 only had bindings
            self.fail_unavailable("the named IO tensor API (num_io_tensors)")
        out = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == self.mod.TensorIOMode.INPUT
            profile = None
            if is_input:
                mn, opt, mx = engine.get_tensor_profile_shape(name, 0)
                profile = (tuple(mn), tuple(opt), tuple(mx))
            out.append(
                IoTensor(
                    name,
                    is_input,
                    tuple(engine.get_tensor_shape(name)),
                    self._nptype(engine.get_tensor_dtype(name)),
                    profile,
                )
            )
        return out
