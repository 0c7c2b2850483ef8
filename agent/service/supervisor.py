"""What the agent tells systemd: READY when it really serves, STATUS, and WATCHDOG only while frames move.

The daemon hands a `probe` that returns a `Progress` snapshot; this module only decides:

- READY=1 once every enabled camera has been tried (its reader left `starting`) and every model with a
  streaming camera has delivered a result through all sinks (so inference ran end to end).
- WATCHDOG=1 at a quarter of WatchdogSec while no model is stalled. A model is stalled when its worker
  thread died, or when its cameras put frames in and no result came out for half of WatchdogSec: a hung
  backend, scheduler or sink (publisher) stops the pings and systemd restarts the service. Cameras that
  deliver nothing do not stall anything: that is a camera problem, reported on MQTT, not a reason to
  restart the process.
- STATUS= one line, e.g. "4/4 cameras streaming, 57 fps, detector tensorrt fp16".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.service.notify import Notifier

log = logging.getLogger("agent.supervisor")  # its lines keep the name they had (journald, greps)

DEFAULT_STALL_S = 30.0  # without a systemd watchdog: when a stall is reported in STATUS and the log


@dataclass(frozen=True)
class ModelProgress:
    frames_in: int  # frames its cameras put into their slots, all time
    results: int  # results that went through every sink, all time
    running: bool  # its worker thread is alive
    serving: str  # e.g. "tensorrt fp16"
    streaming_cameras: int
    note: str = ""  # engine news for STATUS, e.g. "building 40%"


@dataclass(frozen=True)
class Progress:
    cameras: Mapping[str, str]  # enabled camera -> reader state
    models: Mapping[str, ModelProgress]
    fps: float


def is_ready(p: Progress) -> bool:
    tried = all(state != "starting" for state in p.cameras.values())
    served = all(m.results > 0 for m in p.models.values() if m.streaming_cameras)
    return tried and served


def status_line(p: Progress, stalled: list[str], extra: str = "") -> str:
    up = sum(1 for s in p.cameras.values() if s == "streaming")
    parts = [f"{up}/{len(p.cameras)} cameras streaming", f"{p.fps:.0f} fps"]
    for name, m in p.models.items():
        parts.append(f"{name} {m.serving}" + (f" ({m.note})" if m.note else ""))
    if stalled:
        parts.append(f"STALLED: {', '.join(stalled)} (no result while frames arrive)")
    if extra:
        parts.append(extra)
    return ", ".join(parts)


@dataclass
class _Track:
    frames_in: int
    results: int
    waiting_since: float | None = None  # first check that saw new frames and no new result


@dataclass
class StallDetector:
    """Per model: frames came in, no result since `stall_s` (monotonic time passed in, for tests)."""

    stall_s: float
    _tracks: dict[str, _Track] = field(default_factory=dict)

    def update(self, p: Progress, now: float) -> list[str]:
        stalled = []
        for name, m in p.models.items():
            t = self._tracks.get(name)
            if t is None or m.results < t.results or m.frames_in < t.frames_in:  # new or replaced model
                t = self._tracks[name] = _Track(m.frames_in, m.results)
            if m.results != t.results:
                t.waiting_since = None
            elif m.frames_in != t.frames_in and t.waiting_since is None:
                t.waiting_since = now
            t.frames_in, t.results = m.frames_in, m.results
            if not m.running or (t.waiting_since is not None and now - t.waiting_since > self.stall_s):
                stalled.append(name)
        for gone in set(self._tracks) - set(p.models):
            del self._tracks[gone]
        return stalled


class Supervisor:
    """A thread that sends READY, STATUS and WATCHDOG from the agent's progress."""

    def __init__(
        self, notifier: Notifier, probe: Callable[[], Progress], status_every_s: float = 5.0
    ) -> None:
        self.notifier = notifier
        self._probe = probe
        wd = notifier.watchdog_s
        self.watchdog_s = wd
        self.tick_s = min(max(wd / 4, 0.05), status_every_s) if wd else 1.0
        self._detector = StallDetector(wd / 2 if wd else DEFAULT_STALL_S)
        self._status_every = status_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.ready = False
        self.pings = 0
        self.stalled: list[str] = []
        self._extra = ""  # e.g. the last reload error, kept in STATUS until the next good reload
        self._last_status = ""
        self._last_status_at = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def set_extra(self, text: str) -> None:
        with self._lock:
            self._extra = text
            self._last_status = ""  # send at the next tick

    def reloading(self) -> None:
        self.notifier.reloading()

    def reloaded(self) -> None:
        """After a reload (applied or refused): READY=1 again, with the current status."""
        with self._lock:
            self.notifier.ready(self._status(self._probe()))

    def stopping(self) -> None:
        self._stop.set()
        self.notifier.stopping()

    def _status(self, p: Progress) -> str:
        return status_line(p, self.stalled, self._extra)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug here must not end the pings silently: log it, try next tick
                log.exception("supervisor tick failed")

    def tick(self, now: float) -> None:
        p = self._probe()
        with self._lock:
            stalled = self._detector.update(p, now)
            changed = stalled != self.stalled
            if changed:
                if stalled:
                    log.error(
                        "model(s) %s: frames arrive but no result for %.1f s%s",
                        ", ".join(stalled),
                        self._detector.stall_s,
                        "; withholding watchdog pings" if self.watchdog_s else "",
                    )
                else:
                    log.warning("results flow again for every model")
                self.stalled = stalled
            status = self._status(p)
            if not self.ready:
                if is_ready(p):
                    self.ready = True
                    log.info("ready: %s", status)
                    self.notifier.ready(status)
                    self._last_status, self._last_status_at = status, now
                return  # no pings before READY: systemd arms the watchdog only once the unit is up
            if self.watchdog_s and not stalled:
                self.notifier.watchdog()
                self.pings += 1
            due = now - self._last_status_at >= self._status_every
            if self._last_status == "" or changed or (status != self._last_status and due):
                self.notifier.status(status)
                self._last_status, self._last_status_at = status, now
