"""The NVDEC path's CPU-side behaviour (no GPU here): reader choice, fallback, failure, SPS detection.

The decoding itself is tested on a GPU in tests/test_nvdec_gpu.py (marked gpu).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from pipelines.nvdec import NvdecReader, _parameter_set, nvdec_unavailable, open_reader
from pipelines.sources import CameraReader, FrameSlot, SourceSpec
from tools.h264_pcm import encode_pcm

CLIP = Path(__file__).resolve().parents[1] / "agent" / "assets" / "bikes.mp4"
needs_no_nvdec = pytest.mark.skipif(nvdec_unavailable() is None, reason="this host can decode with NVDEC")


def _spec(**kw: object) -> SourceSpec:
    return SourceSpec(camera="cam", url=str(CLIP), realtime=False, loop=True, **kw)  # type: ignore[arg-type]


def test_cpu_decoder_is_the_plain_reader() -> None:
    reader = open_reader(_spec(), FrameSlot(), None, decoder="cpu")
    assert type(reader) is CameraReader
    assert reader.decoder == "cpu" and reader.decoder_reason is None


@needs_no_nvdec
def test_auto_without_nvdec_decodes_on_the_cpu_with_the_reason() -> None:
    reader = open_reader(_spec(), FrameSlot(), None, decoder="auto")
    assert type(reader) is CameraReader
    assert reader.decoder == "cpu"
    assert reader.decoder_reason == nvdec_unavailable()
    reader.start()
    try:
        frame = reader.slot.get(timeout=20)
        assert frame is not None and frame.image.shape == (272, 640, 3)
    finally:
        reader.stop()


@needs_no_nvdec
def test_nvdec_named_without_nvdec_fails_the_camera_naming_what_is_missing() -> None:
    states: list[tuple[str, str | None]] = []
    reader = open_reader(_spec(), FrameSlot(), lambda c, s, r: states.append((s, r)), decoder="nvdec")
    assert isinstance(reader, NvdecReader)
    reader.start()
    reader.join(20)
    assert not reader.is_alive()
    state, reason = states[-1]
    assert state == "failed"
    assert reason is not None and "decoder nvdec" in reason and nvdec_unavailable() in reason  # type: ignore[operator]
    assert reader.frames_in == 0 and reader.sessions_open == 0


@needs_no_nvdec
def test_nvdec_reader_in_auto_mode_switches_to_cpu_frames_without_a_reconnect() -> None:
    reader = NvdecReader(_spec(), FrameSlot(), mode="auto")
    reader.start()
    try:
        frame = reader.slot.get(timeout=20)
        assert frame is not None and frame.image.shape == (272, 640, 3)
        assert reader.decoder == "cpu" and reader.decoder_reason
        assert reader.reconnects == 0  # the fallback reopened at once, not through backoff
        assert reader.stats()["decoder"] == "cpu"
    finally:
        reader.stop()


def test_parameter_set_found_in_key_frames_and_changes_with_the_size() -> None:
    import numpy as np

    small = np.full((272, 640, 3), 90, np.uint8)
    big = np.full((1080, 1920, 3), 90, np.uint8)
    a, b = encode_pcm([small]), encode_pcm([big])
    sps_a, sps_b = _parameter_set(a, "h264"), _parameter_set(b, "h264")
    assert sps_a is not None and sps_b is not None and sps_a != sps_b
    assert sps_a[0] & 0x1F == 7
    assert _parameter_set(encode_pcm([small.copy()]), "avc1") == sps_a  # same parameters: same bytes
    slice_only = a[a.index(b"\x00\x00\x00\x01\x65") :]
    assert _parameter_set(slice_only, "h264") is None
    assert _parameter_set(b"", "h264") is None and _parameter_set(b"\x00\x00\x01", "hevc") is None


CONFIG = """
models:
  m: {{onnx: m.onnx, format: nanodet, labels: l.txt}}
cameras:
  c: {{{source}, model: m, decoder: {decoder}}}
"""


def test_config_decoder_values_and_pipeline_rule(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(CONFIG.format(source="url: rtsp://h/s", decoder="nvdec"))
    assert load_config(path).cameras["c"].decoder == "nvdec"
    path.write_text(CONFIG.format(source="url: rtsp://h/s", decoder="gpu"))
    with pytest.raises(ConfigError, match=r"cameras\.c\.decoder"):
        load_config(path)
    path.write_text(CONFIG.format(source="pipeline: 'videotestsrc ! appsink'", decoder="nvdec"))
    with pytest.raises(ConfigError, match=r"nvdec.*pipeline"):
        load_config(path)
    path.write_text(CONFIG.format(source="url: rtsp://h/s", decoder="auto").replace(", decoder: auto", ""))
    assert load_config(path).cameras["c"].decoder == "auto"


class _Collecting(FrameSlot):
    def __init__(self) -> None:
        super().__init__()
        self.all: list = []

    def put(self, frame) -> None:  # type: ignore[no-untyped-def, override]
        self.all.append(frame)
        super().put(frame)


class fake_delaying_decoder:
    """Hands out the picture of packet k after packet k + delay (as NVDEC's native latency holds up to 4
    back); the "picture" is k itself. Records when each decode() call came."""

    def __init__(self, delay: int, latency: str) -> None:
        self.delay, self.latency = delay, latency
        self.calls: list[float] = []
        self.pending: list[int] = []

    def decode(self, packet: object, keyframe: bool) -> list[int]:
        import time

        self.calls.append(time.time())
        self.pending.append(len(self.calls) - 1)
        return [self.pending.pop(0)] if len(self.pending) > self.delay else []

    def flush(self) -> list[int]:
        return []


@pytest.mark.parametrize(("delay", "latency"), [(0, "LOW"), (4, "NATIVE")])
def test_pictures_carry_the_capture_time_of_their_own_packet(delay: int, latency: str) -> None:
    """A picture that leaves the decoder packets later is stamped with its own packet's arrival (between the
    decode calls of packets k-1 and k), so frame age counts the decoder's hold-back."""
    import cv2

    spec = SourceSpec(camera="cam", url=str(CLIP), realtime=False, loop=False)
    slot = _Collecting()
    reader = NvdecReader(spec, slot, mode="nvdec")
    dec = fake_delaying_decoder(delay, latency)
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    try:
        delivered, why = reader._stream_packets(cap, dec)  # type: ignore[arg-type]
    finally:
        cap.release()
    assert why.startswith("end of file") and delivered == len(slot.all) > 100
    for frame in slot.all:
        k = frame.image
        assert dec.calls[k] >= frame.ts_capture, k
        assert k == 0 or frame.ts_capture >= dec.calls[k - 1], k


def test_decoder_latency_setting() -> None:
    from agent.config import parse_config

    base = {"models": {"m": {"onnx": "m.onnx"}}}
    cam = {"url": "rtsp://x/y", "model": "m"}
    assert parse_config({**base, "cameras": {"c": cam}}).cameras["c"].decoder_latency == "low"
    native = parse_config({**base, "cameras": {"c": {**cam, "decoder_latency": "native"}}})
    assert native.cameras["c"].decoder_latency == "native"
    with pytest.raises(ConfigError, match=r"a.yaml: cameras.c.decoder_latency"):
        parse_config({**base, "cameras": {"c": {**cam, "decoder_latency": "fast"}}}, "a.yaml")
    with pytest.raises(ValueError, match="decoder latency must be low or native"):
        NvdecReader(_spec(), FrameSlot(), mode="nvdec", latency="fast")
