"""Camera sources on real components: the bundled clip through OpenCV/FFmpeg, and a real RTSP server
(tools/rtsp_server.py, GStreamer) that the fault tests kill, restart and freeze."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fixtures_rtsp import CLIP, RtspServer, free_port

from pipelines.frames import Frame
from pipelines.sources import CameraReader, FrameSlot, SourceSpec
from pipelines.sources.stages import PictureStage
from pipelines.urls import mask_url

# Printed with -s, for the record; tests assert loose bounds only.
MEASURED: dict[str, float] = {}


def wait_for(pred: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class StateLog:
    """Collects on_state calls (from reader threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[float, str, str, str | None]] = []

    def __call__(self, camera: str, state: str, reason: str | None) -> None:
        with self._lock:
            self.events.append((time.monotonic(), camera, state, reason))

    def states(self, camera: str | None = None) -> list[str]:
        with self._lock:
            return [s for _, c, s, _ in self.events if camera is None or c == camera]

    def first(self, state: str, after: float = 0.0, camera: str | None = None) -> float | None:
        with self._lock:
            for t, c, s, _ in self.events:
                if s == state and t >= after and (camera is None or c == camera):
                    return t
        return None


@pytest.fixture
def readers() -> Iterator[Callable[..., CameraReader]]:
    """Start readers; every one is stopped at teardown."""
    started: list[CameraReader] = []

    def start(spec: SourceSpec, on_state: StateLog | None = None) -> CameraReader:
        reader = CameraReader(spec, on_state=on_state)
        started.append(reader)
        reader.start()
        return reader

    try:
        yield start
    finally:
        for reader in started:
            reader.request_stop()
        for reader in started:
            reader.stop(timeout=10)


def make_frame(i: int) -> Frame:
    return Frame("cam", i, np.zeros((2, 2, 3), np.uint8), time.time())


# --- mask_url ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("rtsp://admin:s3cret@10.0.0.21:554/stream1", "rtsp://admin:***@10.0.0.21:554/stream1"),
        ("rtsps://u:p%40ss@cam/x", "rtsps://u:***@cam/x"),
        ("rtsp://admin:p@ss@cam.local/live", "rtsp://admin:***@cam.local/live"),  # unencoded "@"
        ("rtsp://viewer@10.0.0.5/s", "rtsp://viewer@10.0.0.5/s"),  # no password: nothing to hide
        ("rtsp://10.0.0.5:554/s", "rtsp://10.0.0.5:554/s"),
        (
            "http://cam/video.mjpg?user=a&password=hunter2&x=1",
            "http://cam/video.mjpg?user=a&password=***&x=1",
        ),
        ("/var/clips/a.mp4", "/var/clips/a.mp4"),
        (
            'rtspsrc location="rtsp://a:b1c2@h/x" latency=0 ! appsink',
            'rtspsrc location="rtsp://a:***@h/x" latency=0 ! appsink',
        ),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_spec_validation_and_repr_hide_password() -> None:
    spec = SourceSpec("gate", url="rtsp://viewer:hunter2@10.0.0.21/s")
    assert "hunter2" not in repr(spec)
    assert "viewer:***@" in spec.display
    with pytest.raises(ValueError, match="exactly one of url and pipeline"):
        SourceSpec("x")
    with pytest.raises(ValueError, match="exactly one of url and pipeline"):
        SourceSpec("x", url="a.mp4", pipeline="videotestsrc ! appsink")
    with pytest.raises(ValueError, match="fps must be > 0"):
        SourceSpec("x", url="a.mp4", fps=0)
    with pytest.raises(ValueError, match="max_failures"):
        SourceSpec("x", url="a.mp4", max_failures=0)


# --- FrameSlot ---------------------------------------------------------------------------------------------
def test_frame_slot_latest_wins_and_counts_drops() -> None:
    slot = FrameSlot()
    assert slot.get(timeout=0.01) is None
    assert slot.peek_age() is None
    for i in range(3):
        slot.put(make_frame(i))
    assert len(slot) == 1
    age = slot.peek_age()
    assert age is not None and age >= 0
    got = slot.get(timeout=0)
    assert got is not None and got.frame_id == 2
    assert slot.dropped == 2
    assert slot.get(timeout=0.01) is None  # taken: the slot is empty again, nothing older is left behind
    slot.put(make_frame(3))
    assert slot.get(timeout=0) is not None and slot.dropped == 2  # a read frame is not a drop


