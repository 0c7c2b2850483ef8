"""A stand-in for cuda-python's runtime module (`cuda.bindings.runtime`) on a machine without a GPU.

engines.runtimes.slots allocates device and pinned buffers, streams and events through the calls below;
here "device" memory is host memory too, and async copies are memmoves done at once, so the execution
slots (with tests/fake_tensorrt.py's execution context) run their whole control flow on the CPU:

    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: cudart)   # cudart = FakeCudart()
    cudart.live            # allocations not yet freed (a leak shows up here)
    cudart.device_bytes    # bytes of cudaMalloc memory live now (what a slot costs on the device)
    cudart.copies          # (dst, src, nbytes, kind name, pinned source) of every copy
    cudart.on_synchronize  # called by every stream/event synchronize (a test may block in it)
    FakeCudart(integrated=True)   # a Jetson: unified memory, mapped pinned memory serves the device

Every call answers cuda-python's way: a tuple (error, *values), error 0 for success. Streams and events
are handle objects as in cuda-python: `getPtr()` gives the address of the storage that holds the handle
(as cuda-bindings does: the value is read from there), `int()` warns (DeprecationWarning) as cuda-bindings
12.9.1 deprecates it.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import warnings
from collections.abc import Callable
from typing import Any


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class cudaDeviceAttr(enum.IntEnum):
    cudaDevAttrIntegrated = 18


class FakeHandle:
    """A cuda-python handle object (cudaStream_t, cudaEvent_t, CUcontext)."""

    def __init__(self, value: int) -> None:
        self._value = value
        self._storage = ctypes.c_void_p(value)  # what cuda-bindings wraps: getPtr() is its address

    def getPtr(self) -> int:
        return ctypes.addressof(self._storage)

    def __int__(self) -> int:
        warnings.warn("int() of a cuda-python handle is deprecated; use getPtr()", DeprecationWarning, 2)
        return self._value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeHandle) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


class FakeCudart:
    cudaMemcpyKind = cudaMemcpyKind
    cudaDeviceAttr = cudaDeviceAttr
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2
    cudaHostAllocMapped = 2

    def __init__(self, integrated: bool = False) -> None:
        self.integrated = integrated
        self._memory: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._device: set[int] = set()  # cudaMalloc'd (the rest is pinned host memory)
        self._mapped: set[int] = set()  # cudaHostAlloc(Mapped)
        self._handles = itertools.count(0x1000)
        self.streams: set[FakeHandle] = set()
        self.events: set[FakeHandle] = set()
        self.copies: list[tuple[int, int, int, str, bool]] = []
        self.syncs: list[str] = []
        self.on_synchronize: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    @property
    def live(self) -> int:
        return len(self._memory) + len(self.streams) + len(self.events)

    @property
    def device_bytes(self) -> int:
        return sum(len(self._memory[p]) for p in self._device)

    def _alloc(self, nbytes: int, device: bool = False) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(max(1, int(nbytes)))
        ptr = ctypes.addressof(buf)
        with self._lock:
            self._memory[ptr] = buf
            if device:
                self._device.add(ptr)
        return 0, ptr

    def _free(self, ptr: int) -> tuple[int]:
        with self._lock:
            self._device.discard(int(ptr))
            self._mapped.discard(int(ptr))
            return (0,) if self._memory.pop(int(ptr), None) is not None else (1,)

    def _pinned(self, ptr: int) -> bool:
        return ptr in self._memory and ptr not in self._device

    # memory
    def cudaMalloc(self, nbytes: int) -> tuple[int, int]:
        return self._alloc(nbytes, device=True)

    def cudaMallocHost(self, nbytes: int) -> tuple[int, int]:
        return self._alloc(nbytes)

    def cudaHostAlloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        err, ptr = self._alloc(nbytes)
        if flags & self.cudaHostAllocMapped:
            self._mapped.add(ptr)
        return err, ptr

    def cudaHostGetDevicePointer(self, ptr: int, flags: int) -> tuple[int, int]:
        # Unified memory (Jetson): the device sees mapped pinned memory at the same address.
        return (0, ptr) if ptr in self._mapped else (1, 0)

    def cudaGetDevice(self) -> tuple[int, int]:
        return 0, 0

    def cudaDeviceGetAttribute(self, attr: Any, device: int) -> tuple[int, int]:
        if attr == cudaDeviceAttr.cudaDevAttrIntegrated:
            return 0, int(self.integrated)
        return 1, 0

    def cudaFree(self, ptr: int) -> tuple[int]:
        return self._free(ptr)

    def cudaFreeHost(self, ptr: int) -> tuple[int]:
        return self._free(ptr)

    def cudaMemcpy(self, dst: int, src: int, nbytes: int, kind: Any) -> tuple[int]:
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((int(dst), int(src), int(nbytes), cudaMemcpyKind(kind).name, self._pinned(src)))
        return (0,)

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind: Any, stream: Any) -> tuple[int]:
        assert stream in self.streams, "copy on a destroyed stream"
        return self.cudaMemcpy(dst, src, nbytes, kind)

    # streams and events
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[int, FakeHandle]:
        handle = FakeHandle(next(self._handles))
        self.streams.add(handle)
        return 0, handle

    def _synchronize(self, what: str) -> None:
        self.syncs.append(what)
        if self.on_synchronize is not None:
            self.on_synchronize(what)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[int]:
        self._synchronize("stream")
        return (0,)

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:
        return (0,)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        self.streams.discard(stream)
        return (0,)

    def cudaEventCreate(self) -> tuple[int, FakeHandle]:
        handle = FakeHandle(next(self._handles))
        self.events.add(handle)
        return 0, handle

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[int, FakeHandle]:
        return self.cudaEventCreate()

    def cudaEventRecord(self, event: int, stream: int) -> tuple[int]:
        return (0,)

    def cudaEventSynchronize(self, event: Any) -> tuple[int]:
        self._synchronize("event")
        return (0,)

    def cudaEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        return 0, 0.25

    def cudaEventDestroy(self, event: int) -> tuple[int]:
        self.events.discard(event)
        return (0,)

    def cudaGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, b"cudaErrorInvalidValue"
