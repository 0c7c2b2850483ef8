"""Per-stage latency windows: ring buffers of samples (percentiles per telemetry interval) and cumulative
latency histograms (fixed buckets, for Prometheus). The pipeline threads only call ``StageWindow.add`` /
``add_many`` (O(1), a short lock, no allocation); a shard drains its window to the supervisor, which
absorbs every shard's into its own.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Mapping
from typing import Any

import numpy as np

QUANTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0}

# Latency histogram buckets (Prometheus `le`, upper bounds in ms here, seconds on /metrics): a 1-2-5 series
# from 0.5 ms to 5 s, which spans a preprocess (~1 ms) to a total under load (max_age_ms defaults to 500).
# Fixed: every agent of a fleet has the same buckets, so histograms can be summed across devices.
LATENCY_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
LATENCY_BUCKETS_S = tuple(b / 1000.0 for b in LATENCY_BUCKETS_MS)
_BOUNDS = list(LATENCY_BUCKETS_MS)

Histograms = dict[str, tuple[tuple[int, ...], float]]  # stage -> (count per bucket and +Inf, sum in ms)


class StageRows(dict[str, Any]):
    """A ``{stage: ...}`` dict that also carries ``histograms`` (``Histograms``) beside its items.

    Only the items are the MQTT payload (JSON and ``payload()`` see a dict); the histograms travel with them
    to ``Metrics.update`` (summary -> build_telemetry -> fields) and over a shard's pipe (drain -> absorb;
    pickle keeps the attribute).
    """

    def __init__(self, rows: Any = (), histograms: Histograms | None = None) -> None:
        super().__init__(rows)
        self.histograms: Histograms = dict(histograms or {})


class _Stage:
    """One stage's ring of samples, window positions and histogram (StageWindow's lock guards it)."""

    __slots__ = ("buf", "drained", "hist", "hsum", "w", "w0", "wd", "xn", "xnd")

    def __init__(self, capacity: int) -> None:
        self.buf = np.empty(capacity, dtype=np.float64)  # one allocation per stage for the process's life
        self.w = 0  # samples ever written to the ring (the next slot is w % capacity)
        self.w0 = self.wd = 0  # w at the last summary(reset) or drain / at the last drain
        self.xn = self.xnd = 0  # arrivals absorbed without their sample (counted in n, not in the ring)
        self.hist = [0] * (len(_BOUNDS) + 1)  # per bucket, the last one +Inf; cumulative
        self.hsum = 0.0  # ms, cumulative
        self.drained: tuple[list[int], float] = ([0] * len(self.hist), 0.0)  # hist, hsum at the last drain


class StageWindow:
    """Latency samples (ms) per stage in fixed-size ring buffers; ``summary()`` closes the window.

    When more than ``capacity`` samples arrive in one window the oldest are overwritten, so the
    percentiles describe the newest ``capacity`` samples while ``n`` still counts all of them.

    Every sample is also counted in a latency histogram per stage (``LATENCY_BUCKETS_MS``; cumulative for
    the life of the window, never reset): one bisect over 13 bounds per sample, so the histogram is exact
    however many samples a window overwrote. ``summary()`` and ``drain()`` hand it on as ``histograms``.
    """

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._stages: dict[str, _Stage] = {}

    def add(self, stage: str, ms: float) -> None:
        with self._lock:
            st = self._stages.get(stage)
            if st is None:
                st = self._stages[stage] = _Stage(self.capacity)
            st.buf[st.w % self.capacity] = ms
            st.w += 1
            if ms == ms:  # NaN would make the sum NaN for good
                st.hist[bisect_left(_BOUNDS, ms)] += 1
                st.hsum += ms

    def add_many(self, latencies: Mapping[str, float | None]) -> None:
        """Add one frame's latencies; None (a stage the frame did not pass) is skipped."""
        for stage, ms in latencies.items():
            if ms is not None:
                self.add(stage, ms)

    def _stage(self, stage: str) -> _Stage:
        st = self._stages.get(stage)
        if st is None:
            st = self._stages[stage] = _Stage(self.capacity)
        return st

    def _since(self, st: _Stage, w0: int) -> np.ndarray:
        """A copy of the samples written since ring position ``w0`` (the newest capacity), oldest first."""
        k = min(st.w - w0, self.capacity)
        return st.buf[np.arange(st.w - k, st.w) % self.capacity]

    def histograms(self) -> Histograms:
        """{stage: (count per bucket of LATENCY_BUCKETS_MS and +Inf, sum in ms)} since the window was made."""
        with self._lock:
            return {s: (tuple(st.hist), st.hsum) for s, st in self._stages.items()}

    def drain(self) -> StageRows:
        """The samples per stage since the last drain and how many arrived, and a new window (a shard hands
        these to the supervisor, which absorbs every shard's into its own window); a summary() in between
        does not take them away. ``histograms``: what each stage's histogram counted since the last drain."""
        out = StageRows()
        with self._lock:
            for s, st in self._stages.items():
                n = st.w - st.wd + st.xnd
                if n:
                    out[s] = (self._since(st, st.wd), n)
                last, last_sum = st.drained
                delta = tuple(a - b for a, b in zip(st.hist, last, strict=True))
                if any(delta):
                    out.histograms[s] = (delta, st.hsum - last_sum)
                st.drained = (list(st.hist), st.hsum)
                st.w0 = st.wd = st.w
                st.xn = st.xnd = 0
        return out

    def absorb(self, drained: Mapping[str, tuple[np.ndarray, int]]) -> None:
        """Another window's samples (drain()) into this one; `n` counts all that arrived there. Its
        ``histograms`` are added to this one's; without them (a plain mapping) its samples are counted."""
        hists: Histograms | None = getattr(drained, "histograms", None)
        with self._lock:
            for stage, (samples, n) in drained.items():
                st = self._stage(stage)
                kept = samples[-self.capacity :]
                for value in kept:
                    ms = float(value)
                    st.buf[st.w % self.capacity] = ms
                    st.w += 1
                    if hists is None and ms == ms:
                        st.hist[bisect_left(_BOUNDS, ms)] += 1
                        st.hsum += ms
                extra = max(0, int(n) - len(kept))
                st.xn += extra
                st.xnd += extra
            for stage, (counts, sum_ms) in (hists or {}).items():
                st = self._stage(stage)
                for i, c in enumerate(counts[: len(st.hist)]):
                    st.hist[i] += int(c)
                st.hsum += float(sum_ms)

    def summary(self, reset: bool = True) -> StageRows:
        """{stage: {p50, p95, p99, n}} in ms over the window; a stage with no samples has None values.
        ``histograms``: the cumulative latency histograms (as ``histograms()``), for ``Metrics``."""
        with self._lock:
            snap = {s: (self._since(st, st.w0), st.w - st.w0 + st.xn) for s, st in self._stages.items()}
            out = StageRows(histograms={s: (tuple(st.hist), st.hsum) for s, st in self._stages.items()})
            if reset:
                for st in self._stages.values():
                    st.w0, st.xn = st.w, 0
        for stage, (samples, n) in snap.items():
            if n and len(samples):
                values = np.percentile(samples, list(QUANTILES.values()))
                row: dict[str, float | int | None] = {
                    k: round(float(v), 3) for k, v in zip(QUANTILES, values, strict=True)
                }
            else:
                row = dict.fromkeys(QUANTILES)
            row["n"] = n
            out[stage] = row
        return out
