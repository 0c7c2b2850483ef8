"""Telemetry: per-stage latency windows, rates, process/GPU stats, the telemetry payload, Prometheus.

The pipeline threads only call ``StageWindow.add``/``add_many`` and ``RateCounter.tick`` (O(1), a short
lock, no allocation); the telemetry thread builds one payload per interval with ``build_telemetry``
(published on MQTT) and feeds the same dict to ``Metrics.update`` (Prometheus), so both always agree.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from engines.gpu_probe import NVML, Nvml

QUANTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0}
_PROM_QUANTILE = {"p50": "0.5", "p95": "0.95", "p99": "0.99"}


class StageWindow:
    """Latency samples (ms) per stage in fixed-size ring buffers; ``summary()`` closes the window.

    When more than ``capacity`` samples arrive in one window the oldest are overwritten, so the
    percentiles describe the newest ``capacity`` samples while ``n`` still counts all of them.
    """

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._buf: dict[str, np.ndarray] = {}
        self._n: dict[str, int] = {}

    def add(self, stage: str, ms: float) -> None:
        with self._lock:
            buf = self._buf.get(stage)
            if buf is None:  # one allocation per stage for the life of the process
                buf = self._buf[stage] = np.empty(self.capacity, dtype=np.float64)
                self._n[stage] = 0
            n = self._n[stage]
            buf[n % self.capacity] = ms
            self._n[stage] = n + 1

    def add_many(self, latencies: Mapping[str, float | None]) -> None:
        """Add one frame's latencies; None (a stage the frame did not pass) is skipped."""
        for stage, ms in latencies.items():
            if ms is not None:
                self.add(stage, ms)

    def drain(self) -> dict[str, tuple[np.ndarray, int]]:
        """The window's samples per stage and how many arrived, and a new window (a shard hands these to
        the supervisor, which absorbs every shard's into its own window)."""
        with self._lock:
            snap = {s: (self._buf[s][: min(n, self.capacity)].copy(), n) for s, n in self._n.items() if n}
            for s in self._n:
                self._n[s] = 0
        return snap

    def absorb(self, drained: Mapping[str, tuple[np.ndarray, int]]) -> None:
        """Another window's samples (drain()) into this one; `n` counts all that arrived there."""
        for stage, (samples, n) in drained.items():
            for ms in samples[-self.capacity :]:
                self.add(stage, float(ms))
            with self._lock:
                self._n[stage] += max(0, int(n) - len(samples[-self.capacity :]))

    def summary(self, reset: bool = True) -> dict[str, dict[str, float | int | None]]:
        """{stage: {p50, p95, p99, n}} in ms over the window; a stage with no samples has None values."""
        with self._lock:
            snap = {s: (self._buf[s][: min(n, self.capacity)].copy(), n) for s, n in self._n.items()}
            if reset:
                for s in self._n:
                    self._n[s] = 0
        out: dict[str, dict[str, float | int | None]] = {}
        for stage, (samples, n) in snap.items():
            if n:
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
    ``StageWindow.summary()``; backend: a name or {model: name}; process/gpu: read now when None;
    mqtt: ``MqttClient.stats()`` (only dropped_offline and queued are published).
    """
    cams = {}
    for name, c in cameras.items():
        row = {"fps_in": None, "fps_out": None, "dropped": 0, "dropped_stale": 0, "frame_age_ms": None}
        row.update(c)
        cams[name] = row
    fields: dict[str, Any] = {
        "cameras": cams,
        "stages": {s: {k: v.get(k) for k in (*QUANTILES, "n") if k in v} for s, v in stages.items()},
        "backend": backend,
        "batch_fill": batch_fill,
        "process": dict(process_stats() if process is None else process),
        "gpu": dict(gpu_stats() if gpu is None else gpu),
        "mqtt": {
            "dropped_offline": (mqtt or {}).get("dropped_offline", 0),
            "queued": (mqtt or {}).get("queued", 0),
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


class Metrics:
    """Prometheus view of the telemetry payload, in a registry of its own (several may coexist).

    Units follow Prometheus conventions (seconds, bytes); values are the same data as the payload.
    """

    def __init__(self, namespace: str = "edge_agent") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, namespace
        self.stage_latency = Gauge(
            "stage_latency_seconds",
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
        self.camera_dropped = Gauge(
            "camera_dropped_frames",
            "Frames dropped (latest frame wins), as reported",
            ["camera"],
            namespace=ns,
            registry=r,
        )
        self.camera_stale = Gauge(
            "camera_stale_frames",
            "Frames dropped unprocessed for being older than the model's max age, as reported",
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
        self.cpu = Gauge("process_cpu_percent", "Process CPU percent (all cores)", namespace=ns, registry=r)
        self.rss = Gauge("process_resident_memory_bytes", "Process RSS", namespace=ns, registry=r)
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
        self._shard_restarts_seen: dict[str, int] = {}
        self.mqtt_dropped = Gauge(
            "mqtt_dropped_offline",
            "Events dropped while the broker was unreachable (since start)",
            namespace=ns,
            registry=r,
        )
        self.mqtt_queued = Gauge("mqtt_queued", "Events queued for the broker", namespace=ns, registry=r)
        self.mqtt_refused = Gauge(
            "mqtt_refused",
            "Publishes and subscriptions the broker refused (since start)",
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

    def _advance(self, counter: Counter, labels: tuple[str, ...], total: float) -> None:
        """Bring a Counter to a total reported by the agent (a total that went down restarted from 0)."""
        key = (str(id(counter)), *labels)
        last = self._totals.get(key, 0.0)
        step = total - last if total >= last else total
        if step > 0:
            counter.labels(*labels).inc(step)
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
        for stage, row in fields.get("stages", {}).items():
            for q in QUANTILES:
                v = row.get(q)
                if v is not None:
                    self.stage_latency.labels(stage, _PROM_QUANTILE[q]).set(v / 1000.0)
            if row.get("n"):
                self.stage_samples.labels(stage).inc(row["n"])
        for cam, c in fields.get("cameras", {}).items():
            for direction in ("in", "out"):
                v = c.get(f"fps_{direction}")
                if v is not None:
                    self.camera_fps.labels(cam, direction).set(v)
            if c.get("dropped") is not None:
                self.camera_dropped.labels(cam).set(c["dropped"])
            if c.get("dropped_stale") is not None:
                self.camera_stale.labels(cam).set(c["dropped_stale"])
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
        for idx, g in (fields.get("gpu") or {}).items():
            if g.get("decoder_util_percent") is not None:
                self.gpu_decoder.labels(idx).set(g["decoder_util_percent"])
            if g.get("nvdec_sessions") is not None:
                self.gpu_nvdec.labels(idx).set(g["nvdec_sessions"])
        self._update_shards(fields.get("shards") or [])
        mq = fields.get("mqtt") or {}
        self.mqtt_dropped.set(mq.get("dropped_offline", 0))
        self.mqtt_queued.set(mq.get("queued", 0))
        self.mqtt_refused.set(mq.get("refused", 0))
        self.mqtt_duplicates.set(len(mq.get("duplicates") or ()))

    def _update_shards(self, shards: list[Mapping[str, Any]]) -> None:
        for row in shards:
            k = str(row.get("shard"))
            self.shard_up.labels(k).set(1 if row.get("state") == "running" else 0)
            restarts = int(row.get("restarts") or 0)
            seen = self._shard_restarts_seen.get(k, 0)
            if restarts > seen:  # a counter: only what was added since the last update
                self.shard_restarts.labels(k).inc(restarts - seen)
            self._shard_restarts_seen[k] = restarts
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
