"""Letterbox + normalise on the GPU: uint8 HxWx3 frames -> the engine's float32 NCHW input, one CUDA kernel.

    gpu = GpuLetterbox()                                         # compiles the kernel (NVRTC) once
    tensor, boxes, release = gpu.preprocess(images, adapter.normalisation)
    backend.infer(tensor)                                         # TensorRT reads it where it lies
    release()                                                     # after the batch: buffers back to the pool

The kernel does what the CPU path (pipelines.preprocess.letterbox_normalise) does, with the same geometry
(`place`) and the same arithmetic: OpenCV's INTER_LINEAR resize of uint8 images in 11-bit fixed point
(the weights and the vertical pass exactly as OpenCV's SIMD path computes them), then x * mul + add per
channel in float32 with no fused multiply-add. pipelines.preprocess_reference is that arithmetic in numpy;
it is bit-identical to cv2.resize on x86 OpenCV builds (tests/test_preprocess_gpu.py checks it without a
GPU) and the kernel is bit-identical to it (checked on a GPU). Where an OpenCV build rounds differently (other
SIMD paths), the two paths differ by at most one grey level before normalisation.

Frames in host memory are copied up with cudaMemcpyAsync: from pinned memory (a decoder writing into
cudaMallocHost buffers) that costs the CPU nothing; from ordinary pageable memory the driver stages the
copy, which costs about what the CPU letterbox costs. A frame already on the device (any object with
`__cuda_array_interface__`, e.g. from a hardware decoder) is read in place; its producer's stream is
waited for.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.cuda.buffers import DeviceBuffer, Event, Stream, cuda_call, import_cudart, memcpy_async
from engines.cuda.kernels import CudaModule
from engines.runtimes.base import DeviceTensor
from pipelines.preprocess import Letterbox, Normalisation, place
from pipelines.preprocess_reference import yuv_coefficients

KERNEL_NAME = "letterbox_nchw"
NV12_KERNEL_NAME = "letterbox_nv12_nchw"
KERNEL_SOURCE = r"""
// One thread per output pixel (x, y) of one image: letterbox + normalise into the float32 CHW planes at
// `dst`. The resize is OpenCV's INTER_LINEAR for uint8 (fixed point, weights in 1/2048, the vertical pass
// as its SIMD path computes it); every float operation is explicitly rounded (no FMA contraction), so the
// result is bit-identical to the numpy reference `letterbox_reference`. The source is packed BGR
// (`letterbox_nchw`) or an NV12 picture from NVDEC (`letterbox_nv12_nchw`), converted to BGR uint8 per
// source pixel with OpenCV's fixed-point YUV->RGB (`nv12_to_bgr_reference`), then resized alike.
__device__ __forceinline__ void coord(int d, double scale, float* frac, int* index) {
    float f = __double2float_rn(__dsub_rn(__dmul_rn(__dadd_rn((double)d, 0.5), scale), 0.5));
    int i = (int)floorf(f);
    *frac = __fsub_rn(f, (float)i);
    *index = i;
}

__device__ __forceinline__ int weight(float w) { return __float2int_rn(__fmul_rn(w, 2048.f)); }

struct BgrSource {
    const unsigned char* src;
    long long pitch;
    __device__ __forceinline__ void px(int x, int y, int* bgr) const {
        const unsigned char* p = src + (long long)y * pitch + x * 3;
        bgr[0] = p[0]; bgr[1] = p[1]; bgr[2] = p[2];
    }
};

struct Nv12Source {
    const unsigned char* luma;
    const unsigned char* chroma;  // interleaved U, V at half resolution, same pitch as luma
    long long pitch;
    int cy, y_off, cvr, cvg, cug, cub;  // coefficients in 1/2^20 (OpenCV's for BT.601 limited range)
    __device__ __forceinline__ void px(int x, int y, int* bgr) const {
        int lum = luma[(long long)y * pitch + x];
        const unsigned char* c = chroma + (long long)(y >> 1) * pitch + (x & ~1);
        int u = c[0] - 128, v = c[1] - 128;
        int yy = max(lum - y_off, 0) * cy + (1 << 19);
        bgr[0] = min(max((yy + cub * u) >> 20, 0), 255);
        bgr[1] = min(max((yy + cvg * v + cug * u) >> 20, 0), 255);
        bgr[2] = min(max((yy + cvr * v) >> 20, 0), 255);
    }
};

