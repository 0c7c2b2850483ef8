"""Device buffers through cuda-python's runtime API, for feeding INT8 calibration batches to TensorRT.

    with cuda_allocator()(nbytes) as buf:     # cudaMalloc once
        buf.copy_from_host(batch)               # cudaMemcpy host -> device
        ptr = buf.ptr                           # what TensorRT's get_batch wants

cuda-python is imported lazily (only a calibrating build needs it), as `cuda.bindings.runtime`
(cuda-python >= 12.6) or the older `cuda.cudart`. Every call returns `(err, *result)`; `cuda_call`
unwraps that in one place (for engines.cuda.gpu_probe's driver-API calls too) and raises CudaError naming the
call and the CUDA error.
Anything with `.ptr`, `.nbytes`, `copy_from_host(array)` and `free()` can stand in (tests inject a fake).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from engines.cuda.bindings import import_cuda
from engines.cuda.handles import handle_of
from engines.errors import EngineError


class CudaError(EngineError):
    """A CUDA runtime call failed; the message names the call and the CUDA error name."""


class DeviceBufferLike(Protocol):
    ptr: int
    nbytes: int

    def copy_from_host(self, array: np.ndarray) -> None: ...

    def free(self) -> None: ...


Allocator = Callable[[int], DeviceBufferLike]


def import_cudart() -> ModuleType:
    """cuda-python's runtime API, in either layout (engines.cuda.bindings)."""
    return import_cuda("runtime", "device buffers")


def cuda_call(api: ModuleType, what: str, result: Any) -> Any:
    """Unwrap cuda-python's `(err, *values)`: None, the one value, or a tuple; CudaError on failure.

    `api` is the module that made the call, the runtime (`cudaError_t`, `cudaGetErrorName`) or the
    driver API (`CUresult`, `cuGetErrorName`); both report success as 0.
    """
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what} failed: {_error_name(api, err)} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _error_name(api: ModuleType, err: Any) -> str:
    get_name = getattr(api, "cudaGetErrorName", None) or getattr(api, "cuGetErrorName", None)
    if get_name is None:
        return str(err)
    try:
        name = get_name(err)[1]
    except Exception:  # an error code the library cannot name: the number still says it
        return str(err)
    return name.decode() if isinstance(name, bytes) else str(name)


class DeviceBuffer:
    """`nbytes` of device memory, allocated once. Free explicitly (or use `with`); __del__ is a fallback."""

    def __init__(self, nbytes: int, cudart: ModuleType | None = None) -> None:
        self._rt = cudart or import_cudart()
        self.nbytes = int(nbytes)
        self.ptr: int = int(
            cuda_call(self._rt, f"cudaMalloc({self.nbytes})", self._rt.cudaMalloc(self.nbytes))
        )

    def _check(self, array: np.ndarray) -> np.ndarray:
        if self.ptr == 0:
            raise CudaError("device buffer used after free()")
        # cudaMemcpy reads raw bytes from the pointer: the array must be C-contiguous and fit.
        array = np.ascontiguousarray(array)
        if array.nbytes > self.nbytes:
            raise CudaError(
                f"array of {array.nbytes} bytes does not fit the {self.nbytes}-byte device buffer"
            )
        return array

    def copy_from_host(self, array: np.ndarray) -> None:
        array = self._check(array)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_call(
            self._rt,
            "cudaMemcpy(host -> device)",
            self._rt.cudaMemcpy(self.ptr, array.ctypes.data, array.nbytes, kind),
        )

    def copy_to_host(self, array: np.ndarray) -> np.ndarray:
        """Fill the C-contiguous `array` from the start of the buffer (used to verify copies)."""
        if not array.flags.c_contiguous:
            raise CudaError("copy_to_host needs a C-contiguous array")
        self._check(array)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_call(
            self._rt,
            "cudaMemcpy(device -> host)",
            self._rt.cudaMemcpy(array.ctypes.data, self.ptr, array.nbytes, kind),
        )
        return array

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            cuda_call(self._rt, "cudaFree", self._rt.cudaFree(ptr))

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        # Fallback only: interpreter shutdown may have torn down the CUDA context already.
        with contextlib.suppress(Exception):
            self.free()


