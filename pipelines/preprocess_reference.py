"""The GPU letterbox kernels' arithmetic in numpy (pipelines.preprocess_gpu): what each kernel computes,
bit for bit, without a GPU.

`resize_reference` is OpenCV's INTER_LINEAR resize of uint8 images in 11-bit fixed point (the weights and
the vertical pass exactly as OpenCV's SIMD path computes them); `letterbox_reference` places it as the CPU
path does (pipelines.preprocess.place) and normalises with x * mul + add per channel in float32. It is
bit-identical to cv2.resize on x86 OpenCV builds (tests/test_preprocess_gpu.py checks it without a GPU)
and the kernels are bit-identical to it (checked on a GPU). `yuv_coefficients` and
`nv12_to_bgr_reference` are the NV12 kernel's YUV -> BGR, OpenCV's cvtColor for BT.601 limited range.
"""

from __future__ import annotations

import numpy as np

from pipelines.preprocess import Letterbox, Normalisation, place


def _source_coords(src: int, dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Source index (floor) and fraction per output index, as OpenCV computes them: (d + 0.5) * scale - 0.5
    in double (scale = 1 / (dst / src), as cv2.resize derives it), rounded to float."""
    scale = 1.0 / (dst / src)
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    index = np.floor(f).astype(np.int32)
    return index, f - index.astype(np.float32)


def _weights(frac: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    one = np.float32(1.0)
    return (
        np.rint((one - frac) * np.float32(2048)).astype(np.int32),
        np.rint(frac * np.float32(2048)).astype(np.int32),
    )


def resize_reference(image: np.ndarray, new_w: int, new_h: int) -> np.ndarray:
    """cv2.resize(image, (new_w, new_h)) for HxWx3 uint8, INTER_LINEAR, in the kernel's arithmetic."""
    h, w = image.shape[:2]
    sx, fx = _source_coords(w, new_w)
    edge = (sx < 0) | (sx >= w - 1)
    fx[edge] = 0.0
    sx = np.clip(sx, 0, w - 1)
    x1 = np.minimum(sx + 1, w - 1)
    sy, fy = _source_coords(h, new_h)
    y0, y1 = np.clip(sy, 0, h - 1), np.clip(sy + 1, 0, h - 1)
    a0, a1 = (a[None, :, None] for a in _weights(fx))
    b0, b1 = (b[:, None, None] for b in _weights(fy))
    img = image.astype(np.int32)
    h0 = img[y0][:, sx] * a0 + img[y0][:, x1] * a1
    h1 = img[y1][:, sx] * a0 + img[y1][:, x1] * a1
    v = ((((h0 >> 4) * b0) >> 16) + (((h1 >> 4) * b1) >> 16) + 2) >> 2
    return np.clip(v, 0, 255).astype(np.uint8)


def letterbox_reference(image: np.ndarray, norm: Normalisation) -> tuple[np.ndarray, Letterbox]:
    """One image through the kernel's arithmetic: (3, H, W) float32 and its Letterbox."""
    dst_h, dst_w = norm.input_hw
    lb, new_w, new_h = place(image.shape[0], image.shape[1], dst_h, dst_w)
    left, top = int(lb.pad_x), int(lb.pad_y)
    out = np.empty((3, dst_h, dst_w), np.float32)
    out[...] = norm.pad[:, None, None]
    resized = resize_reference(image, new_w, new_h).transpose(2, 0, 1)
    if norm.swap_rb:
        resized = resized[::-1]
    region = out[:, top : top + new_h, left : left + new_w]
    np.multiply(resized, norm.mul[:, None, None], out=region)
    region += norm.add[:, None, None]
    return out, lb


# --- NV12 (NVDEC pictures): OpenCV's YUV -> BGR, then the same letterbox --------------------------------
# cv2.cvtColor(COLOR_YUV2BGR_NV12)'s constants (BT.601, limited range) in 1/2^20: cy, y offset, cvr, cvg,
# cug, cub. The reference with these equals OpenCV exactly (tests/test_preprocess_gpu.py).
OPENCV_BT601 = (1220542, 16, 1673527, -852492, -409993, 2116026)
_KR_KB = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722), "bt2020": (0.2627, 0.0593)}


def yuv_coefficients(matrix: str, full_range: bool) -> tuple[int, int, int, int, int, int]:
    """Fixed-point YUV -> RGB coefficients for a stream's matrix_coefficients and video_full_range_flag.

    BT.601 limited range uses OpenCV's own constants (so NVDEC frames match the CPU path's cvtColor); the
    others are derived the textbook way (Kr, Kb; 255/219 and 255/224 for limited range).
    """
    if matrix == "bt601" and not full_range:
        return OPENCV_BT601
    kr, kb = _KR_KB.get(matrix, _KR_KB["bt601"])
    kg = 1.0 - kr - kb
    y_scale, c_scale, offset = (1.0, 1.0, 0) if full_range else (255 / 219, 255 / 224, 16)

    def fixed(v: float) -> int:
        return round(v * (1 << 20))

    return (
        fixed(y_scale),
        offset,
        fixed(2 * (1 - kr) * c_scale),
        fixed(-2 * (1 - kr) * kr / kg * c_scale),
        fixed(-2 * (1 - kb) * kb / kg * c_scale),
        fixed(2 * (1 - kb) * c_scale),
    )


def nv12_to_bgr_reference(
    y: np.ndarray, uv: np.ndarray, matrix: str = "bt601", full_range: bool = False
) -> np.ndarray:
    """The kernel's NV12 -> BGR uint8 (chroma replicated 2x2): equals cv2.cvtColor(COLOR_YUV2BGR_NV12) for
    BT.601 limited range. `y`: HxW, `uv`: (H/2)xW interleaved or (H/2)x(W/2)x2."""
    cy, y_off, cvr, cvg, cug, cub = yuv_coefficients(matrix, full_range)
    h, w = y.shape
    uv = uv.reshape(h // 2, w // 2, 2)
    u = np.repeat(np.repeat(uv[:, :, 0].astype(np.int64) - 128, 2, 0), 2, 1)
    v = np.repeat(np.repeat(uv[:, :, 1].astype(np.int64) - 128, 2, 0), 2, 1)
    yy = np.maximum(y.astype(np.int64) - y_off, 0) * cy + (1 << 19)
    bgr = np.stack([(yy + cub * u) >> 20, (yy + cvg * v + cug * u) >> 20, (yy + cvr * v) >> 20], axis=-1)
    return np.clip(bgr, 0, 255).astype(np.uint8)


def nv12_letterbox_reference(
    y: np.ndarray, uv: np.ndarray, norm: Normalisation, matrix: str = "bt601", full_range: bool = False
) -> tuple[np.ndarray, Letterbox]:
    """One NV12 picture through the NV12 kernel's arithmetic: (3, H, W) float32 and its Letterbox."""
    return letterbox_reference(nv12_to_bgr_reference(y, uv, matrix, full_range), norm)