def test_frame_slot_wakes_a_waiting_consumer() -> None:
    slot = FrameSlot()
    got: list[Frame | None] = []
    consumer = threading.Thread(target=lambda: got.append(slot.get(timeout=5)))
    consumer.start()
    time.sleep(0.05)
    slot.put(make_frame(7))
    consumer.join(5)
    assert got and got[0] is not None and got[0].frame_id == 7


# --- file sources ------------------------------------------------------------------------------------------
def test_file_source_frames(readers: Callable[..., CameraReader]) -> None:
    states = StateLog()
    reader = readers(SourceSpec("clip", url=str(CLIP), realtime=False, loop=True), states)
    frames: list[Frame] = []
    deadline = time.monotonic() + 10
    while len(frames) < 10 and time.monotonic() < deadline:
        frame = reader.slot.get(timeout=1)
        if frame is not None:
            frames.append(frame)
    assert len(frames) == 10
    ids = [f.frame_id for f in frames]
    assert ids == sorted(set(ids))  # strictly increasing
    for f in frames:
        assert f.camera == "clip"
        assert f.image.shape == (272, 640, 3) and f.image.dtype == np.uint8
        assert abs(f.ts_capture - time.time()) < 10
        assert "captured" in f.stamps and f.stamps["captured"] <= time.monotonic()
    assert states.states("clip")[:2] == ["starting", "streaming"]
    # Frames own their pixels: the reader must not reuse a buffer it already handed out.
    assert len({id(f.image) for f in frames}) == len(frames)
    assert not np.shares_memory(frames[0].image, frames[-1].image)