class StagedDeviceBuffer(DeviceBuffer):
    """A DeviceBuffer whose host -> device copies pass through its own pinned buffer (calibration batches).

    cudaMemcpy from pageable memory returns once the bytes are staged for DMA, not when they reached the
    device (CUDA's "API synchronization behavior"), so TensorRT, reading the buffer on its own stream right
    after get_batch returns, could read part of the previous batch; from pinned memory cudaMemcpy returns
    when the copy is complete."""

    def __init__(self, nbytes: int, cudart: ModuleType | None = None) -> None:
        super().__init__(nbytes, cudart)
        try:
            self._staging = PinnedBuffer(self.nbytes, self._rt)
        except BaseException:
            super().free()
            raise

    def copy_from_host(self, array: np.ndarray) -> None:
        array = self._check(array)
        staged = self._staging.view(np.dtype(np.uint8), (array.nbytes,))
        staged[:] = array.reshape(-1).view(np.uint8)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_call(
            self._rt,
            "cudaMemcpy(pinned host -> device)",
            self._rt.cudaMemcpy(self.ptr, self._staging.ptr, array.nbytes, kind),
        )

    def free(self) -> None:
        staging = getattr(self, "_staging", None)
        if staging is not None:
            staging.free()
        super().free()


def cuda_allocator(cudart: ModuleType | None = None) -> Allocator:
    """An Allocator of device buffers fed through pinned memory (StagedDeviceBuffer), for calibration
    batches; imports cuda-python now, so it fails early and clearly."""
    rt = cudart or import_cudart()
    return lambda nbytes: StagedDeviceBuffer(nbytes, rt)


# ---- streams, events, pinned host memory (TensorRT execution slots) -----------------------------