template <class Source>
__device__ __forceinline__ void letterbox_pixel(
    const Source& s, int src_h, int src_w, float* __restrict__ dst, int dst_h, int dst_w,
    int new_h, int new_w, int top, int left, double scale_x, double scale_y,
    float mul0, float mul1, float mul2, float add0, float add1, float add2,
    float pad0, float pad1, float pad2, int swap_rb)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x >= dst_w || y >= dst_h) return;
    long long plane = (long long)dst_h * dst_w;
    float* out = dst + (long long)y * dst_w + x;
    int dx = x - left, dy = y - top;
    if (dx < 0 || dx >= new_w || dy < 0 || dy >= new_h) {
        out[0] = pad0; out[plane] = pad1; out[2 * plane] = pad2;
        return;
    }
    float fx, fy;
    int sx, sy;
    coord(dx, scale_x, &fx, &sx);
    coord(dy, scale_y, &fy, &sy);
    // Columns: OpenCV clamps the index and drops the fraction at the edges; rows: it clamps the rows only.
    if (sx < 0) { fx = 0.f; sx = 0; }
    if (sx >= src_w - 1) { fx = 0.f; sx = src_w - 1; }
    int x1 = min(sx + 1, src_w - 1);
    int y0 = min(max(sy, 0), src_h - 1), y1 = min(max(sy + 1, 0), src_h - 1);
    int a0 = weight(__fsub_rn(1.f, fx)), a1 = weight(fx);
    int b0 = weight(__fsub_rn(1.f, fy)), b1 = weight(fy);
    int p00[3], p01[3], p10[3], p11[3];
    s.px(sx, y0, p00); s.px(x1, y0, p01); s.px(sx, y1, p10); s.px(x1, y1, p11);
    const float mul[3] = {mul0, mul1, mul2};
    const float add[3] = {add0, add1, add2};
    for (int c = 0; c < 3; ++c) {
        int sc = swap_rb ? 2 - c : c;
        int h0 = p00[sc] * a0 + p01[sc] * a1;
        int h1 = p10[sc] * a0 + p11[sc] * a1;
        int v = ((((h0 >> 4) * b0) >> 16) + (((h1 >> 4) * b1) >> 16) + 2) >> 2;
        v = min(max(v, 0), 255);
        out[c * plane] = __fadd_rn(__fmul_rn((float)v, mul[c]), add[c]);
    }
}

#define LETTERBOX_ARGS \
    float* __restrict__ dst, int dst_h, int dst_w, int new_h, int new_w, int top, int left, \
    double scale_x, double scale_y, float mul0, float mul1, float mul2, float add0, float add1, float add2, \
    float pad0, float pad1, float pad2, int swap_rb
#define LETTERBOX_PASS dst, dst_h, dst_w, new_h, new_w, top, left, scale_x, scale_y, \
    mul0, mul1, mul2, add0, add1, add2, pad0, pad1, pad2, swap_rb

extern "C" __global__ void letterbox_nchw(
    const unsigned char* __restrict__ src, int src_h, int src_w, long long src_pitch, LETTERBOX_ARGS)
{
    BgrSource s = {src, src_pitch};
    letterbox_pixel(s, src_h, src_w, LETTERBOX_PASS);
}

extern "C" __global__ void letterbox_nv12_nchw(
    const unsigned char* __restrict__ luma, const unsigned char* __restrict__ chroma, int src_h, int src_w,
    long long src_pitch, int cy, int y_off, int cvr, int cvg, int cug, int cub, LETTERBOX_ARGS)
{
    Nv12Source s = {luma, chroma, src_pitch, cy, y_off, cvr, cvg, cug, cub};
    letterbox_pixel(s, src_h, src_w, LETTERBOX_PASS);
}
"""
_BLOCK = (32, 8, 1)


def _is_nv12(image: Any) -> bool:
    """An NV12 picture in device memory (pipelines.sources.device_nv12.DeviceNv12 and alike), by duck type."""
    return hasattr(image, "uv_ptr") and hasattr(image, "event") and hasattr(image, "pitch")


# --- the GPU side ---------------------------------------------------------------------------------------
def _letterbox_args(
    out: int, h: int, w: int, lb: Letterbox, new_h: int, new_w: int, norm: Normalisation
) -> list[tuple[Any, Any]]:
    """The kernels' shared trailing arguments (LETTERBOX_ARGS in the source)."""
    dst_h, dst_w = norm.input_hw
    c_int, c_float = ctypes.c_int, ctypes.c_float
    return [
        (out, ctypes.c_void_p),
        (dst_h, c_int),
        (dst_w, c_int),
        (new_h, c_int),
        (new_w, c_int),
        (int(lb.pad_y), c_int),
        (int(lb.pad_x), c_int),
        (1.0 / (new_w / w), ctypes.c_double),  # as cv2.resize derives its scale
        (1.0 / (new_h / h), ctypes.c_double),
        *[(v, c_float) for v in (*norm.mul.tolist(), *norm.add.tolist(), *norm.pad.tolist())],
        (int(norm.swap_rb), c_int),
    ]


