"""Every Prometheus metric the agent exports, defined in one registry per ``MetricDefs`` (several may
coexist), by what it measures. README "Prometheus" lists them; ``Metrics`` fills them in."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)

from agent.telemetry.collectors import LatencyHistogram


class _Make:
    """Gauges and counters in one namespace and registry; those labelled by camera first are noted in
    ``per_camera`` (their series go when the camera goes: Metrics.update)."""

    def __init__(self, namespace: str, registry: CollectorRegistry) -> None:
        self.ns, self.registry = namespace, registry
        self.per_camera: list[Gauge | Counter] = []

    def _note(self, metric: Gauge | Counter, labels: Sequence[str]) -> None:
        if labels and labels[0] == "camera":
            self.per_camera.append(metric)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        g = Gauge(name, doc, list(labels), namespace=self.ns, registry=self.registry)
        self._note(g, labels)
        return g

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        c = Counter(name, doc, list(labels), namespace=self.ns, registry=self.registry)
        self._note(c, labels)
        return c


class MetricDefs:
    """The metrics, with the standard process_*, python_gc_* and python_info collectors of the process
    serving them. Defined in this order (the order of /metrics)."""

    def __init__(self, namespace: str = "edge_agent") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.stage_latency = LatencyHistogram(
            f"{namespace}_stage_latency_seconds",
            "Per-stage latency of each frame (every sample, since start)",
        )
        r.register(self.stage_latency)
        make = _Make(namespace, r)
        self._define_stages_cameras(make)
        self._define_process_gpu(make)
        self._define_shards_mqtt(make)
        self._define_tracking(make)
        self.per_camera = tuple(make.per_camera)  # metrics whose first label is the camera

    def _define_stages_cameras(self, m: _Make) -> None:
        self.stage_latency_window = m.gauge(
            "stage_latency_window_seconds",
            "Per-stage latency quantile over the last telemetry window",
            ["stage", "quantile"],
        )
        self.stage_samples = m.counter("stage_samples", "Latency samples recorded per stage", ["stage"])
        self.camera_fps = m.gauge("camera_fps", "Frames per second", ["camera", "direction"])
        self.camera_dropped = m.counter(
            "camera_dropped_frames",
            "Frames dropped (replaced in the slot before the model took them; latest frame wins)",
            ["camera"],
        )
        self.camera_stale = m.counter(
            "camera_stale_frames",
            "Frames dropped unprocessed for being older than the model's max age",
            ["camera"],
        )
        self.camera_reconnects = m.counter(
            "camera_reconnects", "Reconnections of the camera's source", ["camera"]
        )
        self.camera_loops = m.counter("camera_loops", "Passes of a looping file source", ["camera"])
        self.camera_decode_errors = m.counter(
            "camera_decode_errors",
            "Packets the hardware decoder rejected (decoding resumed at the next key frame)",
            ["camera"],
        )
        self.camera_frame_age = m.gauge("camera_frame_age_seconds", "Age of the newest frame", ["camera"])
        self.batch_fill = m.gauge("batch_fill_ratio", "Mean batch fill")
        self.backend = m.gauge("backend_info", "Inference backend in use", ["model", "backend"])

    def _define_process_gpu(self, m: _Make) -> None:
        self.cpu = m.gauge(
            "process_cpu_percent", "CPU percent of the agent (all cores; with shards, every process)"
        )
        self.rss = m.gauge("process_resident_memory_bytes", "RSS of the agent (with shards, every process)")
        self.gpu_util = m.gauge("gpu_utilization_percent", "GPU utilisation", ["gpu"])
        self.gpu_mem = m.gauge("gpu_memory_used_bytes", "GPU memory used", ["gpu"])
        self.gpu_temp = m.gauge("gpu_temperature_celsius", "GPU temperature", ["gpu"])
        self.gpu_decoder = m.gauge("gpu_decoder_utilization_percent", "NVDEC utilisation", ["gpu"])
        self.gpu_nvdec = m.gauge("gpu_nvdec_sessions", "Cameras decoding with NVDEC on the GPU", ["gpu"])

    def _define_shards_mqtt(self, m: _Make) -> None:
        # Pipeline shards (agent.shards): present only when pipeline.shards > 1.
        self.shard_up = m.gauge("shard_up", "1 while the shard process runs", ["shard"])
        self.shard_restarts = m.counter("shard_restarts", "Restarts of the shard process", ["shard"])
        self.shard_device_memory = m.gauge(
            "shard_device_memory_bytes", "Device memory of the shard process", ["shard"]
        )
        self.mqtt_dropped = m.counter(
            "mqtt_dropped_offline", "Events dropped while the broker was unreachable"
        )
        self.mqtt_queued = m.gauge("mqtt_queued", "Events queued for the broker")
        self.mqtt_refused = m.counter(
            "mqtt_refused", "Publishes and subscriptions the broker refused (MQTT 5 reason codes)"
        )
        self.mqtt_reconnects = m.counter("mqtt_reconnects", "Connections to the broker after the first")
        self.mqtt_commands = m.counter(
            "mqtt_commands",
            "MQTT commands by outcome (accepted, rejected, dropped, retained_ignored, failed)",
            ["result"],
        )
        self.mqtt_duplicates = m.gauge(
            "mqtt_duplicate_device_agents", "Other live agents seen publishing with this device id"
        )

    def _define_tracking(self, m: _Make) -> None:
        # Tracking, zones and lines (telemetry cameras.C.tracking, agent.events).
        self.tracks_active = m.gauge(
            "tracks_active", "Confirmed tracks alive (tracked or briefly lost)", ["camera"]
        )
        self.tracks_started = m.counter("tracks_started", "Tracks confirmed (objects seen)", ["camera"])
        self.events = m.counter("events", "Events published on cameras/C/events, by type", ["camera", "type"])
        self.zone_objects = m.gauge(
            "zone_objects", "Tracked objects in a zone, by label", ["camera", "zone", "label"]
        )
        self.line_crossings = m.counter(
            "line_crossings",
            "Line crossings by direction (since the line was configured)",
            ["camera", "line", "direction"],
        )
