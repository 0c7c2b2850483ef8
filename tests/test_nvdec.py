"""The NVDEC path's CPU-side behaviour (no GPU here): reader choice, fallback, failure, SPS detection, and
the reader's loop with the NVDEC stage around a `fake_` decoder session (file loops, reconnects reusing the
session, picture stamps, stalls).

The decoding itself is tested on a GPU in tests/test_nvdec_gpu.py (marked gpu).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.config import ConfigError, load_config
from pipelines.sources import CameraReader, FrameSlot, SourceSpec, open_reader
from pipelines.sources.bitstream import find_sps
from pipelines.sources.nvdec import NvdecStage, nvdec_unavailable
from tools.h264_pcm import encode_pcm

CLIP = Path(__file__).resolve().parents[1] / "agent" / "assets" / "bikes.mp4"
needs_no_nvdec = pytest.mark.skipif(nvdec_unavailable() is None, reason="this host can decode with NVDEC")


def _spec(**kw: object) -> SourceSpec:
    return SourceSpec(camera="cam", url=str(CLIP), realtime=False, loop=True, **kw)  # type: ignore[arg-type]


def test_cpu_decoder_is_the_plain_reader() -> None:
    reader = open_reader(_spec(), FrameSlot(), None, decoder="cpu")
    assert type(reader) is CameraReader and reader.mode == "cpu"
    assert reader.decoder == "cpu" and reader.decoder_reason is None
    pipeline = open_reader(SourceSpec("p", pipeline="videotestsrc ! appsink"), None, None, decoder="auto")
    assert pipeline.decoder == "pipeline" and pipeline.decoder_reason is None  # it decodes itself


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
    assert isinstance(reader.stage, NvdecStage) and reader.mode == "nvdec"
    reader.start()
    reader.join(20)
    assert not reader.is_alive()
    state, reason = states[-1]
    assert state == "failed"
    assert reason is not None and "decoder nvdec" in reason and nvdec_unavailable() in reason  # type: ignore[operator]
    assert reader.frames_in == 0 and reader.sessions_open == 0


@needs_no_nvdec
def test_nvdec_reader_in_auto_mode_switches_to_cpu_frames_without_a_reconnect() -> None:
    reader = CameraReader(_spec(), FrameSlot(), stage=NvdecStage(), mode="auto")
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
    sps_a, sps_b = find_sps(a, "h264"), find_sps(b, "h264")
    assert sps_a is not None and sps_b is not None and sps_a != sps_b
    assert sps_a[0] & 0x1F == 7
    assert find_sps(encode_pcm([small.copy()]), "avc1") == sps_a  # same parameters: same bytes
    slice_only = a[a.index(b"\x00\x00\x00\x01\x65") :]
    assert find_sps(slice_only, "h264") is None
    assert find_sps(b"", "h264") is None and find_sps(b"\x00\x00\x01", "hevc") is None


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


class fake_session:
    """Stands in for an NVDEC session (NvdecDecoder): hands out the picture of packet k after packet
    k + delay (as NVDEC's native latency holds up to 4 back); the "picture" is k itself. Records when each
    decode() call came, which packets were key frames, and restarts at a key frame like the real one."""

    def __init__(self, delay: int = 0, latency: str = "LOW") -> None:
        from pipelines.sources.stages import DecodeStats

        self.delay, self.latency = delay, latency
        self.calls: list[float] = []
        self.keys: list[bool] = []
        self.pending: list[int] = []
        self.stats = DecodeStats()
        self.resumed = 0
        self.closed = False
        self.swallow = False  # take packets, give no picture (a decoder that rejects everything)
        self._skip = False

    def decode(self, packet: object, keyframe: bool) -> list[int]:
        self.calls.append(time.time())
        self.keys.append(keyframe)
        self.stats.packets += 1
        if self.swallow or (self._skip and not keyframe):
            return []
        self._skip = False
        self.pending.append(len(self.calls) - 1)
        out = [self.pending.pop(0)] if len(self.pending) > self.delay else []
        self.stats.frames += len(out)
        return out

    def resume_at_key_frame(self) -> None:
        self.resumed += 1
        self._skip = True

    def flush(self) -> list[int]:
        return []

    def close(self) -> None:
        self.closed = True


class fake_nvdec_stage(NvdecStage):
    """The real NVDEC stage (session reuse, stamps, flush, teardown) with fake sessions: no GPU needed."""

    def __init__(self, delay: int = 0, latency: str = "low") -> None:
        super().__init__(latency=latency)
        self.delay = delay
        self.made: list[fake_session] = []

    def _host_unusable(self) -> str | None:
        return None

    def _new_session(self, codec: str, width: int, height: int, chroma: str, depth: int):  # type: ignore[no-untyped-def, override]
        assert (codec, chroma, depth) == ("h264", "420", 8)
        self.made.append(fake_session(self.delay, self.latency.upper()))
        return self.made[-1]


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.mark.parametrize(("delay", "latency"), [(0, "low"), (4, "native")])
def test_pictures_carry_the_capture_time_of_their_own_packet(delay: int, latency: str) -> None:
    """A picture that leaves the decoder packets later is stamped with its own packet's arrival (between the
    decode calls of packets k-1 and k), so frame age counts the decoder's hold-back."""
    spec = SourceSpec(camera="cam", url=str(CLIP), realtime=False, loop=False)
    slot = _Collecting()
    stage = fake_nvdec_stage(delay, latency)
    states: list[str] = []
    reader = CameraReader(spec, slot, lambda c, s, r: states.append(s), stage=stage, mode="nvdec")
    reader.start()
    reader.join(30)
    assert states == ["starting", "streaming", "ended"]
    dec = stage.made[0]
    assert len(slot.all) == 250 - delay
    for frame in slot.all:
        k = frame.image
        assert dec.calls[k] >= frame.ts_capture, k
        assert k == 0 or frame.ts_capture >= dec.calls[k - 1], k
    assert dec.closed and reader.sessions_open == 0  # the teardown ran (on its own thread)