@dataclass(eq=False)
class _Buffers:
    """Device memory for one batch: the uploaded frames and the NCHW output, and its `ready` event."""

    ready: Event
    output: DeviceBuffer | None = None
    staging: DeviceBuffer | None = None

    def fit(self, output_bytes: int, staging_bytes: int, cudart: Any) -> None:
        """Grow (never shrink) to the sizes asked for. Only called on idle buffers."""
        if self.output is None or self.output.nbytes < output_bytes:
            if self.output is not None:
                self.output.free()
            self.output = DeviceBuffer(output_bytes, cudart)
        if staging_bytes and (self.staging is None or self.staging.nbytes < staging_bytes):
            if self.staging is not None:
                self.staging.free()
            self.staging = DeviceBuffer(staging_bytes, cudart)

    def free(self) -> None:
        for b in (self.staging, self.output):
            if b is not None:
                b.free()
        self.ready.destroy()


class GpuLetterbox:
    """Letterboxes batches of frames on the GPU into device memory, for backends with accepts_device_input.

    Keeps a pool of batch buffers (as many as batches are alive at once: one being prepared plus those in
    flight); `preprocess` is called from one thread (the model's batcher), the `release` it returns from
    any. `close` frees everything once no batch is alive.
    """

    def __init__(self, device: int = 0) -> None:
        self._rt = import_cudart()
        self._module = CudaModule.compile(KERNEL_SOURCE, "letterbox.cu", ("--fmad=false",), device)
        self._kernel = self._module.function(KERNEL_NAME)
        self._nv12_kernel = self._module.function(NV12_KERNEL_NAME)
        self._stream = Stream(self._rt)
        self._frame_ready = Event(self._rt, timing=False)  # a device frame's producer stream, waited for
        self._lock = threading.Lock()
        self._free: list[_Buffers] = []
        self._all: list[_Buffers] = []

    def preprocess(
        self, images: list[np.ndarray], norm: Normalisation
    ) -> tuple[DeviceTensor, list[Letterbox], Callable[[], None]]:
        """Queue uploads + kernels for `images` on this object's stream; returns at once with the batch (its
        `ready` event fires when it is written), the letterboxes, and the function that hands the buffers
        back (call it once the batch's inference is over)."""
        if not images:
            raise ValueError("GpuLetterbox.preprocess needs at least one image")
        dst_h, dst_w = norm.input_hw
        plane_bytes = dst_h * dst_w * 4
        sources = [None if _is_nv12(img) else _device_source(img) for img in images]
        staging = sum(
            int(img.nbytes)
            for img, dev in zip(images, sources, strict=True)
            if dev is None and not _is_nv12(img)
        )
        buf = self._acquire(len(images) * 3 * plane_bytes, staging)
        try:
            boxes = self._enqueue(images, sources, norm, buf)
        except BaseException:
            self._release(buf)  # nothing will consume it; later work on our stream is ordered after
            raise
        assert buf.output is not None
        tensor = DeviceTensor(buf.output.ptr, (len(images), 3, dst_h, dst_w), np.dtype(np.float32), buf.ready)
        return tensor, boxes, lambda: self._release(buf)

    def _enqueue(
        self,
        images: list[np.ndarray],
        sources: list[tuple[int, int, int | None] | None],
        norm: Normalisation,
        buf: _Buffers,
    ) -> list[Letterbox]:
        """Uploads and one kernel per image on our stream, then `buf.ready` recorded after them."""
        assert buf.output is not None
        dst_h, dst_w = norm.input_hw
        plane_bytes = dst_h * dst_w * 4
        self._module.make_current()
        offset = 0
        boxes: list[Letterbox] = []
        grid_xy = ((dst_w + _BLOCK[0] - 1) // _BLOCK[0], (dst_h + _BLOCK[1] - 1) // _BLOCK[1])
        for i, (img, dev) in enumerate(zip(images, sources, strict=True)):
            if _is_nv12(img):
                boxes.append(self._enqueue_nv12(img, norm, buf.output.ptr + i * 3 * plane_bytes, grid_xy))
                continue
            if img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"GpuLetterbox: image {i} has shape {img.shape}, expected HxWx3")
            h, w = int(img.shape[0]), int(img.shape[1])
            if dev is None:
                assert buf.staging is not None
                host = np.ascontiguousarray(img, dtype=np.uint8)
                ptr, pitch = buf.staging.ptr + offset, w * 3
                memcpy_async(self._rt, ptr, host.ctypes.data, host.nbytes, True, self._stream)
                offset += host.nbytes
            else:
                ptr, pitch, producer = dev
                self._wait_for_producer(producer)
            lb, new_w, new_h = place(h, w, dst_h, dst_w)
            out = buf.output.ptr + i * 3 * plane_bytes
            self._kernel.launch(
                (*grid_xy, 1),
                _BLOCK,
                self._stream,
                [
                    (ptr, ctypes.c_void_p),
                    (h, ctypes.c_int),
                    (w, ctypes.c_int),
                    (pitch, ctypes.c_longlong),
                    *_letterbox_args(out, h, w, lb, new_h, new_w, norm),
                ],
            )
            boxes.append(lb)
        buf.ready.record(self._stream)
        return boxes

    def _enqueue_nv12(self, pic: Any, norm: Normalisation, out: int, grid_xy: tuple[int, int]) -> Letterbox:
        """An NVDEC picture: our stream waits for its decoder's event (no host wait), then one launch."""
        self._stream.wait(pic.event)
        h, w = int(pic.height), int(pic.width)
        dst_h, dst_w = norm.input_hw
        lb, new_w, new_h = place(h, w, dst_h, dst_w)
        coeffs = yuv_coefficients(pic.matrix, pic.full_range)
        self._nv12_kernel.launch(
            (*grid_xy, 1),
            _BLOCK,
            self._stream,
            [
                (int(pic.ptr), ctypes.c_void_p),
                (int(pic.uv_ptr), ctypes.c_void_p),
                (h, ctypes.c_int),
                (w, ctypes.c_int),
                (int(pic.pitch), ctypes.c_longlong),
                *[(c, ctypes.c_int) for c in coeffs],
                *_letterbox_args(out, h, w, lb, new_h, new_w, norm),
            ],
        )
        return lb

    def _wait_for_producer(self, producer: int | None) -> None:
        """Per __cuda_array_interface__ v3: work on the frame's stream must finish before we read it."""
        if producer is None:
            return
        stream = self._rt.cudaStream_t(producer)
        cuda_call(self._rt, "cudaEventRecord", self._rt.cudaEventRecord(self._frame_ready.raw, stream))
        self._stream.wait(self._frame_ready)

    def _acquire(self, output_bytes: int, staging_bytes: int) -> _Buffers:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = _Buffers(Event(self._rt, timing=False))
            with self._lock:
                self._all.append(buf)
        # Idle: its last batch's consumer has finished with it, and our own stream runs in order.
        buf.fit(output_bytes, staging_bytes, self._rt)
        return buf

    def _release(self, buf: _Buffers) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def pooled(self) -> int:
        """Batch buffers allocated so far (bounded by the batches alive at once)."""
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        """Free every buffer, the stream and the module (no batch may be alive)."""
        self._stream.synchronize()
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for b in bufs:
            b.free()
        self._frame_ready.destroy()
        self._stream.destroy()
        self._module.unload()


def _device_source(image: Any) -> tuple[int, int, int | None] | None:
    """(pointer, row pitch, producer stream) of a frame in device memory; None for a host array."""
    cai = getattr(image, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if cai.get("typestr") != "|u1" or len(cai["shape"]) != 3 or cai["shape"][2] != 3:
        what = f"{cai['typestr']} {cai['shape']}"
        raise ValueError(f"GpuLetterbox: a device frame must be HxWx3 uint8, got {what}")
    w = cai["shape"][1]
    strides = cai.get("strides") or (w * 3, 3, 1)
    if tuple(strides[1:]) != (3, 1):
        raise ValueError(f"GpuLetterbox: a device frame needs packed pixels (strides {strides})")
    stream = cai.get("stream")
    return int(cai["data"][0]), int(strides[0]), (int(stream) if stream else None)
