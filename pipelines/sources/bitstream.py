"""H.264/H.265 bitstream helpers, once for the package: codec names, NAL units, fourcc text.

The NVDEC stage and the capture need them; the SPS parser (colour matrix and range) is
pipelines/sources/sps.py. Free of OpenCV state: :func:`nal_units` / :func:`nal_types` (start codes found with
bytes.find, no per-byte Python loop), :func:`is_irap`, :func:`find_sps`.

Nothing here raises on a corrupt stream: a truncated packet yields fewer NAL units.
"""

from __future__ import annotations

import math

import numpy as np

# --- NAL units ------------------------------------------------------------------------------------------
_START = b"\x00\x00\x01"
H264_IDR, H264_SEI, H264_SPS, H264_PPS, H264_AUD = 5, 6, 7, 8, 9
H265_IRAP = range(16, 22)  # BLA_W_LP .. CRA_NUT (16-21): a decoder can start here
H265_VPS, H265_SPS, H265_PPS, H265_AUD = 32, 33, 34, 35
_HEVC_NAMES = {"hevc", "h265", "hev1", "hvc1"}
_H264_NAMES = {"h264", "avc1", "avc", "x264"}


def codec_name(fourcc_or_name: str) -> str:
    """``"h264"``, ``"hevc"``, or the lower-cased input for anything else (FFmpeg tags and common names)."""
    name = fourcc_or_name.strip().lower()
    if name in _H264_NAMES:
        return "h264"
    if name in _HEVC_NAMES:
        return "hevc"
    return name


def nal_spans(data: bytes) -> list[tuple[int, int]]:
    """(begin, end) of each NAL unit in an Annex-B buffer: begin is just past the start code, end excludes
    the next start code and trailing zero bytes (a 4-byte start code's leading zero, trailing_zero_8bits).

    bytes.find (memchr speed) over a buffer of a few hundred kB: a handful of calls per packet. Bytes
    before the first start code and empty units are skipped, so garbage yields ``[]``, never an exception.
    """
    spans: list[tuple[int, int]] = []
    pos = data.find(_START)
    while pos >= 0:
        begin = pos + 3
        nxt = data.find(_START, begin)
        end = len(data) if nxt < 0 else nxt
        # A NAL unit never ends in a zero byte (rbsp_stop_one_bit; cabac_zero_words are 00 00 03), so zeros
        # before the next start code belong to it. rstrip on a slice copies, so walk back a few bytes.
        while end > begin and data[end - 1] == 0:
            end -= 1
        if end > begin:
            spans.append((begin, end))
        pos = nxt
    return spans


def nal_units(data: bytes | np.ndarray) -> list[bytes]:
    """The NAL units (header included, start codes excluded) of an Annex-B buffer."""
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    return [buf[b:e] for b, e in nal_spans(buf)]


def nal_type(nal: bytes, codec: str) -> int:
    """nal_unit_type of one NAL unit (H.264: low 5 bits of byte 0; H.265: bits 1-6 of byte 0)."""
    return (nal[0] >> 1) & 0x3F if codec_name(codec) == "hevc" else nal[0] & 0x1F


def nal_types(data: bytes | np.ndarray, codec: str) -> list[int]:
    """nal_unit_type of every NAL unit of an Annex-B buffer, in order."""
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    hevc = codec_name(codec) == "hevc"
    return [((buf[b] >> 1) & 0x3F) if hevc else (buf[b] & 0x1F) for b, _ in nal_spans(buf)]


def is_irap(types: list[int] | tuple[int, ...], codec: str) -> bool:
    """True when the NAL types include a random-access picture: H.264 IDR (5), H.265 IRAP (16-21)."""
    if codec_name(codec) == "hevc":
        return any(t in H265_IRAP for t in types)
    return H264_IDR in types


def find_sps(data: bytes | np.ndarray, codec: str) -> bytes | None:
    """The first sequence parameter set NAL unit (H.264 type 7, H.265 type 33) of a buffer, or None."""
    want = H265_SPS if codec_name(codec) == "hevc" else H264_SPS
    for nal in nal_units(data):
        if nal_type(nal, codec) == want:
            return nal
    return None


def fourcc_text(value: float) -> str:
    """A fourcc property (CAP_PROP_FOURCC, CAP_PROP_CODEC_PIXEL_FORMAT) as text; "" when unknown."""
    if not math.isfinite(value) or value <= 0:
        return ""
    return (int(value) & 0xFFFFFFFF).to_bytes(4, "little").decode("latin-1").strip("\x00 ")


__all__ = [
    "codec_name",
    "find_sps",
    "fourcc_text",
    "is_irap",
    "nal_spans",
    "nal_type",
    "nal_types",
    "nal_units",
]
