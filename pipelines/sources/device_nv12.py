"""A decoded NVDEC picture in device memory its frame owns (`Frame.image` for NVDEC cameras), and the
stream and buffer pool behind it (pipelines/sources/nvdec.py copies each decoded surface into one).

NVDEC recycles its output surfaces after a few more packets, and a frame may wait in the slot or in the
scheduler longer than that, hence the copy. The frame carries an event recorded after the copy; consumers
make their stream wait on it (no host synchronisation). The memory comes from a small per-session pool and
goes back to it when the frame is garbage; the stream outlives every frame that references it.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType

import cv2
import numpy as np

from engines.cuda.buffers import Event, Stream, cuda_call


class StreamHolder:
    """Owns the decoder's CUDA stream and a small pool of picture buffers; every frame references it, so
    the stream is destroyed after the last frame.

    Buffers (with their events) go back to the pool when a frame is garbage and are reused for the next
    pictures of the same size: a picture then costs two CUDA calls (copy, record) instead of six
    (measured: 16 streams decoded 15 % slower than PyNvVideoCodec's own loop with an allocation and an
    event per picture). A dropped frame is never read again and a consumed one is dropped only after
    the batch that read it finished on the GPU, so a buffer is free when its frame is.
    """

    KEEP = 8  # idle buffers kept per holder (about 25 MB at 1080p)

    def __init__(self, cudart: ModuleType) -> None:
        self.rt = cudart
        self.stream = Stream(cudart)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, Event]] = []  # (nbytes, ptr, event)
        self.closed = False

    def take(self, nbytes: int) -> tuple[int, Event]:
        with self._lock:
            for i, (size, ptr, event) in enumerate(self._free):
                if size == nbytes:
                    del self._free[i]
                    return ptr, event
        rt = self.rt
        ptr = int(cuda_call(rt, f"cudaMallocAsync({nbytes})", rt.cudaMallocAsync(nbytes, self.stream.raw)))
        return ptr, Event(rt, timing=False)

    def give(self, nbytes: int, ptr: int, event: Event) -> None:
        with self._lock:
            if not self.closed and len(self._free) < self.KEEP:
                self._free.append((nbytes, ptr, event))
                return
        self._release(ptr, event)

    def _release(self, ptr: int, event: Event) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown or a lost context: nothing to free
            self.rt.cudaFreeAsync(ptr, self.stream.raw)
            event.destroy()

    def close(self) -> None:
        """Free the idle buffers (frames still alive free theirs when they go)."""
        with self._lock:
            self.closed = True
            idle, self._free = self._free, []
        for _, ptr, event in idle:
            self._release(ptr, event)

    def __del__(self) -> None:
        self.close()
        with contextlib.suppress(Exception):
            self.stream.destroy()


class DeviceNv12:
    """One NV12 picture in device memory owned by its frame (`Frame.image` for NVDEC cameras).

    `shape` is (h, w, 3) like a decoded BGR image, so code that only needs the size works unchanged;
    `download()` gives the BGR host image for snapshots, calibration and the accuracy gate.
    """

    __slots__ = (
        "__weakref__",
        "_holder",
        "event",
        "full_range",
        "height",
        "matrix",
        "pitch",
        "ptr",
        "uv_offset",
        "width",
    )

    def __init__(self, holder: StreamHolder, width: int, height: int, matrix: str, full_range: bool) -> None:
        self._holder = holder
        self.width, self.height, self.pitch = width, height, width
        self.uv_offset = width * height
        self.matrix, self.full_range = matrix, full_range
        self.ptr, self.event = holder.take(width * height * 3 // 2)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @property
    def stream(self) -> int:
        """Handle of the stream that wrote the picture (wait on `event` rather than on this)."""
        return self._holder.stream.handle

    @property
    def uv_ptr(self) -> int:
        return self.ptr + self.uv_offset

    def download(self) -> np.ndarray:
        """BGR uint8 host copy (waits for the decode; OpenCV's NV12 conversion, BT.601 limited range)."""
        rt = self._holder.rt
        host = np.empty((self.height * 3 // 2, self.width), np.uint8)
        self.event.synchronize()
        cuda_call(
            rt,
            "cudaMemcpy(device -> host)",
            rt.cudaMemcpy(host.ctypes.data, self.ptr, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost),
        )
        return cv2.cvtColor(host, cv2.COLOR_YUV2BGR_NV12)

    def __del__(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            with contextlib.suppress(Exception):
                self._holder.give(self.width * self.height * 3 // 2, ptr, self.event)
