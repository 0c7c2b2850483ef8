"""Telemetry: per-stage latency windows, rates, process/GPU stats, the telemetry payload, Prometheus.

- window:      StageWindow (latency samples and histograms per stage; a shard's drain, absorbed)
- rates:       RateCounter (fps in and out)
- process:     process_stats, gpu_stats
- spec:        Field (what a declaration says: path, unit, shard combination, metric), walk, README's table
- fields:      FIELDS, every telemetry field declared once (payload, Prometheus, shards and README follow)
- payload:     build_telemetry (the ``edge-agent/telemetry/1`` fields)
- shards:      sharded_telemetry (the supervisor's one payload of its shards' reports, per declaration)
- metric_defs: the Prometheus metric of each declared one; collectors: the latency histogram collector
- metrics:     Metrics (the payload as Prometheus metrics, /metrics)

The pipeline threads only call ``StageWindow.add``/``add_many`` and ``RateCounter.tick`` (O(1), a short
lock, no allocation); the telemetry thread builds one payload per interval with ``build_telemetry``
(published on MQTT) and feeds the same dict to ``Metrics.update`` (Prometheus), so both always agree.
"""

from agent.telemetry.fields import FIELDS
from agent.telemetry.metrics import Metrics
from agent.telemetry.payload import build_telemetry
from agent.telemetry.process import ProcessStats, gpu_stats, process_stats
from agent.telemetry.rates import RateCounter
from agent.telemetry.shards import sharded_telemetry
from agent.telemetry.spec import Field, Kind, Shards, readme_table, walk
from agent.telemetry.window import (
    LATENCY_BUCKETS_MS,
    LATENCY_BUCKETS_S,
    QUANTILES,
    Histograms,
    StageRows,
    StageWindow,
)

__all__ = [
    "FIELDS",
    "LATENCY_BUCKETS_MS",
    "LATENCY_BUCKETS_S",
    "QUANTILES",
    "Field",
    "Histograms",
    "Kind",
    "Metrics",
    "ProcessStats",
    "RateCounter",
    "Shards",
    "StageRows",
    "StageWindow",
    "build_telemetry",
    "gpu_stats",
    "process_stats",
    "readme_table",
    "sharded_telemetry",
    "walk",
]
