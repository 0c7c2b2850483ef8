"""Events per second over a sliding window (camera fps in and out)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class RateCounter:
    """Events per second over a sliding window of ``window_s`` (1 s buckets, fixed memory).

    Sliding rather than reset-on-read so that several readers (telemetry, camera-state) agree.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < 1:
            raise ValueError(f"window_s: must be >= 1, got {window_s}")
        self.window = math.ceil(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._sec = [-1] * (self.window + 1)
        self._count = [0] * (self.window + 1)
        self._start = clock()
        self.total = 0

    def tick(self, n: int = 1) -> None:
        sec = int(self._clock())
        i = sec % len(self._sec)
        with self._lock:
            if self._sec[i] != sec:
                self._sec[i], self._count[i] = sec, 0
            self._count[i] += n
            self.total += n

    def rate(self) -> float:
        now = self._clock()
        sec = int(now)
        with self._lock:
            pairs = zip(self._sec, self._count, strict=True)
            events = sum(c for s, c in pairs if sec - self.window < s <= sec)
        # The window covers (sec - window, now]; shorter while the counter is young.
        span = min(now - (sec - self.window + 1), now - self._start)
        return events / span if span > 0 else 0.0

    def reset(self) -> None:
        with self._lock:
            self._sec = [-1] * len(self._sec)
            self._count = [0] * len(self._count)
            self._start = self._clock()
