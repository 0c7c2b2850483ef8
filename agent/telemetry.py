"""Telemetry: per-stage latency windows, rates, process/GPU stats, the telemetry payload, Prometheus.

The pipeline threads only call ``StageWindow.add``/``add_many`` and ``RateCounter.tick`` (O(1), a short
lock, no allocation); the telemetry thread builds one payload per interval with ``build_telemetry``
(published on MQTT) and feeds the same dict to ``Metrics.update`` (Prometheus), so both always agree.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engines.gpu_probe import NVML, Nvml

QUANTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0}
_PROM_QUANTILE = {"p50": "0.5", "p95": "0.95", "p99": "0.99"}


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


class ProcessStats:
    """CPU and RSS of this process. cpu_percent is since the previous call (may exceed 100 on >1 core)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # prime: the first call always returns 0.0

    def sample(self) -> dict[str, float]:
        with self._proc.oneshot():
            cpu = self._proc.cpu_percent(None)
            rss = self._proc.memory_info().rss
        return {"cpu_percent": round(cpu, 1), "rss_mb": round(rss / 2**20, 1)}


_process: ProcessStats | None = None
_process_lock = threading.Lock()


def process_stats() -> dict[str, float]:
    """{cpu_percent, rss_mb} of this process, CPU since the previous call (module-wide sampler)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = ProcessStats()
        return _process.sample()


def gpu_stats(nvml: Nvml = NVML) -> dict[str, dict[str, Any]]:
    """{index: {name, util_percent, mem_used_mb, mem_total_mb, temp_c}} via NVML; {} when unreadable.

    NVML is optional (absent on Jetson, where tegrastats is the source): any failure gives {}. The
    reader is engines.gpu_probe's, initialised once per process.
    """
    return nvml.stats()


def build_telemetry(
    *,
    cameras: Mapping[str, Mapping[str, Any]],
    stages: Mapping[str, Mapping[str, Any]],
    backend: Any,
    batch_fill: float | None,
    process: Mapping[str, Any] | None = None,
    gpu: Mapping[str, Any] | None = None,
    mqtt: Mapping[str, Any] | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    """The fields of an ``edge-agent/telemetry/1`` payload (pass to ``topics.payload("telemetry", **d)``).

    cameras: {cam: {fps_in, fps_out, dropped, dropped_stale, frame_age_ms, ...}} (extra keys kept;
    dropped: replaced in the slot before the model took them, dropped_stale: taken too old); stages: from
    ``StageWindow.summary()`` (its latency ``histograms`` ride along on ``fields["stages"]`` for ``Metrics``,
    outside the payload); backend: a name or {model: name}; process/gpu: read now when None;
    mqtt: ``MqttClient.stats()`` (the keys below are published).
    """
    cams = {}
    for name, c in cameras.items():
        row = {"fps_in": None, "fps_out": None, "dropped": 0, "dropped_stale": 0, "frame_age_ms": None}
        row.update(c)
        cams[name] = row
    fields: dict[str, Any] = {
        "cameras": cams,
        "stages": StageRows(
            {s: {k: v.get(k) for k in (*QUANTILES, "n") if k in v} for s, v in stages.items()},
            histograms=getattr(stages, "histograms", None),
        ),
        "backend": backend,
        "batch_fill": batch_fill,
        "process": dict(process_stats() if process is None else process),
        "gpu": dict(gpu_stats() if gpu is None else gpu),
        "mqtt": {
            "dropped_offline": (mqtt or {}).get("dropped_offline", 0),
            "queued": (mqtt or {}).get("queued", 0),
            "reconnects": (mqtt or {}).get("reconnects", 0),  # connections to the broker after the first
            # publishes/subscriptions the broker refused (MQTT 5 reason codes, e.g. its ACL) and the latest
            "refused": (mqtt or {}).get("refused", 0),
            "last_refused": (mqtt or {}).get("last_refused"),
            # instances of other processes publishing with this device id (agent.mqtt)
            "duplicates": list((mqtt or {}).get("duplicates", [])),
            # accepted, rejected, dropped, retained_ignored, failed (agent.commands)
            "commands": dict((mqtt or {}).get("commands", {})),
        },
    }
    if window_s is not None:
        fields["window_s"] = window_s
    return fields


class _LatencyHistogram:
    """Collector of ``{ns}_stage_latency_seconds{stage}`` (a histogram, LATENCY_BUCKETS_S) from the cumulative
    counts a StageWindow keeps (``StageRows.histograms``): each update adds what was counted since the last
    one, and a total that went down (a new window) is counted again from zero, as a counter would be."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}  # per bucket (not cumulative), the last one +Inf
        self._sums: dict[str, float] = {}  # seconds
        self._last: dict[str, tuple[tuple[int, ...], float]] = {}  # the totals last seen, ms

    def advance(self, histograms: Histograms) -> None:
        with self._lock:
            for stage, (counts, sum_ms) in histograms.items():
                counts = tuple(int(c) for c in counts[: len(_BOUNDS) + 1])
                last = self._last.get(stage)
                if last is None or sum(counts) < sum(last[0]):  # first seen, or a new window: all of it
                    step, step_ms = counts, sum_ms
                else:
                    step = tuple(max(0, c - p) for c, p in zip(counts, last[0], strict=False))
                    step_ms = sum_ms - last[1]
                self._last[stage] = (counts, sum_ms)
                own = self._counts.setdefault(stage, [0] * (len(_BOUNDS) + 1))
                for i, c in enumerate(step):
                    own[i] += c
                self._sums[stage] = self._sums.get(stage, 0.0) + max(0.0, step_ms) / 1000.0

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=["stage"])

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


