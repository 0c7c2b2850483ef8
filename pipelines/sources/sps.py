"""The H.264/H.265 sequence parameter set, read up to the VUI colour description, so that GPU colour
conversion can pick BT.601/BT.709/BT.2020 and limited/full range (the NVDEC stage: a changed SPS means a new
session; the VUI gives the colour matrix).

A stream that says nothing (no VUI, no video_signal_type, or "unspecified") is treated as **BT.601 limited
range**, as FFmpeg's swscale does for unspecified SD/HD material. A truncated SPS raises ``ValueError``
from :func:`parse_sps` only (callers that cannot care use :func:`colour_of`). NAL units and codec names are
pipelines/sources/bitstream.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from pipelines.sources.bitstream import H264_SPS, H265_SPS, codec_name, find_sps

log = logging.getLogger("pipelines.sources.bitstream")  # the journal's name for these lines

def unescape_rbsp(nal: bytes) -> bytes:
    """Remove emulation-prevention bytes (00 00 03 -> 00 00).

    bytes.replace scans left to right and resumes after each replacement, which is exactly the rule: the
    zero count restarts after an emulation-prevention byte.
    """
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


class _Bits:
    """MSB-first reader over a parameter set (tens of bytes, parsed once per new SPS: not a hot path)."""

    def __init__(self, data: bytes) -> None:
        self._value = int.from_bytes(data, "big")
        self._n = len(data) * 8
        self.pos = 0

    def u(self, n: int) -> int:
        if n == 0:
            return 0
        if self.pos + n > self._n:
            raise ValueError(f"parameter set truncated (need bit {self.pos + n}, have {self._n})")
        self.pos += n
        return (self._value >> (self._n - self.pos)) & ((1 << n) - 1)

    def flag(self) -> bool:
        return bool(self.u(1))

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise ValueError("invalid exp-Golomb code (more than 31 leading zeros)")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k & 1 else -(k // 2)

    def skip(self, n: int) -> None:
        self.u(n)  # bounds-checked like any read


_H264_PROFILES = {
    44: "CAVLC 4:4:4 Intra",
    66: "Baseline",
    77: "Main",
    88: "Extended",
    100: "High",
    110: "High 10",
    122: "High 4:2:2",
    244: "High 4:4:4 Predictive",
}
_H265_PROFILES = {
    1: "Main",
    2: "Main 10",
    3: "Main Still Picture",
    4: "Range Extensions",
    5: "High Throughput",
    9: "Screen Content Coding",
}
# H.264 profiles whose SPS carries chroma_format_idc, bit depths and scaling matrices (7.3.2.1.1).
_H264_HIGH = {100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135}
# matrix_coefficients (H.273) -> what a YUV->RGB conversion needs.
_MATRICES = {1: "bt709", 5: "bt601", 6: "bt601", 9: "bt2020", 10: "bt2020"}
_CHROMA = {0: "400", 1: "420", 2: "422", 3: "444"}


@dataclass(frozen=True)
class SpsInfo:
    """What a sequence parameter set says about decoding and colour.

    ``video_full_range_flag``/``colour_primaries``/``transfer_characteristics``/``matrix_coefficients`` are
    None when the SPS does not carry them (no VUI, no video_signal_type, no colour description). ``matrix``
    and ``full_range`` are what to use: the stream's values, else BT.601 limited (``colour_from_stream``
    says which).
    """

    codec: str  # "h264" | "hevc"
    profile_idc: int
    profile: str  # "High", "High 4:4:4 Predictive", "Main 10", ... or "profile N"
    level_idc: int
    chroma_format: str  # "400" | "420" | "422" | "444"
    bit_depth_luma: int
    bit_depth_chroma: int
    width: int  # after the cropping / conformance window
    height: int
    video_full_range_flag: bool | None = None
    colour_primaries: int | None = None
    transfer_characteristics: int | None = None
    matrix_coefficients: int | None = None
    vui_error: str | None = None  # the VUI was present but could not be read to its colour fields

    @property
    def matrix(self) -> str:
        """What YUV->RGB matrix to use: bt601, bt709, bt2020, or identity (GBR); unspecified -> bt601."""
        if self.matrix_coefficients == 0:
            return "identity"
        return _MATRICES.get(self.matrix_coefficients or 2, "bt601")

    @property
    def full_range(self) -> bool:
        return bool(self.video_full_range_flag)

    @property
    def colour_from_stream(self) -> bool:
        """True when ``matrix`` comes from the stream, False when it is the BT.601 fallback."""
        return self.matrix_coefficients in _MATRICES or self.matrix_coefficients == 0


def parse_sps(nal: bytes, codec: str) -> SpsInfo:
    """Parse an SPS NAL unit (header byte(s) included, start code excluded); ValueError if it is not one or
    is truncated before the picture size. A VUI cut short leaves the colour fields None (``vui_error``)."""
    codec = codec_name(codec)
    if codec == "hevc":
        return _parse_h265_sps(nal)
    if codec == "h264":
        return _parse_h264_sps(nal)
    raise ValueError(f"no SPS parser for codec {codec!r}")


def colour_of(data: bytes | np.ndarray, codec: str) -> tuple[str, bool]:
    """(matrix, full_range) from the first SPS in ``data``; ("bt601", False) when none or unreadable."""
    sps = find_sps(data, codec)
    if sps is not None:
        try:
            info = parse_sps(sps, codec)
            return info.matrix, info.full_range
        except ValueError as exc:
            log.debug("unreadable SPS (%s): assuming BT.601 limited range", exc)
    return "bt601", False


def _scaling_list(b: _Bits, size: int) -> None:
    last = nxt = 8
    for _ in range(size):
        if nxt != 0:
            nxt = (last + b.se() + 256) % 256
        last = nxt if nxt != 0 else last


def _vui_colour(b: _Bits) -> tuple[bool | None, int | None, int | None, int | None]:
    """The start of vui_parameters(), identical in H.264 (E.1.1) and H.265 (E.2.1), up to the colours."""
    # aspect_ratio_info_present_flag, then aspect_ratio_idc == Extended_SAR: sar_width, sar_height
    if b.flag() and b.u(8) == 255:
        b.skip(32)
    if b.flag():  # overscan_info_present_flag
        b.skip(1)
    if not b.flag():  # video_signal_type_present_flag
        return None, None, None, None
    b.skip(3)  # video_format
    full = b.flag()
    if not b.flag():  # colour_description_present_flag
        return full, None, None, None
    return full, b.u(8), b.u(8), b.u(8)


def _parse_h264_sps(nal: bytes) -> SpsInfo:
    if not nal or nal[0] & 0x1F != H264_SPS:
        raise ValueError("not an H.264 SPS NAL unit")
    b = _Bits(unescape_rbsp(nal[1:]))
    profile_idc = b.u(8)
    b.skip(8)  # constraint_set flags, reserved
    level_idc = b.u(8)
    b.ue()  # seq_parameter_set_id
    chroma_format_idc, separate_planes, depth_y, depth_c = 1, False, 8, 8
    if profile_idc in _H264_HIGH:
        chroma_format_idc = b.ue()
        if chroma_format_idc == 3:
            separate_planes = b.flag()
        depth_y = b.ue() + 8
        depth_c = b.ue() + 8
        b.skip(1)  # qpprime_y_zero_transform_bypass_flag
        if b.flag():  # seq_scaling_matrix_present_flag
            for i in range(8 if chroma_format_idc != 3 else 12):
                if b.flag():
                    _scaling_list(b, 16 if i < 6 else 64)
    b.ue()  # log2_max_frame_num_minus4
    poc_type = b.ue()
    if poc_type == 0:
        b.ue()  # log2_max_pic_order_cnt_lsb_minus4
    elif poc_type == 1:
        b.skip(1)  # delta_pic_order_always_zero_flag
        b.se()
        b.se()
        for _ in range(b.ue()):
            b.se()
    b.ue()  # max_num_ref_frames
    b.skip(1)  # gaps_in_frame_num_value_allowed_flag
    width_mbs = b.ue() + 1
    height_units = b.ue() + 1
    frame_mbs_only = b.flag()
    if not frame_mbs_only:
        b.skip(1)  # mb_adaptive_frame_field_flag
    b.skip(1)  # direct_8x8_inference_flag
    width, height = width_mbs * 16, (2 - frame_mbs_only) * height_units * 16
    if b.flag():  # frame_cropping_flag: vertical offsets count in field rows when fields are coded
        width, height = _cropped(b, width, height, chroma_format_idc, separate_planes, 2 - frame_mbs_only)
    info = _sps_fields("h264", profile_idc, level_idc, chroma_format_idc, (depth_y, depth_c), (width, height))
    return _with_vui(b, info)


def _cropped(
    b: _Bits, width: int, height: int, chroma_format_idc: int, separate_planes: bool, rows: int = 1
) -> tuple[int, int]:
    """`width` x `height` less the cropping (H.264) / conformance (H.265) window read from `b`: its four
    offsets count in chroma samples (SubWidthC, SubHeightC), times `rows` vertically."""
    left, right, top, bottom = b.ue(), b.ue(), b.ue(), b.ue()
    array_type = 0 if separate_planes else chroma_format_idc
    sub_w = 2 if array_type in (1, 2) else 1
    sub_h = 2 if array_type == 1 else 1
    return width - sub_w * (left + right), height - sub_h * rows * (top + bottom)


def _sps_fields(
    codec: str,
    profile_idc: int,
    level_idc: int,
    chroma_format_idc: int,
    depths: tuple[int, int],
    size: tuple[int, int],
) -> dict[str, object]:
    """The SpsInfo fields both codecs read before the VUI."""
    profiles = _H264_PROFILES if codec == "h264" else _H265_PROFILES
    return dict(
        codec=codec,
        profile_idc=profile_idc,
        profile=profiles.get(profile_idc, f"profile {profile_idc}"),
        level_idc=level_idc,
        chroma_format=_CHROMA.get(chroma_format_idc, str(chroma_format_idc)),
        bit_depth_luma=depths[0],
        bit_depth_chroma=depths[1],
        width=size[0],
        height=size[1],
    )


def _with_vui(b: _Bits, info: dict[str, object]) -> SpsInfo:
    try:
        if not b.flag():  # vui_parameters_present_flag
            return SpsInfo(**info)  # type: ignore[arg-type]
        full, primaries, transfer, matrix = _vui_colour(b)
    except ValueError as exc:
        # Some cameras cut the SPS short after the size: the picture is still decodable, colours default.
        return SpsInfo(**info, vui_error=str(exc))  # type: ignore[arg-type]
    return SpsInfo(
        **info,  # type: ignore[arg-type]
        video_full_range_flag=full,
        colour_primaries=primaries,
        transfer_characteristics=transfer,
        matrix_coefficients=matrix,
    )


def _h265_profile_tier_level(b: _Bits, max_sub_layers_minus1: int) -> tuple[int, int]:
    b.skip(2 + 1)  # general_profile_space, general_tier_flag
    profile_idc = b.u(5)
    b.skip(32 + 48)  # compatibility flags; progressive/interlaced/non-packed/frame-only + 44 constraint bits
    level_idc = b.u(8)
    present = [(b.flag(), b.flag()) for _ in range(max_sub_layers_minus1)]
    if max_sub_layers_minus1 > 0:
        b.skip(2 * (8 - max_sub_layers_minus1))  # reserved_zero_2bits
    for profile_present, level_present in present:
        if profile_present:
            b.skip(88)
        if level_present:
            b.skip(8)
    return profile_idc, level_idc


def _h265_scaling_list_data(b: _Bits) -> None:
    for size_id in range(4):
        for _ in range(0, 6, 3 if size_id == 3 else 1):
            if not b.flag():  # scaling_list_pred_mode_flag
                b.ue()  # scaling_list_pred_matrix_id_delta
                continue
            coefs = min(64, 1 << (4 + (size_id << 1)))
            if size_id > 1:
                b.se()  # scaling_list_dc_coef_minus8
            for _ in range(coefs):
                b.se()


def _h265_st_ref_pic_sets(b: _Bits, count: int) -> None:
    deltas: list[int] = []  # NumDeltaPics of each set, for inter-set prediction (7.4.8)
    for idx in range(count):
        if idx != 0 and b.flag():  # inter_ref_pic_set_prediction_flag
            b.skip(1)  # delta_rps_sign
            b.ue()  # abs_delta_rps_minus1
            used = 0
            for _ in range(deltas[idx - 1] + 1):  # in the SPS, RefRpsIdx is always idx - 1
                if b.flag() or b.flag():  # used_by_curr_pic_flag, else use_delta_flag
                    used += 1
            deltas.append(used)
        else:
            negative, positive = b.ue(), b.ue()
            for _ in range(negative + positive):
                b.ue()  # delta_poc_sX_minus1
                b.skip(1)  # used_by_curr_pic_sX_flag
            deltas.append(negative + positive)


def _parse_h265_sps(nal: bytes) -> SpsInfo:
    if len(nal) < 2 or (nal[0] >> 1) & 0x3F != H265_SPS:
        raise ValueError("not an H.265 SPS NAL unit")
    b = _Bits(unescape_rbsp(nal[2:]))
    b.skip(4)  # sps_video_parameter_set_id
    max_sub_layers_minus1 = b.u(3)
    b.skip(1)  # sps_temporal_id_nesting_flag
    profile_idc, level_idc = _h265_profile_tier_level(b, max_sub_layers_minus1)
    b.ue()  # sps_seq_parameter_set_id
    chroma_format_idc = b.ue()
    separate_planes = b.flag() if chroma_format_idc == 3 else False
    width, height = b.ue(), b.ue()
    if b.flag():  # conformance_window_flag
        width, height = _cropped(b, width, height, chroma_format_idc, separate_planes)
    depths = b.ue() + 8, b.ue() + 8
    info = _sps_fields("hevc", profile_idc, level_idc, chroma_format_idc, depths, (width, height))
    try:
        log2_max_poc_lsb = b.ue() + 4
        ordering_all = b.flag()  # sps_sub_layer_ordering_info_present_flag
        for _ in range(0 if ordering_all else max_sub_layers_minus1, max_sub_layers_minus1 + 1):
            b.ue()
            b.ue()
            b.ue()
        for _ in range(6):  # coding/transform block sizes, transform hierarchy depths
            b.ue()
        if b.flag() and b.flag():  # scaling_list_enabled_flag, sps_scaling_list_data_present_flag
            _h265_scaling_list_data(b)
        b.skip(2)  # amp_enabled_flag, sample_adaptive_offset_enabled_flag
        if b.flag():  # pcm_enabled_flag
            b.skip(8)  # pcm sample bit depths
            b.ue()
            b.ue()
            b.skip(1)
        _h265_st_ref_pic_sets(b, b.ue())
        if b.flag():  # long_term_ref_pics_present_flag
            for _ in range(b.ue()):
                b.skip(log2_max_poc_lsb + 1)
        b.skip(2)  # sps_temporal_mvp_enabled_flag, strong_intra_smoothing_enabled_flag
    except ValueError as exc:
        return SpsInfo(**info, vui_error=str(exc))  # type: ignore[arg-type]
    return _with_vui(b, info)


__all__ = ["SpsInfo", "colour_of", "parse_sps", "unescape_rbsp"]