class Stream:
    """A non-blocking CUDA stream; `handle` is what TensorRT's execute_async_v3 takes."""

    def __init__(self, cudart: ModuleType | None = None) -> None:
        self._rt = cudart or import_cudart()
        self._stream: Any = cuda_call(
            self._rt,
            "cudaStreamCreateWithFlags",
            self._rt.cudaStreamCreateWithFlags(self._rt.cudaStreamNonBlocking),
        )

    @property
    def raw(self) -> Any:
        """The cuda-python stream object (for cudaMemcpyAsync / cudaEventRecord)."""
        if self._stream is None:
            raise CudaError("CUDA stream used after destroy()")
        return self._stream

    @property
    def handle(self) -> int:
        return handle_of(self.raw)  # int(stream) is deprecated from cuda-bindings 12.9.1

    def synchronize(self) -> None:
        cuda_call(self._rt, "cudaStreamSynchronize", self._rt.cudaStreamSynchronize(self.raw))

    def wait(self, event: Event) -> None:
        """Work queued on this stream from now on starts after `event` fired (no host wait)."""
        cuda_call(self._rt, "cudaStreamWaitEvent", self._rt.cudaStreamWaitEvent(self.raw, event.raw, 0))

    def destroy(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            cuda_call(self._rt, "cudaStreamDestroy", self._rt.cudaStreamDestroy(stream))


class Event:
    """A CUDA event with timing: record on a stream, wait for it, read the ms between two events."""

    def __init__(self, cudart: ModuleType | None = None, *, timing: bool = True) -> None:
        self._rt = cudart or import_cudart()
        if timing:
            self._event: Any = cuda_call(self._rt, "cudaEventCreate", self._rt.cudaEventCreate())
        else:  # cheaper to record and wait on where only ordering matters
            flags = self._rt.cudaEventDisableTiming
            self._event = cuda_call(
                self._rt, "cudaEventCreateWithFlags", self._rt.cudaEventCreateWithFlags(flags)
            )

    @property
    def raw(self) -> Any:
        """The cuda-python event object (for cudaStreamWaitEvent)."""
        if self._event is None:
            raise CudaError("CUDA event used after destroy()")
        return self._event

    def record(self, stream: Stream) -> None:
        cuda_call(self._rt, "cudaEventRecord", self._rt.cudaEventRecord(self.raw, stream.raw))

    def synchronize(self) -> None:
        cuda_call(self._rt, "cudaEventSynchronize", self._rt.cudaEventSynchronize(self.raw))

    def ms_since(self, start: Event) -> float:
        """Device time from `start` to this event (both recorded and completed)."""
        return float(
            cuda_call(
                self._rt, "cudaEventElapsedTime", self._rt.cudaEventElapsedTime(start._event, self._event)
            )
        )

    def destroy(self) -> None:
        if self._event is not None:
            event, self._event = self._event, None
            cuda_call(self._rt, "cudaEventDestroy", self._rt.cudaEventDestroy(event))


class PinnedBuffer:
    """Page-locked host memory (cudaMallocHost) with a numpy view, so async copies really are async."""

    def __init__(self, nbytes: int, cudart: ModuleType | None = None) -> None:
        self._rt = cudart or import_cudart()
        self.nbytes = int(nbytes)
        self.ptr: int = int(
            cuda_call(self._rt, f"cudaMallocHost({self.nbytes})", self._rt.cudaMallocHost(self.nbytes))
        )
        self.array = np.ctypeslib.as_array(
            ctypes.cast(self.ptr, ctypes.POINTER(ctypes.c_uint8)), (self.nbytes,)
        )

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The first bytes of the buffer as an array of `shape` (CudaError when it does not fit)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if n > self.nbytes:
            raise CudaError(
                f"{shape} {np.dtype(dtype)} ({n} bytes) does not fit the {self.nbytes}-byte pinned buffer"
            )
        return self.array[:n].view(dtype).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.array = np.empty(0, dtype=np.uint8)
            cuda_call(self._rt, "cudaFreeHost", self._rt.cudaFreeHost(ptr))


class MappedBuffer(PinnedBuffer):
    """Pinned host memory mapped into the device's address space (cudaHostAlloc(cudaHostAllocMapped)):
    on an integrated GPU (Jetson, unified memory) the device reads and writes it at `device_ptr`, so no
    separate device buffer and no copy are needed. (Orin's I/O coherence keeps it CPU-cached.)"""

    def __init__(self, nbytes: int, cudart: ModuleType | None = None) -> None:
        rt = cudart or import_cudart()
        size = int(nbytes)
        ptr = int(
            cuda_call(rt, f"cudaHostAlloc({size}, mapped)", rt.cudaHostAlloc(size, rt.cudaHostAllocMapped))
        )
        self._rt, self.nbytes, self.ptr = rt, size, ptr
        try:
            self.device_ptr = int(
                cuda_call(rt, "cudaHostGetDevicePointer", rt.cudaHostGetDevicePointer(ptr, 0))
            )
        except BaseException:
            self.free()
            raise
        self.array = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (size,))


def unified_memory(cudart: ModuleType) -> bool:
    """True on an integrated GPU (Jetson: the GPU shares the host's memory), where mapped pinned memory
    serves as device memory; False on a discrete GPU or when CUDA cannot say."""
    try:
        device = cuda_call(cudart, "cudaGetDevice", cudart.cudaGetDevice())
        attr = cudart.cudaDeviceAttr.cudaDevAttrIntegrated
        return bool(cuda_call(cudart, "cudaDeviceGetAttribute", cudart.cudaDeviceGetAttribute(attr, device)))
    except (CudaError, AttributeError):
        return False


def memcpy_async(
    cudart: ModuleType, dst: int, src: int, nbytes: int, to_device: bool, stream: Stream
) -> None:
    kind = (
        cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        if to_device
        else cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    )
    what = "cudaMemcpyAsync(host -> device)" if to_device else "cudaMemcpyAsync(device -> host)"
    cuda_call(cudart, what, cudart.cudaMemcpyAsync(dst, src, nbytes, kind, stream.raw))