class Metrics:
    """Prometheus view of the telemetry payload, in a registry of its own (several may coexist), with the
    standard process_*, python_gc_* and python_info collectors of the process serving it.

    Units follow Prometheus conventions (seconds, bytes); values are the same data as the payload. What
    only grows (dropped frames, reconnects, refusals, ...) is a Counter (``_total``): each update adds the
    increase of the reported total since the previous update; a total that went down (a camera, a shard
    or the MQTT client started over) restarted from 0, so its new value is the increase. Latencies are
    histograms per stage (fixed buckets LATENCY_BUCKETS_S: sum them across a fleet and take quantiles
    with histogram_quantile); the window's exact quantiles stay as gauges. README "Prometheus" lists all.
    """

    def __init__(self, namespace: str = "edge_agent") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, namespace
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.stage_latency = _LatencyHistogram(
            f"{ns}_stage_latency_seconds",
            "Per-stage latency of each frame (every sample, since start)",
        )
        r.register(self.stage_latency)
        self.stage_latency_window = Gauge(
            "stage_latency_window_seconds",
            "Per-stage latency quantile over the last telemetry window",
            ["stage", "quantile"],
            namespace=ns,
            registry=r,
        )
        self.stage_samples = Counter(
            "stage_samples", "Latency samples recorded per stage", ["stage"], namespace=ns, registry=r
        )
        self.camera_fps = Gauge(
            "camera_fps", "Frames per second", ["camera", "direction"], namespace=ns, registry=r
        )
        self.camera_dropped = Counter(
            "camera_dropped_frames",
            "Frames dropped (replaced in the slot before the model took them; latest frame wins)",
            ["camera"],
            namespace=ns,
            registry=r,
        )
        self.camera_stale = Counter(
            "camera_stale_frames",
            "Frames dropped unprocessed for being older than the model's max age",
            ["camera"],
            namespace=ns,
            registry=r,
        )
        self.camera_reconnects = Counter(
            "camera_reconnects", "Reconnections of the camera's source", ["camera"], namespace=ns, registry=r
        )
        self.camera_loops = Counter(
            "camera_loops", "Passes of a looping file source", ["camera"], namespace=ns, registry=r
        )
        self.camera_decode_errors = Counter(
            "camera_decode_errors",
            "Packets the hardware decoder rejected (decoding resumed at the next key frame)",
            ["camera"],
            namespace=ns,
            registry=r,
        )
        self.camera_frame_age = Gauge(
            "camera_frame_age_seconds", "Age of the newest frame", ["camera"], namespace=ns, registry=r
        )
        self.batch_fill = Gauge("batch_fill_ratio", "Mean batch fill", namespace=ns, registry=r)
        self.backend = Gauge(
            "backend_info", "Inference backend in use", ["model", "backend"], namespace=ns, registry=r
        )
        self.cpu = Gauge(
            "process_cpu_percent",
            "CPU percent of the agent (all cores; with shards, every process)",
            namespace=ns,
            registry=r,
        )
        self.rss = Gauge(
            "process_resident_memory_bytes",
            "RSS of the agent (with shards, every process)",
            namespace=ns,
            registry=r,
        )
        self.gpu_util = Gauge("gpu_utilization_percent", "GPU utilisation", ["gpu"], namespace=ns, registry=r)
        self.gpu_mem = Gauge("gpu_memory_used_bytes", "GPU memory used", ["gpu"], namespace=ns, registry=r)
        self.gpu_temp = Gauge("gpu_temperature_celsius", "GPU temperature", ["gpu"], namespace=ns, registry=r)
        self.gpu_decoder = Gauge(
            "gpu_decoder_utilization_percent", "NVDEC utilisation", ["gpu"], namespace=ns, registry=r
        )
        self.gpu_nvdec = Gauge(
            "gpu_nvdec_sessions", "Cameras decoding with NVDEC on the GPU", ["gpu"], namespace=ns, registry=r
        )
        # Pipeline shards (agent.shards): present only when pipeline.shards > 1.
        self.shard_up = Gauge(
            "shard_up", "1 while the shard process runs", ["shard"], namespace=ns, registry=r
        )
        self.shard_restarts = Counter(
            "shard_restarts", "Restarts of the shard process", ["shard"], namespace=ns, registry=r
        )
        self.shard_device_memory = Gauge(
            "shard_device_memory_bytes",
            "Device memory of the shard process",
            ["shard"],
            namespace=ns,
            registry=r,
        )
        self.mqtt_dropped = Counter(
            "mqtt_dropped_offline",
            "Events dropped while the broker was unreachable",
            namespace=ns,
            registry=r,
        )
        self.mqtt_queued = Gauge("mqtt_queued", "Events queued for the broker", namespace=ns, registry=r)
        self.mqtt_refused = Counter(
            "mqtt_refused",
            "Publishes and subscriptions the broker refused (MQTT 5 reason codes)",
            namespace=ns,
            registry=r,
        )
        self.mqtt_reconnects = Counter(
            "mqtt_reconnects", "Connections to the broker after the first", namespace=ns, registry=r
        )
        self.mqtt_commands = Counter(
            "mqtt_commands",
            "MQTT commands by outcome (accepted, rejected, dropped, retained_ignored, failed)",
            ["result"],
            namespace=ns,
            registry=r,
        )
        self.mqtt_duplicates = Gauge(
            "mqtt_duplicate_device_agents",
            "Other live agents seen publishing with this device id",
            namespace=ns,
            registry=r,
        )
        # Tracking, zones and lines (telemetry cameras.C.tracking, agent.events).
        self.tracks_active = Gauge(
            "tracks_active",
            "Confirmed tracks alive (tracked or briefly lost)",
            ["camera"],
            namespace=ns,
            registry=r,
        )
        self.tracks_started = Counter(
            "tracks_started", "Tracks confirmed (objects seen)", ["camera"], namespace=ns, registry=r
        )
        self.events = Counter(
            "events",
            "Events published on cameras/C/events, by type",
            ["camera", "type"],
            namespace=ns,
            registry=r,
        )
        self.zone_objects = Gauge(
            "zone_objects",
            "Tracked objects in a zone, by label",
            ["camera", "zone", "label"],
            namespace=ns,
            registry=r,
        )
        self.line_crossings = Counter(
            "line_crossings",
            "Line crossings by direction (since the line was configured)",
            ["camera", "line", "direction"],
            namespace=ns,
            registry=r,
        )
        self._totals: dict[tuple[str, ...], float] = {}  # last totals seen, for the counters' increments
        self._zone_labels: set[tuple[str, str, str]] = set()
        self._server: Any = None

    def _advance(self, counter: Counter, labels: tuple[str, ...], total: Any) -> None:
        """Bring a Counter to a total reported by the agent: the increase since the last update; a total that
        went down restarted from 0 (a camera, shard or client started over), so all of it is the increase.
        A missing or non-numeric total is skipped."""
        if isinstance(total, bool) or not isinstance(total, (int, float)) or total != total:
            return
        key = (str(id(counter)), *labels)
        last = self._totals.get(key, 0.0)
        step = total - last if total >= last else total
        if step > 0:
            (counter.labels(*labels) if labels else counter).inc(step)
        self._totals[key] = total

    def _update_tracking(self, cameras: Mapping[str, Any]) -> None:
        zone_labels: set[tuple[str, str, str]] = set()
        for cam, c in cameras.items():
            tr = c.get("tracking")
            if not isinstance(tr, Mapping):
                continue
            self.tracks_active.labels(cam).set(tr.get("tracks_active", 0))
            self._advance(self.tracks_started, (cam,), tr.get("tracks_started", 0))
            for kind, n in (tr.get("events") or {}).items():
                self._advance(self.events, (cam, kind), n)
            for zone, counts in (tr.get("zones") or {}).items():
                for label, n in counts.items():
                    self.zone_objects.labels(cam, zone, label).set(n)
                    zone_labels.add((cam, zone, label))
            for line, counts in (tr.get("lines") or {}).items():
                for direction, n in counts.items():
                    self._advance(self.line_crossings, (cam, line, direction), n)
        for gone in self._zone_labels - zone_labels:  # a zone removed by a reload
            self.zone_objects.remove(*gone)
        self._zone_labels = zone_labels

    def update(self, fields: Mapping[str, Any]) -> None:
        """Update every metric from a ``build_telemetry`` dict."""
        stages = fields.get("stages", {})
        for stage, row in stages.items():
            for q in QUANTILES:
                v = row.get(q)
                if v is not None:
                    self.stage_latency_window.labels(stage, _PROM_QUANTILE[q]).set(v / 1000.0)
            if row.get("n"):
                self.stage_samples.labels(stage).inc(row["n"])
        hists = getattr(stages, "histograms", None)
        if hists:
            self.stage_latency.advance(hists)
        for cam, c in fields.get("cameras", {}).items():
            for direction in ("in", "out"):
                v = c.get(f"fps_{direction}")
                if v is not None:
                    self.camera_fps.labels(cam, direction).set(v)
            self._advance(self.camera_dropped, (cam,), c.get("dropped"))
            self._advance(self.camera_stale, (cam,), c.get("dropped_stale"))
            self._advance(self.camera_reconnects, (cam,), c.get("reconnects"))
            self._advance(self.camera_loops, (cam,), c.get("loops"))
            self._advance(self.camera_decode_errors, (cam,), c.get("decode_errors"))
            if c.get("frame_age_ms") is not None:
                self.camera_frame_age.labels(cam).set(c["frame_age_ms"] / 1000.0)
        self._update_tracking(fields.get("cameras", {}))
        if fields.get("batch_fill") is not None:
            self.batch_fill.set(fields["batch_fill"])
        backend = fields.get("backend")
        backends = backend if isinstance(backend, Mapping) else ({"": backend} if backend else {})
        for model, name in backends.items():
            self.backend.labels(model, str(name)).set(1)
        proc = fields.get("process") or {}
        if proc.get("cpu_percent") is not None:
            self.cpu.set(proc["cpu_percent"])
        if proc.get("rss_mb") is not None:
            self.rss.set(proc["rss_mb"] * 2**20)
        for idx, g in (fields.get("gpu") or {}).items():
            if not isinstance(g, Mapping):
                continue
            if g.get("util_percent") is not None:
                self.gpu_util.labels(idx).set(g["util_percent"])
            if g.get("mem_used_mb") is not None:
                self.gpu_mem.labels(idx).set(g["mem_used_mb"] * 2**20)
            if g.get("temp_c") is not None:
                self.gpu_temp.labels(idx).set(g["temp_c"])
            if g.get("decoder_util_percent") is not None:
                self.gpu_decoder.labels(idx).set(g["decoder_util_percent"])
            if g.get("nvdec_sessions") is not None:
                self.gpu_nvdec.labels(idx).set(g["nvdec_sessions"])
        self._update_shards(fields.get("shards") or [])
        mq = fields.get("mqtt") or {}
        self._advance(self.mqtt_dropped, (), mq.get("dropped_offline", 0))
        self.mqtt_queued.set(mq.get("queued", 0))
        self._advance(self.mqtt_refused, (), mq.get("refused", 0))
        self._advance(self.mqtt_reconnects, (), mq.get("reconnects", 0))
        for result, n in (mq.get("commands") or {}).items():
            self._advance(self.mqtt_commands, (str(result),), n)
        self.mqtt_duplicates.set(len(mq.get("duplicates") or ()))

    def _update_shards(self, shards: list[Mapping[str, Any]]) -> None:
        for row in shards:
            k = str(row.get("shard"))
            self.shard_up.labels(k).set(1 if row.get("state") == "running" else 0)
            self._advance(self.shard_restarts, (k,), int(row.get("restarts") or 0))
            if row.get("device_memory_mb") is not None:
                self.shard_device_memory.labels(k).set(row["device_memory_mb"] * 2**20)

    def start_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on ``addr:port`` (port 0 picks a free one); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def stop_http(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
