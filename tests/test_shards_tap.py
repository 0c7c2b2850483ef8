"""Frames for a build across the shard pipe: the supervisor's tap (agent.shards.engines.RemoteTap through
ShardHost.stream) over a real multiprocessing pipe to the shard's serve loop and its real FrameTap, fed
with results as the model's worker would feed it."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

import numpy as np

from agent.config import RestartConfig
from agent.lifecycle.calibration import FrameTap
from agent.shards.child import _serve
from agent.shards.engines import RemoteTap
from agent.shards.host import ShardHost
from agent.shards.link import ShardLink
from pipelines.frames import Detections, Frame
from pipelines.scheduler import Result


class FakeEvents:  # the supervisor's side: messages other than answers and frames are not under test
    def shard_started(self, k: int, pid: int) -> None: ...
    def shard_failed(self, k: int, error: str) -> None: ...
    def shard_exited(self, k: int, why: str, restart_in: float | None) -> None: ...
    def shard_message(self, k: int, msg: tuple) -> None: ...


def _linked(taps: dict[str, FrameTap]) -> tuple[ShardHost, threading.Event, list[threading.Thread]]:
    parent, child = mp.Pipe()
    host = ShardHost(0, None, None, "info", FakeEvents(), RestartConfig())  # type: ignore[arg-type]
    host._conn, host.state = parent, "running"
    stop = threading.Event()
    fake_agent = SimpleNamespace(taps=taps)
    threads = [
        threading.Thread(target=host._read, args=(parent,), daemon=True),
        threading.Thread(target=_serve, args=(fake_agent, ShardLink(0, child), child, stop), daemon=True),
    ]
    for t in threads:
        t.start()
    return host, stop, threads


def _feed(tap: FrameTap, stop: threading.Event) -> None:
    """Results of two cameras at 50 fps each, as a worker delivers them."""
    n = 0
    while not stop.is_set():
        for cam in ("a", "b"):
            image = np.full((8, 8, 3), n % 255, np.uint8)
            frame = Frame(cam, n, image, time.time())
            tap(Result(frame, Detections.empty(), "det", "onnxruntime", "fp32", 1))
        n += 1
        time.sleep(0.02)


def test_remote_tap_streams_the_shard_pipelines_frames() -> None:
    tap = FrameTap()
    host, stop, _ = _linked({"det": tap})
    feeder = threading.Thread(target=_feed, args=(tap, stop), daemon=True)
    feeder.start()
    try:
        got = list(RemoteTap(host, "det", 1.0).frames(6, 0.05, 10.0))
        assert len(got) == 6
        assert {origin.split("#")[0] for _, origin in got} == {"camera:a", "camera:b"}
        assert all(image.shape == (8, 8, 3) and image.dtype == np.uint8 for image, _ in got)
        assert not host._streams  # the request is closed
        # A second capture after the first ended works (the shard's tap is free again).
        assert len(list(RemoteTap(host, "det", 1.0).frames(2, 0.05, 10.0))) == 2
    finally:
        stop.set()


def test_remote_tap_of_a_model_the_shard_does_not_run_ends_empty() -> None:
    host, stop, _ = _linked({})
    try:
        t0 = time.monotonic()
        assert list(RemoteTap(host, "other", 1.0).frames(3, 0.05, 10.0)) == []
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()


def test_remote_tap_ends_when_the_shard_goes() -> None:
    tap = FrameTap()  # never fed: the capture would wait for its timeout
    host, stop, _ = _linked({"det": tap})
    frames = RemoteTap(host, "det", 1.0).frames(3, 0.05, 30.0)
    ended: list[int] = []

    def consume() -> None:
        ended.append(len(list(frames)))

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    time.sleep(0.3)
    host.state = "restarting"  # the process died: its host says so and fails what waits on it
    host._fail_pending("shard stopped")
    t.join(5)
    stop.set()
    assert ended == [0]


def test_a_shard_that_dies_before_a_word_ends_the_start_wait(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A shard process that exits before saying started or failed (an import error, a crash at init) must
    not leave the supervisor's start-up waiting: its first outcome is set, with the reason."""
    import sys

    from agent.shards import host as host_mod

    real_popen = host_mod.subprocess.Popen

    def fake_popen(argv, **kw):  # type: ignore[no-untyped-def]
        return real_popen([sys.executable, "-c", "import sys; sys.exit(7)"], **kw)

    monkeypatch.setattr(host_mod.subprocess, "Popen", fake_popen)
    host = ShardHost(0, None, None, "info", FakeEvents(), RestartConfig(min_s=0.2, max_s=0.2))  # type: ignore[arg-type]
    host.start()
    try:
        assert host.first_outcome.wait(10)
        assert host.state != "running"
        assert host.failure == "exited before it started (exited with status 7)"
    finally:
        host.stop(timeout=5)
