"""Prometheus collectors of our own: what ``prometheus_client``'s metric types cannot say directly."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from agent.telemetry.window import LATENCY_BUCKETS_MS, LATENCY_BUCKETS_S, Histograms


class LatencyHistogram:
    """Collector of a latency histogram (``{ns}_stage_latency_seconds{stage}``, LATENCY_BUCKETS_S) from the
    cumulative counts a StageWindow keeps (``StageRows.histograms``, by the one label's value): each
    update adds what was counted since the last one, and a total that went down (a new window) is counted
    again from zero, as a counter would be."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ("stage",)) -> None:
        if len(labels) != 1:
            raise ValueError(f"{name}: a latency histogram has one label (the stage), got {list(labels)}")
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}  # per bucket (not cumulative), the last one +Inf
        self._sums: dict[str, float] = {}  # seconds
        self._last: dict[str, tuple[tuple[int, ...], float]] = {}  # the totals last seen, ms

    def advance(self, histograms: Histograms) -> None:
        with self._lock:
            for stage, (counts, sum_ms) in histograms.items():
                counts = tuple(int(c) for c in counts[: len(LATENCY_BUCKETS_MS) + 1])
                last = self._last.get(stage)
                if last is None or sum(counts) < sum(last[0]):  # first seen, or a new window: all of it
                    step, step_ms = counts, sum_ms
                else:
                    step = tuple(max(0, c - p) for c, p in zip(counts, last[0], strict=False))
                    step_ms = sum_ms - last[1]
                self._last[stage] = (counts, sum_ms)
                own = self._counts.setdefault(stage, [0] * (len(LATENCY_BUCKETS_MS) + 1))
                for i, c in enumerate(step):
                    own[i] += c
                self._sums[stage] = self._sums.get(stage, 0.0) + max(0.0, step_ms) / 1000.0

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labels)

    def describe(self) -> Iterable[HistogramMetricFamily]:
        yield self._family()

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = self._family()
        with self._lock:
            rows = [(s, list(c), self._sums[s]) for s, c in self._counts.items()]
        for stage, counts, total_s in rows:
            cumulative, buckets = 0, []
            for le, c in zip([*map(floatToGoString, LATENCY_BUCKETS_S), "+Inf"], counts, strict=True):
                cumulative += c
                buckets.append((le, cumulative))
            family.add_metric([stage], buckets, total_s)
        yield family
