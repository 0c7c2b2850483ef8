"""Write lossless H.264 streams (every macroblock I_PCM) from raw frames, with no encoder installed.

Tests need H.264 clips whose decoded pixels are known exactly, at sizes the bundled clip does not have
(1080p, odd crops, a resolution change mid-stream), on machines where no encoder exists: OpenCV's FFmpeg
wheels carry no H.264 encoder, and the H100 box has NVDEC but no NVENC. An I_PCM macroblock stores its
samples verbatim, so every conforming decoder (FFmpeg on the CPU, NVDEC) must return exactly the samples
written: a reference for bit-exact decode tests that needs only numpy.

    frames = [...]                                    # HxWx3 uint8 BGR, even H and W
    data = encode_pcm(frames, fps=25, full_range=False, matrix=1)
    Path("clip.h264").write_bytes(data)               # Annex-B, SPS+PPS before every IDR

Samples are clamped to 1..255: with no zero byte in the payload no start-code emulation can occur, so no
emulation-prevention bytes are needed (the clamping is part of the expected output: `expected_planes`).
Every frame is an IDR picture (baseline profile, CAVLC, deblocking off), 1.5 bytes per pixel.

    python tools/h264_pcm.py --from agent/assets/bikes.mp4 --size 1920x1080 --frames 30 --out clip.h264
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import cv2
import numpy as np


class _Bits:
    """MSB-first bit writer for the few header fields (the macroblock payload is built with numpy)."""

    def __init__(self) -> None:
        self.bits: list[int] = []

    def u(self, n: int, value: int) -> None:
        self.bits.extend((value >> (n - 1 - i)) & 1 for i in range(n))

    def ue(self, value: int) -> None:
        code = value + 1
        self.u(2 * code.bit_length() - 1, code)

    def se(self, value: int) -> None:
        self.ue(2 * value - 1 if value > 0 else -2 * value)

    def trailing(self) -> bytes:
        self.bits.append(1)  # rbsp_stop_one_bit
        return self.aligned()

    def aligned(self) -> bytes:
        pad = (-len(self.bits)) % 8
        bits = np.array(self.bits + [0] * pad, dtype=np.uint8)
        return np.packbits(bits).tobytes()


_EMULATION = re.compile(b"\x00\x00(?=[\x00-\x03])")


def _nal(header: int, rbsp: bytes) -> bytes:
    # Emulation prevention: 00 00 followed by 00..03 inside a NAL unit gets an 03 between (H.264 7.4.1);
    # headers need it (e.g. num_units_in_tick 1000 = 00 00 03 E8), PCM payloads never do (no zero bytes).
    return b"\x00\x00\x00\x01" + bytes([header]) + _EMULATION.sub(b"\x00\x00\x03", rbsp)


def sps(
    width: int,
    height: int,
    *,
    fps: float | None = None,
    full_range: bool | None = None,
    matrix: int | None = None,
) -> bytes:
    """A baseline SPS NAL unit for a width x height picture (cropped from whole macroblocks).

    With ``full_range``/``matrix`` the VUI carries video_signal_type (video_full_range_flag, and colour
    primaries / transfer / matrix_coefficients = ``matrix``: 1 BT.709, 6 BT.601, 9 BT.2020).
    """
    if width % 2 or height % 2 or width < 16 or height < 16:
        raise ValueError(f"width and height must be even and >= 16, got {width}x{height}")
    mbw, mbh = -(-width // 16), -(-height // 16)
    b = _Bits()
    b.u(8, 66)  # profile_idc: baseline
    b.u(8, 0)  # constraint flags
    b.u(8, 51)  # level_idc 5.1 (PCM needs a high bitrate; decoders take the level as a hint)
    b.ue(0)  # seq_parameter_set_id
    b.ue(0)  # log2_max_frame_num_minus4
    b.ue(2)  # pic_order_cnt_type 2: output order is decoding order, nothing in the slice header
    b.ue(1)  # max_num_ref_frames
    b.u(1, 0)  # gaps_in_frame_num_value_allowed_flag
    b.ue(mbw - 1)
    b.ue(mbh - 1)
    b.u(1, 1)  # frame_mbs_only_flag
    b.u(1, 1)  # direct_8x8_inference_flag
    crop_right, crop_bottom = (mbw * 16 - width) // 2, (mbh * 16 - height) // 2  # chroma units (4:2:0)
    cropping = bool(crop_right or crop_bottom)
    b.u(1, int(cropping))
    if cropping:
        for offset in (0, crop_right, 0, crop_bottom):
            b.ue(offset)
    vui = fps is not None or full_range is not None or matrix is not None
    b.u(1, int(vui))
    if vui:
        b.u(1, 0)  # aspect_ratio_info_present_flag
        b.u(1, 0)  # overscan_info_present_flag
        signal = full_range is not None or matrix is not None
        b.u(1, int(signal))  # video_signal_type_present_flag
        if signal:
            b.u(3, 5)  # video_format: unspecified
            b.u(1, int(bool(full_range)))
            b.u(1, int(matrix is not None))  # colour_description_present_flag
            if matrix is not None:
                b.u(8, matrix)  # colour_primaries
                b.u(8, matrix)  # transfer_characteristics
                b.u(8, matrix)  # matrix_coefficients
        b.u(1, 0)  # chroma_loc_info_present_flag
        b.u(1, int(fps is not None))  # timing_info_present_flag
        if fps is not None:
            b.u(32, 1000)  # num_units_in_tick
            b.u(32, round(fps * 2000))  # time_scale (two ticks per frame)
            b.u(1, 1)  # fixed_frame_rate_flag
        b.u(1, 0)  # nal_hrd_parameters_present_flag
        b.u(1, 0)  # vcl_hrd_parameters_present_flag
        b.u(1, 0)  # pic_struct_present_flag
        b.u(1, 0)  # bitstream_restriction_flag
    return _nal(0x67, b.trailing())


def pps() -> bytes:
    b = _Bits()
    b.ue(0)  # pic_parameter_set_id
    b.ue(0)  # seq_parameter_set_id
    b.u(1, 0)  # entropy_coding_mode_flag: CAVLC
    b.u(1, 0)  # bottom_field_pic_order_in_frame_present_flag
    b.ue(0)  # num_slice_groups_minus1
    b.ue(0)  # num_ref_idx_l0_default_active_minus1
    b.ue(0)  # num_ref_idx_l1_default_active_minus1
    b.u(1, 0)  # weighted_pred_flag
    b.u(2, 0)  # weighted_bipred_idc
    b.se(0)  # pic_init_qp_minus26
    b.se(0)  # pic_init_qs_minus26
    b.se(0)  # chroma_qp_index_offset
    b.u(1, 1)  # deblocking_filter_control_present_flag (the slices turn it off)
    b.u(1, 0)  # constrained_intra_pred_flag
    b.u(1, 0)  # redundant_pic_cnt_present_flag
    return _nal(0x68, b.trailing())


# mb_type I_PCM is ue(25) = 000011010; followed by pcm_alignment_zero_bits it is 0x0D 0x00 when the
# macroblock starts byte-aligned, which every macroblock after the first does (PCM samples are whole bytes).
_PCM_MB = np.array([0x0D, 0x00], dtype=np.uint8)


def _macroblocks(y: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(N, 384) PCM samples per macroblock in raster order: 256 luma, 64 Cb, 64 Cr (each raster)."""
    mbh, mbw = y.shape[0] // 16, y.shape[1] // 16
    luma = y.reshape(mbh, 16, mbw, 16).transpose(0, 2, 1, 3).reshape(-1, 256)
    cb = u.reshape(mbh, 8, mbw, 8).transpose(0, 2, 1, 3).reshape(-1, 64)
    cr = v.reshape(mbh, 8, mbw, 8).transpose(0, 2, 1, 3).reshape(-1, 64)
    return np.concatenate([luma, cb, cr], axis=1)