@pytest.mark.parametrize("clip", ["mp4", "annexb"])
def test_nvdec_stage_file_loops_seamlessly_in_one_session(clip: str, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The defect of issue 23: an NVDEC file camera stopped after its first pass (a raw .h264 file cannot
    seek) and stayed "streaming". Now every pass goes into the same session, key frame first, no reconnect,
    no warning, `loops` counted."""
    import logging

    import cv2

    path = CLIP
    if clip == "annexb":
        path = tmp_path / "clip.h264"
        cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
        with path.open("wb") as f:
            while (got := cap.read())[0]:
                f.write(got[1].tobytes())
        cap.release()
    caplog.set_level(logging.INFO, logger="pipelines.sources")
    stage = fake_nvdec_stage()
    spec = SourceSpec(camera="loop", url=str(path), realtime=False, loop=True)
    reader = CameraReader(spec, _Collecting(), stage=stage, mode="nvdec")
    reader.start()
    try:
        assert _wait(lambda: reader.loops >= 3, 30), reader.stats()
    finally:
        assert reader.stop()
    dec = stage.made[0]
    assert len(stage.made) == 1 and reader.reconnects == 0 and reader.state == "streaming"
    assert reader.frames_in >= 750
    starts = [i for i in range(0, len(dec.keys), 250)]
    assert all(dec.keys[i] for i in starts)  # each pass begins with its key frame
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_nvdec_stage_reconnects_reuse_the_session_and_resume_at_a_key_frame(tmp_path: Path) -> None:
    """A camera whose server closes every 2 s: each reconnect keeps the NVDEC session (no create/destroy,
    caps query or memory check on the flapping camera's way back) and restarts decoding at a key frame."""
    from test_annexb_rtsp import serve

    path = _annexb(tmp_path)
    stage = fake_nvdec_stage()
    states: list[str] = []
    with serve(path, fps=50, close_after=1.0) as (url, _proc):
        spec = SourceSpec("flap", url=url, read_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.1)
        on_state = lambda c, s, r: states.append(s)  # noqa: E731
        reader = CameraReader(spec, _Collecting(), on_state, stage=stage, mode="nvdec")
        reader.start()
        try:
            assert _wait(lambda: reader.reconnects >= 3 and reader.state == "streaming", 30), reader.stats()
        finally:
            assert reader.stop(timeout=10)
    assert len(stage.made) == 1, "a reconnect to the same stream made a new session"
    dec = stage.made[0]
    assert dec.resumed >= 3 and dec.closed and reader.sessions_open == 0
    assert states[:2] == ["starting", "streaming"] and states.count("reconnecting") >= 3
    assert reader.stage.totals().sessions == 1


def test_nvdec_stage_native_latency_gets_a_session_per_connection(tmp_path: Path) -> None:
    from test_annexb_rtsp import serve

    path = _annexb(tmp_path)
    stage = fake_nvdec_stage(latency="native")
    with serve(path, fps=50, close_after=1.0) as (url, _proc):
        spec = SourceSpec("n", url=url, backoff_initial_s=0.05, backoff_max_s=0.1)
        reader = CameraReader(spec, FrameSlot(), stage=stage, mode="nvdec")
        reader.start()
        try:
            assert _wait(lambda: len(stage.made) >= 3, 30), reader.stats()
        finally:
            assert reader.stop(timeout=10)
    assert all(s.closed for s in stage.made) and reader.sessions_open == 0


def test_a_decoder_that_gives_no_pictures_is_a_stall() -> None:
    """Packets keep coming, no picture comes out (every packet rejected): the camera is not "streaming"."""
    stage = fake_nvdec_stage()
    spec = SourceSpec("s", url=str(CLIP), loop=True, read_timeout_s=0.5, backoff_initial_s=0.05)
    states: list[tuple[str, str | None]] = []
    reader = CameraReader(spec, FrameSlot(), lambda c, s, r: states.append((s, r)), stage=stage, mode="nvdec")
    reader.start()
    try:
        assert _wait(lambda: reader.frames_in >= 5, 20), reader.stats()
        stage.made[0].swallow = True
        assert _wait(lambda: reader.state == "reconnecting", 5), reader.stats()
        assert reader.last_error is not None and "no frame for 0.5 s" in reader.last_error
    finally:
        reader.stop()


def _annexb(tmp_path: Path) -> Path:
    import cv2

    path = tmp_path / "clip.h264"
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    with path.open("wb") as f:
        while (got := cap.read())[0]:
            f.write(got[1].tobytes())
    cap.release()
    return path


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
        NvdecStage(latency="fast")