@pytest.mark.parametrize("kind", ["mp4", "annexb"])
def test_looping_file_keeps_going(
    readers: Callable[..., CameraReader], kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A looping file is a healthy camera: no reconnect, no warning, one state change, `loops` counted. A
    raw H.264 file cannot seek (FFmpeg says yes, then reads nothing): it loops all the same."""
    caplog.set_level(logging.INFO, logger="pipelines.sources")
    url = f"file://{CLIP}" if kind == "mp4" else str(annexb_copy(tmp_path))
    states = StateLog()
    reader = readers(SourceSpec("loop", url=url, realtime=False, loop=True), states)
    assert wait_for(lambda: reader.frames_in > 600, timeout=20), reader.stats()
    assert reader.reconnects == 0 and reader.loops >= 2 and reader.last_error is None
    assert states.states("loop") == ["starting", "streaming"]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_file_without_loop_ends(readers: Callable[..., CameraReader]) -> None:
    states = StateLog()
    reader = readers(SourceSpec("once", url=str(CLIP), realtime=False), states)
    assert wait_for(lambda: not reader.is_alive(), timeout=20), reader.stats()
    assert states.states("once") == ["starting", "streaming", "ended"]
    assert reader.state == "ended" and reader.reason is not None and "end of file" in reader.reason
    assert reader.frames_in == 250 and reader.reconnects == 0 and reader.last_error is None


def annexb_copy(tmp_path: Path) -> Path:
    """The bundled clip as a raw Annex-B H.264 file (what tools/make_clip.py writes for benchmarks)."""
    import cv2

    path = tmp_path / "clip.h264"
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    with path.open("wb") as f:
        while (got := cap.read())[0]:
            f.write(got[1].tobytes())
    cap.release()
    return path


def test_schedule_keeps_the_rate_whatever_the_work_takes() -> None:
    """Frame n is due at start + n x period: work before each frame does not push later frames back (the
    drift of issue 23: a sleep of one period after the work gives period + work per frame)."""
    from pipelines.sources.pacing import RESYNC_S, Schedule

    period, work = 0.04, 0.013
    sched = Schedule(period, now=100.0)
    now, reads = 100.0, []
    for _ in range(1000):
        now += sched.wait_s(now)  # sleep until due
        reads.append(now)
        now += work  # read + decode + hand over
    assert reads[-1] == pytest.approx(100.0 + 999 * period)  # 25.0 fps over 40 s, exactly
    late = Schedule(period, now=0.0)
    assert [late.wait_s(t) for t in (0.0, 0.05, 0.06)] == [0.0, 0.0, pytest.approx(0.02)]  # catches up
    assert late.wait_s(0.08 + RESYNC_S + 0.5) == 0.0 and late.resyncs == 1  # a long freeze: new schedule
    assert late.wait_s(0.08 + RESYNC_S + 0.5) == pytest.approx(period)


def test_rate_limit_keeps_its_rate_and_tolerates_jitter() -> None:
    """A 25 fps source limited to 10 fps gives 10; limited to its own rate it loses nothing to jitter."""
    import random

    from pipelines.sources.pacing import RateLimit

    rng = random.Random(1)
    arrivals = [k / 25 + rng.uniform(0.0, 0.008) for k in range(2500)]  # 100 s of a jittery 25 fps camera
    for fps, want in ((25, 2500), (10, 1000), (12.5, 1250), (30, 2500)):
        limit = RateLimit(fps)
        assert abs(sum(limit.take(t) for t in arrivals) - want) <= 1, fps


def test_rate_limit_keeps_frames_that_come_late_now_and_then() -> None:
    """A source on an absolute schedule whose frames are sometimes late by more than a period (a reader
    among 64 waiting for the GIL) loses none to a limit at its own rate; after a stall longer than
    RESYNC_S the limit starts again instead of keeping the backlog in a burst."""
    import random

    from pipelines.sources.pacing import RESYNC_S, RateLimit

    rng = random.Random(2)
    arrivals, late = [], 0.0
    for k in range(2500):
        due = k / 25
        if rng.random() < 0.05:
            late = rng.uniform(0.041, 0.2)  # late by more than a period ...
        arrivals.append(max(due, arrivals[-1] if arrivals else 0.0) + late)
        late = max(0.0, late - 0.04)  # ... then caught up within a few frames (the source's own schedule)
    limit = RateLimit(25)
    assert sum(limit.take(t) for t in arrivals) == 2500
    stalled = RateLimit(25)
    kept = sum(stalled.take(t) for t in [k / 25 for k in range(10)])
    backlog = [0.4 + RESYNC_S + 0.5 + k * 0.0005 for k in range(40)]  # 40 frames in 20 ms after a stall
    assert kept == 10 and sum(stalled.take(t) for t in backlog) == 1


def test_realtime_file_is_paced_and_fps_limited(readers: Callable[..., CameraReader]) -> None:
    paced = readers(SourceSpec("paced", url=str(CLIP), loop=True))  # native 25 fps
    limited = readers(SourceSpec("limited", url=str(CLIP), loop=True, fps=10))
    assert wait_for(lambda: paced.frames_in > 0 and limited.frames_in > 0, timeout=10)
    p0, l0, r0, t0 = paced.frames_in, limited.frames_in, limited.frames_read, time.monotonic()
    time.sleep(2.0)
    dt = time.monotonic() - t0
    paced_fps = (paced.frames_in - p0) / dt
    limited_fps = (limited.frames_in - l0) / dt
    read_fps = (limited.frames_read - r0) / dt
    MEASURED.update(paced_fps=paced_fps, limited_fps=limited_fps)
    assert 18 <= paced_fps <= 30, paced_fps  # a file behaves like a 25 fps camera, not a decode-speed burst
    assert 7 <= limited_fps <= 12, limited_fps
    assert 18 <= read_fps <= 30, read_fps  # the limit drops frames, it does not slow the source


# --- RTSP -----------------------------------------------------------------------------------------------
def rtsp_spec(camera: str, url: str, **kw: object) -> SourceSpec:
    # Short timeouts and backoff keep the fault tests fast; the defaults are for real cameras.
    opts: dict = {"open_timeout_s": 3.0, "read_timeout_s": 1.0}
    opts |= {"backoff_initial_s": 0.2, "backoff_max_s": 1.0}
    return SourceSpec(camera, url=url, **{**opts, **kw})


def test_rtsp_streams(rtsp_server: RtspServer, readers: Callable[..., CameraReader]) -> None:
    states = StateLog()
    a = readers(rtsp_spec("a", rtsp_server.url("/cam")), states)
    b = readers(rtsp_spec("b", rtsp_server.url("/cam2")), states)
    assert wait_for(lambda: a.frames_in >= 10 and b.frames_in >= 10, timeout=15), (a.stats(), b.stats())
    frame = a.slot.get(timeout=2)
    assert frame is not None and frame.image.shape == (272, 640, 3)
    assert states.states("a")[:2] == ["starting", "streaming"]
    assert a.reconnects == 0 and b.reconnects == 0
    assert a.last_open_s is not None
    MEASURED["rtsp_open_s"] = a.last_open_s
    MEASURED["server_ready_s"] = rtsp_server.ready_s or 0.0
    assert rtsp_server.stop() == 0  # SIGTERM: a clean exit
    assert wait_for(lambda: a.state == "reconnecting", timeout=5)


def test_rtsp_server_killed_then_restarted(
    rtsp_server: RtspServer, readers: Callable[..., CameraReader]
) -> None:
    states = StateLog()
    cam = readers(rtsp_spec("cam", rtsp_server.url()), states)
    other = readers(SourceSpec("other", url=str(CLIP), loop=True), states)  # a healthy camera beside it
    assert wait_for(lambda: cam.frames_in >= 5 and other.frames_in >= 5, timeout=15), cam.stats()

    killed_at = time.monotonic()
    rtsp_server.kill()
    assert wait_for(lambda: cam.state == "reconnecting", timeout=5), cam.stats()
    MEASURED["detect_kill_s"] = (states.first("reconnecting", killed_at, "cam") or 0) - killed_at
    last_id_before = cam.frames_in

    # While the camera is down the other one keeps delivering, at its own pace.
    o1 = other.frames_in
    time.sleep(1.0)
    assert other.frames_in - o1 >= 5, other.stats()  # 25 fps; a shared lock would give ~0
    assert cam.state == "reconnecting"

    rtsp_server.restart()
    restarted_at = time.monotonic()
    assert wait_for(lambda: cam.state == "streaming", timeout=15), cam.stats()
    MEASURED["resume_after_restart_s"] = (states.first("streaming", restarted_at, "cam") or 0) - restarted_at
    assert wait_for(lambda: cam.frames_in > last_id_before + 5, timeout=5)
    assert cam.reconnects >= 1
    assert states.states("cam") == ["starting", "streaming", "reconnecting", "streaming"] or (
        # a reopen attempt can time out differently from a refused one: then the reason changed, not the state
        set(states.states("cam")) == {"starting", "streaming", "reconnecting"}
    )
    assert states.states("other") == ["starting", "streaming"]
    frame = cam.slot.get(timeout=2)
    assert frame is not None and frame.frame_id >= last_id_before  # ids keep counting across reconnects


def test_rtsp_server_frozen(rtsp_server: RtspServer, readers: Callable[..., CameraReader]) -> None:
    states = StateLog()
    cam = readers(rtsp_spec("cam", rtsp_server.url(), read_timeout_s=1.0, open_timeout_s=1.0), states)
    other = readers(SourceSpec("other", url=str(CLIP), loop=True), states)
    assert wait_for(lambda: cam.frames_in >= 5 and other.frames_in >= 5, timeout=15), cam.stats()

    paused_at = time.monotonic()
    rtsp_server.pause()
    # A frozen camera keeps its TCP connection open; only the read timeout can notice it. Bound: 2 x the
    # read timeout. Measured 1.0 s; a reader that trusts the frames FFmpeg drains from its decoder after
    # each timed-out read takes 3.0 s (3 timeouts), which the brief's 3 x bound would not catch.
    assert wait_for(lambda: cam.state != "streaming", timeout=2.0 * cam.spec.read_timeout_s), cam.stats()
    MEASURED["detect_freeze_s"] = time.monotonic() - paused_at
    assert cam.state == "reconnecting"
    assert cam.last_error is not None and "no frame for 1 s" in cam.last_error

    o1 = other.frames_in
    time.sleep(0.8)
    assert other.frames_in - o1 >= 5, other.stats()  # the hung reader stalls nobody else

    # stop() while the reader is blocked opening the frozen server: returns within about the timeout.
    t0 = time.monotonic()
    assert cam.stop(timeout=5)
    MEASURED["stop_while_frozen_s"] = time.monotonic() - t0
    assert MEASURED["stop_while_frozen_s"] < 2.5

    # And a thawed camera streams again (a fresh reader: the old one is stopped).
    rtsp_server.resume()
    again = readers(rtsp_spec("again", rtsp_server.url()), states)
    assert wait_for(lambda: again.frames_in >= 3, timeout=10), again.stats()


# --- stalls, isolation -----------------------------------------------------------------------------------
class fake_hanging_stage(PictureStage):
    """OpenCV decodes; once `hang` is set, decode() does not return until `release`: a call that never
    returns (a V4L2 or GStreamer read has no timeout in OpenCV; a decoder can hang)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.hang, self.release = threading.Event(), threading.Event()

    def decode(self, unit):  # type: ignore[no-untyped-def]
        if self.hang.is_set():
            self.release.wait(30)
        return super().decode(unit)


def test_a_camera_stuck_in_a_call_is_reported_by_the_stall_watch(
    readers: Callable[..., CameraReader],
) -> None:
    states = StateLog()
    stage = fake_hanging_stage()
    spec = SourceSpec("stuck", url=str(CLIP), loop=True, read_timeout_s=0.5, backoff_initial_s=0.05)
    stuck = CameraReader(spec, on_state=states, stage=stage)
    other = readers(SourceSpec("other", url=str(CLIP), loop=True), states)
    stuck.start()
    try:
        assert wait_for(lambda: stuck.frames_in >= 5 and other.frames_in >= 5, timeout=15), stuck.stats()
        stage.hang.set()
        hung_at = time.monotonic()
        assert wait_for(lambda: stuck.state == "reconnecting", timeout=5), stuck.stats()
        MEASURED["stall_watch_s"] = time.monotonic() - hung_at
        assert stuck.last_error is not None and "no frame for 0.5 s" in stuck.last_error
        o1 = other.frames_in
        time.sleep(0.6)
        assert other.frames_in - o1 >= 5, other.stats()  # its neighbour goes on at 25 fps
        stage.hang.clear()
        stage.release.set()  # the call returns: the connection is dropped, the camera reconnects
        back = wait_for(lambda: stuck.state == "streaming" and stuck.reconnects >= 1, timeout=10)
        assert back, stuck.stats()
    finally:
        stage.release.set()
        stuck.stop()
    assert states.states("stuck")[:4] == ["starting", "streaming", "reconnecting", "streaming"]
    assert states.states("other") == ["starting", "streaming"]


def test_a_hung_open_does_not_hold_up_other_cameras(tmp_path: Path) -> None:
    """OpenCV serialised every FFmpeg open behind one process-wide lock (8 RTSP cameras became ready
    0.65 s apart). A camera that accepts the connection and never answers now keeps only itself waiting."""
    from test_annexb_rtsp import serve

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        hung = CameraReader(rtsp_spec("hung", f"rtsp://127.0.0.1:{port}/x", open_timeout_s=8.0))
        hung.start()
        hung_at = time.monotonic()
        try:
            time.sleep(0.3)  # its open is under way
            with serve(annexb_copy(tmp_path), fps=25) as (url, _proc):
                ok = CameraReader(rtsp_spec("ok", url))
                ok.start()
                t0 = time.monotonic()
                try:
                    assert wait_for(lambda: ok.state == "streaming", timeout=10), ok.stats()
                    MEASURED["open_beside_hung_open_s"] = time.monotonic() - t0
                    # Before the hung open could have timed out (behind OpenCV's lock: after it).
                    assert time.monotonic() - hung_at < 8.0 - 1.0
                    assert hung.state == "starting", hung.stats()  # still inside its own open
                finally:
                    ok.stop()
        finally:
            hung.stop()


def test_a_server_that_closes_every_2_s(tmp_path: Path, readers: Callable[..., CameraReader]) -> None:
    """The camera reconnects each time and streams again; a camera beside it never notices."""
    from test_annexb_rtsp import serve

    states = StateLog()
    steady = readers(SourceSpec("steady", url=str(CLIP), loop=True), states)
    with serve(annexb_copy(tmp_path), fps=25, close_after=2.0) as (url, _proc):
        flap = readers(rtsp_spec("flap", url), states)
        assert wait_for(lambda: flap.reconnects >= 3 and flap.state == "streaming", timeout=30), flap.stats()
    assert states.states("flap")[:4] == ["starting", "streaming", "reconnecting", "streaming"]
    assert flap.last_error is not None and "stream ended" in flap.last_error
    assert states.states("steady") == ["starting", "streaming"] and steady.reconnects == 0
    got = steady.slot.get(timeout=2)
    assert got is not None and got.frame_id > 100  # 25 fps all along


# --- failures and secrets ------------------------------------------------------------------------------
def test_password_never_leaks(readers: Callable[..., CameraReader], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pipelines.sources")
    states = StateLog()
    url = f"rtsp://user:s3cret@127.0.0.1:{free_port()}/x"  # nothing listens there
    spec = rtsp_spec("secret", url, backoff_initial_s=0.01, backoff_max_s=0.02, max_failures=2)
    reader = readers(spec, states)
    assert wait_for(lambda: reader.state == "failed", timeout=10), reader.stats()
    reader.join(5)
    assert not reader.is_alive()  # failed is final: the thread ends
    texts = [reader.last_error or "", reader.reason or "", repr(spec), reader.display, str(reader.stats())]
    texts += [str(r) for e in states.events for r in e]
    texts += [r.getMessage() for r in caplog.records]
    assert any("user:***@127.0.0.1" in t for t in texts)  # the masked URL is there, so the check is real
    leaked = [t for t in texts if "s3cret" in t]
    assert not leaked
    assert any(r.levelno == logging.WARNING for r in caplog.records if r.name == "pipelines.sources")


def test_missing_file_fails_after_max_failures(readers: Callable[..., CameraReader], tmp_path: Path) -> None:
    states = StateLog()
    missing = tmp_path / "nowhere" / "clip.mp4"
    spec = SourceSpec("gone", url=str(missing), max_failures=3, backoff_initial_s=0.01, backoff_max_s=0.02)
    reader = readers(spec, states)
    assert wait_for(lambda: not reader.is_alive(), timeout=5), reader.stats()  # failed is final: it ends
    assert reader.state == "failed"
    assert states.states("gone") == ["starting", "reconnecting", "failed"]
    assert reader.reason is not None and str(missing) in reader.reason and "3 attempts" in reader.reason
    assert reader.reconnects == 2  # three attempts: the first open and two retries
    assert reader.frames_in == 0


def test_missing_file_retries_forever_by_default(
    readers: Callable[..., CameraReader], tmp_path: Path
) -> None:
    states = StateLog()
    spec = SourceSpec("gone", url=str(tmp_path / "x.mp4"), backoff_initial_s=0.01, backoff_max_s=0.02)
    reader = readers(spec, states)
    assert wait_for(lambda: reader.reconnects >= 5, timeout=5), reader.stats()
    assert reader.state == "reconnecting" and reader.is_alive()
    assert states.states("gone") == ["starting", "reconnecting"]  # reported once, not per attempt


@pytest.mark.parametrize(
    ("kind", "source", "shown"),
    [
        ("pipeline", 'rtspsrc location="rtsp://a:zz9pw@127.0.0.1:1/x" ! nosuchelement ! appsink', "a:***@"),
        ("url", "/dev/video99", "/dev/video99"),
        ("url", "http://u:zz9pw@127.0.0.1:1/x.mjpg", "u:***@"),
    ],
)
def test_other_backends_fail_cleanly(
    readers: Callable[..., CameraReader], kind: str, source: str, shown: str
) -> None:
    # No GStreamer in the PyPI wheel and no camera here: the reader must say so, not crash or spin.
    states = StateLog()
    reader = readers(SourceSpec("k", max_failures=1, open_timeout_s=1.0, **{kind: source}), states)
    assert wait_for(lambda: not reader.is_alive(), timeout=5), reader.stats()
    assert states.states("k") == ["starting", "failed"]
    assert reader.reason is not None and shown in reader.reason and "(1 attempt)" in reader.reason
    assert "zz9pw" not in str(reader.stats())


def test_zz_print_measurements() -> None:
    # Runs last in this module (pytest keeps file order): shows the numbers with -s.
    print("\nMEASURED " + ", ".join(f"{k}={v:.3f}" for k, v in MEASURED.items()))