def expected_planes(bgr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Y, U, V planes (H x W, H/2 x W/2 twice) a decoder must return for this frame."""
    h, w = bgr.shape[:2]
    i420 = cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420)
    np.clip(i420, 1, 255, out=i420)
    flat = i420.reshape(-1)  # planes are contiguous; index flat (w/2 may be odd, so rows do not line up)
    chroma = (h // 2) * (w // 2)
    y = flat[: h * w].reshape(h, w)
    u = flat[h * w : h * w + chroma].reshape(h // 2, w // 2)
    v = flat[h * w + chroma :].reshape(h // 2, w // 2)
    return y, u, v


def idr_picture(bgr: np.ndarray, idr_pic_id: int) -> bytes:
    """One IDR slice NAL unit holding the whole frame as I_PCM macroblocks."""
    h, w = bgr.shape[:2]
    y, u, v = expected_planes(bgr)
    mbw, mbh = -(-w // 16), -(-h // 16)
    # Pad to whole macroblocks by repeating the edge (the SPS crops it away again).
    y = np.pad(y, ((0, mbh * 16 - h), (0, mbw * 16 - w)), mode="edge")
    u = np.pad(u, ((0, mbh * 8 - h // 2), (0, mbw * 8 - w // 2)), mode="edge")
    v = np.pad(v, ((0, mbh * 8 - h // 2), (0, mbw * 8 - w // 2)), mode="edge")
    mbs = _macroblocks(y, u, v)
    b = _Bits()
    b.ue(0)  # first_mb_in_slice
    b.ue(7)  # slice_type: I (all slices of the picture)
    b.ue(0)  # pic_parameter_set_id
    b.u(4, 0)  # frame_num (log2_max_frame_num = 4)
    b.ue(idr_pic_id)  # consecutive IDR pictures need different ids
    b.u(1, 0)  # no_output_of_prior_pics_flag
    b.u(1, 0)  # long_term_reference_flag
    b.se(0)  # slice_qp_delta
    b.ue(1)  # disable_deblocking_filter_idc: off
    b.ue(25)  # mb_type of the first macroblock: I_PCM
    head = b.aligned()  # + pcm_alignment_zero_bits
    rest = np.concatenate([np.broadcast_to(_PCM_MB, (mbs.shape[0] - 1, 2)), mbs[1:]], axis=1)
    payload = b"".join((head, mbs[0].tobytes(), rest.tobytes(), b"\x80"))  # + rbsp trailing bits
    return _nal(0x65, payload)


def encode_pcm(
    frames: Iterable[np.ndarray],
    *,
    fps: float | None = 25.0,
    full_range: bool | None = None,
    matrix: int | None = None,
) -> bytes:
    """Annex-B H.264 of the frames (HxWx3 uint8 BGR, even sizes; the size may change between frames)."""
    out: list[bytes] = []
    size: tuple[int, int] | None = None
    header = b""
    for index, frame in enumerate(frames):
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"frame {index}: need HxWx3 uint8, got {frame.shape} {frame.dtype}")
        h, w = frame.shape[:2]
        if (w, h) != size:
            size = (w, h)
            header = sps(w, h, fps=fps, full_range=full_range, matrix=matrix) + pps()
        # Parameter sets before every IDR, as cameras send them: a decoder can join at any frame.
        out.append(header + idr_picture(frame, index % 2))
    return b"".join(out)


def _frames_from(path: str, size: tuple[int, int] | None, count: int) -> list[np.ndarray]:
    cap = cv2.VideoCapture(path)
    frames: list[np.ndarray] = []
    try:
        while len(frames) < count:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(cv2.resize(frame, size) if size else frame)
    finally:
        cap.release()
    if not frames:
        raise SystemExit(f"{path}: no frames could be read")
    return frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, help="video file to take frames from")
    parser.add_argument("--size", help="WxH to resize to (even numbers)")
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--fps", type=float, default=25.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.lower().split("x")) if args.size else None
    frames = _frames_from(args.source, size, args.frames)  # type: ignore[arg-type]
    Path(args.out).write_bytes(encode_pcm(frames, fps=args.fps))
    print(f"{args.out}: {len(frames)} frames {frames[0].shape[1]}x{frames[0].shape[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
