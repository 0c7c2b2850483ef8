"""tools/h264_pcm.py: the lossless H.264 writer the decode tests use as ground truth.

FFmpeg (through OpenCV, the agent's CPU decoder) must return exactly the luma samples that were written,
at the bundled clip's size, 1080p (cropped from 1088 coded lines) and an odd crop. `CAP_PROP_CONVERT_RGB=0`
makes OpenCV's FFmpeg backend hand out the decoder's first plane (luma) without colour conversion.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from tools.h264_pcm import encode_pcm, expected_planes, sps

CLIP = Path(__file__).resolve().parents[1] / "agent" / "assets" / "bikes.mp4"


def _clip_frames(count: int) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(CLIP))
    try:
        frames = [cap.read()[1] for _ in range(count)]
    finally:
        cap.release()
    assert all(f is not None for f in frames)
    return frames


def _cpu_luma(path: Path) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    assert cap.set(cv2.CAP_PROP_CONVERT_RGB, 0)
    out = []
    try:
        while True:
            ok, plane = cap.read()
            if not ok:
                return out
            out.append(plane)
    finally:
        cap.release()


@pytest.mark.parametrize("size", [(640, 272), (1920, 1080), (1282, 722)])
def test_cpu_decoder_returns_the_written_luma_exactly(tmp_path: Path, size: tuple[int, int]) -> None:
    rng = np.random.default_rng(7)
    frames = [cv2.resize(f, size) for f in _clip_frames(4)]
    frames.append(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))  # noise: every value
    path = tmp_path / "clip.h264"
    path.write_bytes(encode_pcm(frames, fps=25))
    decoded = _cpu_luma(path)
    assert len(decoded) == len(frames)
    for index, (frame, luma) in enumerate(zip(frames, decoded, strict=True)):
        expected = expected_planes(frame)[0]
        assert luma.shape == expected.shape, index
        assert np.array_equal(luma, expected), f"frame {index}: {np.count_nonzero(luma != expected)} samples"


def test_samples_are_clamped_so_no_start_code_can_appear() -> None:
    black = np.zeros((32, 32, 3), np.uint8)
    data = encode_pcm([black, black])
    y, u, v = expected_planes(black)
    assert y.min() >= 1 and u.min() >= 1 and v.min() >= 1
    nals = [n for n in data.split(b"\x00\x00\x00\x01") if n]
    assert [n[0] & 0x1F for n in nals] == [7, 8, 5, 7, 8, 5]  # SPS, PPS, IDR slice per frame
    for slice_nal in nals[2::3]:
        assert b"\x00\x00" not in slice_nal  # no start code and nothing to escape in 3 kB of samples
    assert b"\x00\x00\x03\x03\xe8" in nals[0]  # the SPS timing 1000 (00 00 03 e8) is escaped


def test_headers_reject_sizes_h264_cannot_crop_to() -> None:
    with pytest.raises(ValueError, match="even"):
        sps(641, 272)
    with pytest.raises(ValueError, match="HxWx3"):
        encode_pcm([np.zeros((32, 32), np.uint8)])
