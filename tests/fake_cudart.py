"""A stand-in for cuda-python's runtime module (`cuda.bindings.runtime`) on a machine without a GPU.

engines.runtimes.slots allocates device and pinned buffers, streams and events through the calls below;
here "device" memory is host memory too, and async copies are memmoves done at once, so the execution
slots (with tests/fake_tensorrt.py's execution context) run their whole control flow on the CPU:

    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: cudart)   # cudart = FakeCudart()
    cudart.live            # allocations not yet freed (a leak shows up here)

Every call answers cuda-python's way: a tuple (error, *values), error 0 for success.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
from typing import Any


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class FakeCudart:
    cudaMemcpyKind = cudaMemcpyKind
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2

    def __init__(self) -> None:
        self._memory: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._handles = itertools.count(0x1000)
        self.streams: set[int] = set()
        self.events: set[int] = set()

    @property
    def live(self) -> int:
        return len(self._memory) + len(self.streams) + len(self.events)

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(max(1, int(nbytes)))
        ptr = ctypes.addressof(buf)
        self._memory[ptr] = buf
        return 0, ptr

    def _free(self, ptr: int) -> tuple[int]:
        return (0,) if self._memory.pop(int(ptr), None) is not None else (1,)

    # memory
    def cudaMalloc(self, nbytes: int) -> tuple[int, int]:
        return self._alloc(nbytes)

    def cudaMallocHost(self, nbytes: int) -> tuple[int, int]:
        return self._alloc(nbytes)

    def cudaFree(self, ptr: int) -> tuple[int]:
        return self._free(ptr)

    def cudaFreeHost(self, ptr: int) -> tuple[int]:
        return self._free(ptr)

    def cudaMemcpy(self, dst: int, src: int, nbytes: int, kind: Any) -> tuple[int]:
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind: Any, stream: int) -> tuple[int]:
        assert stream in self.streams, "copy on a destroyed stream"
        return self.cudaMemcpy(dst, src, nbytes, kind)

    # streams and events
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[int, int]:
        handle = next(self._handles)
        self.streams.add(handle)
        return 0, handle

    def cudaStreamSynchronize(self, stream: int) -> tuple[int]:
        return (0,)

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:
        return (0,)

    def cudaStreamDestroy(self, stream: int) -> tuple[int]:
        self.streams.discard(stream)
        return (0,)

    def cudaEventCreate(self) -> tuple[int, int]:
        handle = next(self._handles)
        self.events.add(handle)
        return 0, handle

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[int, int]:
        return self.cudaEventCreate()

    def cudaEventRecord(self, event: int, stream: int) -> tuple[int]:
        return (0,)

    def cudaEventSynchronize(self, event: int) -> tuple[int]:
        return (0,)

    def cudaEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        return 0, 0.25

    def cudaEventDestroy(self, event: int) -> tuple[int]:
        self.events.discard(event)
        return (0,)

    def cudaGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, b"cudaErrorInvalidValue"
