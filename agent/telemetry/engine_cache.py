"""The shared engine cache's counters of this process (agent.lifecycle.shared_cache counts; the telemetry
payload's `engine_cache` section reads them, agent.telemetry.fields declares it).

    ENGINE_CACHE.count(hits=1, pulled_bytes=n, pull_s=1.2)
    ENGINE_CACHE.snapshot()     # {"hits": 1, "misses": 0, ...}: totals since the process started

One set per process, as the process's CPU and memory are: every build of the process (the engine
lifecycle's jobs, a deployment's candidate) goes through the one cache.
"""

from __future__ import annotations

import threading
from typing import Any

# The keys of the payload's `engine_cache` section (agent.telemetry.fields declares each one).
COUNTERS = (
    "hits",
    "misses",
    "rejected",
    "unavailable",
    "pushes",
    "pulled_bytes",
    "pushed_bytes",
    "pull_s",
    "push_s",
    "builds",
    "build_s",
)


class CacheCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def count(self, **increments: float) -> None:
        unknown = set(increments) - set(COUNTERS)
        if unknown:
            raise TypeError(f"engine cache counters have no {sorted(unknown)}")
        with self._lock:
            for name, value in increments.items():
                self._totals[name] += value

    def snapshot(self) -> dict[str, Any]:
        """The totals; seconds rounded to milliseconds."""
        with self._lock:
            totals = dict(self._totals)
        return {k: round(v, 3) if k.endswith("_s") else int(v) for k, v in totals.items()}

    def reset(self) -> None:
        """Back to zero (tests)."""
        with self._lock:
            self._totals = dict.fromkeys(COUNTERS, 0)


ENGINE_CACHE = CacheCounters()
