"""Time for a reader: the absolute schedule a file plays on, the fps limit of what is handed over, and the
wait before a reconnect.

Both keep a schedule (frame n is due at start + n x period) instead of sleeping a period after the work:
a sleep after the work makes every frame late by the work's own time, and the rate drifts below nominal
(measured before this module: NVDEC file readers at 25 fps delivered 20.6 fps, CPU readers 23.9).
"""

from __future__ import annotations

import random
import time

# A reader more than this late (a machine that froze, a debugger) starts a new schedule instead of bursting
# out every frame it owes: a camera that came back late does not send its backlog either.
RESYNC_S = 1.0
DEFAULT_FILE_FPS = 25.0  # a file that reports no rate, with no `fps` set, plays at FFmpeg's own default


def file_period(reported_fps: float | None, fps: float | None) -> float:
    """Seconds between a file's frames: its own rate, else the configured `fps`, else FFmpeg's default."""
    return 1.0 / (reported_fps or fps or DEFAULT_FILE_FPS)


def backoff_s(failures: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """The wait before reconnect attempt `failures` (1, 2, ...): capped exponential with full jitter
    (uniform in [0, cap]), so many cameras behind one dead switch do not reconnect in step."""
    cap = min(max_s, initial_s * 2.0 ** max(failures - 1, 0))
    return rng.uniform(0.0, cap)


class Schedule:
    """When the next frame of a file is due: start + n x period, n counting across loop points."""

    def __init__(self, period_s: float, now: float | None = None) -> None:
        self.period = period_s
        self._start = time.monotonic() if now is None else now
        self._n = 0
        self.resyncs = 0  # times the reader fell more than RESYNC_S behind and started again

    @property
    def due(self) -> float:
        return self._start + self._n * self.period

    def wait_s(self, now: float | None = None) -> float:
        """Seconds until the next frame is due (0: read now), and count that frame as taken."""
        now = time.monotonic() if now is None else now
        late = now - self.due
        if late > RESYNC_S:
            self._start, self._n = now, 0
            self.resyncs += 1
        delay = self.due - now
        self._n += 1
        return max(0.0, delay)

    def give_back(self) -> None:
        """The slot just taken gave no frame (a file's end, read before its rewind): the next read takes it,
        so a loop point costs no frame period."""
        self._n = max(0, self._n - 1)


class RateLimit:
    """Keeps at most `fps` frames per second, on a schedule (25 fps -> 10 fps gives 10, not 8.3).

    A frame may come up to a quarter period before its slot: arrivals jitter (a decode that took longer
    for the previous frame), and without the slack a 25 fps camera limited to 25 fps lost every frame that
    came a millisecond early (24.7 fps measured). A frame that comes late keeps the schedule: the next ones,
    on time again, fill their own slots (restarting the schedule at every late frame dropped the one after
    it: 64 NVDEC file readers at 25 fps limited to 25 kept 23.9-24.6 fps on the H100, their frames late by
    more than a period now and then, and 25.0 without the limit). Only a source more than RESYNC_S behind
    (a stall) starts a new schedule, so it does not burst its backlog. The long-run rate stays `fps`."""

    EARLY = 0.25  # of a period

    def __init__(self, fps: float | None) -> None:
        self.period = 1.0 / fps if fps else 0.0
        self._next: float | None = None

    def take(self, now: float) -> bool:
        """True when a frame arriving at `now` is to be kept."""
        if not self.period:
            return True
        if self._next is not None and now < self._next - self.EARLY * self.period:
            return False
        resync = self._next is None or now - self._next > RESYNC_S
        self._next = now + self.period if resync else self._next + self.period  # type: ignore[operator]
        return True
