"""Telemetry: per-stage latency windows, rates, process/GPU stats, the telemetry payload, Prometheus.

- window:      StageWindow (latency samples and histograms per stage; a shard's drain, absorbed)
- rates:       RateCounter (fps in and out)
- process:     process_stats, gpu_stats
- payload:     build_telemetry (the ``edge-agent/telemetry/1`` fields)
- metric_defs: every Prometheus metric; collectors: the latency histogram collector
- metrics:     Metrics (the payload as Prometheus metrics, /metrics)

The pipeline threads only call ``StageWindow.add``/``add_many`` and ``RateCounter.tick`` (O(1), a short
lock, no allocation); the telemetry thread builds one payload per interval with ``build_telemetry``
(published on MQTT) and feeds the same dict to ``Metrics.update`` (Prometheus), so both always agree.
"""

from agent.telemetry.metrics import Metrics
from agent.telemetry.payload import build_telemetry
from agent.telemetry.process import ProcessStats, gpu_stats, process_stats
from agent.telemetry.rates import RateCounter
from agent.telemetry.window import (
    LATENCY_BUCKETS_MS,
    LATENCY_BUCKETS_S,
    QUANTILES,
    Histograms,
    StageRows,
    StageWindow,
)

__all__ = [
    "LATENCY_BUCKETS_MS",
    "LATENCY_BUCKETS_S",
    "QUANTILES",
    "Histograms",
    "Metrics",
    "ProcessStats",
    "RateCounter",
    "StageRows",
    "StageWindow",
    "build_telemetry",
    "gpu_stats",
    "process_stats",
]
