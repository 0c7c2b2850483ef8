"""Prometheus view of the telemetry payload: ``Metrics.update`` brings the metrics of ``MetricDefs`` to a
``build_telemetry`` dict; ``start_http`` serves them on /metrics."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from prometheus_client import Counter, start_http_server

from agent.telemetry.metric_defs import MetricDefs
from agent.telemetry.window import QUANTILES

_PROM_QUANTILE = {"p50": "0.5", "p95": "0.95", "p99": "0.99"}


class Metrics(MetricDefs):
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
        super().__init__(namespace)
        self._totals: dict[tuple[str, ...], float] = {}  # last totals seen, for the counters' increments
        self._zone_labels: set[tuple[str, str, str]] = set()
        # Series of the per-camera metrics made so far (by metric), so a removed camera's can go.
        self._series: dict[int, set[tuple[str, ...]]] = {id(m): set() for m in self.per_camera}
        self._server: Any = None

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        """``metric.labels(*labels)``, noting the series where the metric is per camera."""
        series = self._series.get(id(metric))
        if series is not None:
            series.add(labels)
        return metric.labels(*labels)

    def _forget_cameras(self, keep: set[str]) -> None:
        """Remove every series of a camera not in ``keep`` (removed or disabled by a reload): a dashboard
        must not show its last values forever. Its counters start from 0 if it comes back."""
        for metric in self.per_camera:
            series = self._series[id(metric)]
            for labels in [s for s in series if s[0] not in keep]:
                metric.remove(*labels)
                series.discard(labels)
        ids = {str(id(m)) for m in self.per_camera}
        self._totals = {k: v for k, v in self._totals.items() if k[0] not in ids or k[1] in keep}
        self._zone_labels = {z for z in self._zone_labels if z[0] in keep}

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
            (self._child(counter, labels) if labels else counter).inc(step)
        self._totals[key] = total

    def _update_tracking(self, cameras: Mapping[str, Any]) -> None:
        zone_labels: set[tuple[str, str, str]] = set()
        for cam, c in cameras.items():
            tr = c.get("tracking")
            if not isinstance(tr, Mapping):
                continue
            self._child(self.tracks_active, (cam,)).set(tr.get("tracks_active", 0))
            self._advance(self.tracks_started, (cam,), tr.get("tracks_started", 0))
            for kind, n in (tr.get("events") or {}).items():
                self._advance(self.events, (cam, kind), n)
            for zone, counts in (tr.get("zones") or {}).items():
                for label, n in counts.items():
                    self._child(self.zone_objects, (cam, zone, label)).set(n)
                    zone_labels.add((cam, zone, label))
            for line, counts in (tr.get("lines") or {}).items():
                for direction, n in counts.items():
                    self._advance(self.line_crossings, (cam, line, direction), n)
        for gone in self._zone_labels - zone_labels:  # a zone removed by a reload
            self.zone_objects.remove(*gone)
            self._series[id(self.zone_objects)].discard(gone)
        self._zone_labels = zone_labels

    def update(self, fields: Mapping[str, Any], cameras: Collection[str] | None = None) -> None:
        """Update every metric from a ``build_telemetry`` dict. ``cameras``: the configured (enabled) ones;
        series of any other camera are removed (None: keep every camera seen)."""
        self._update_stages(fields.get("stages", {}))
        self._update_cameras(fields.get("cameras", {}))
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
        self._update_gpus(fields.get("gpu") or {})
        self._update_shards(fields.get("shards") or [])
        self._update_mqtt(fields.get("mqtt") or {})
        if cameras is not None:
            self._forget_cameras(set(cameras))

    def _update_stages(self, stages: Mapping[str, Any]) -> None:
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

    def _update_cameras(self, cameras: Mapping[str, Any]) -> None:
        for cam, c in cameras.items():
            for direction in ("in", "out"):
                v = c.get(f"fps_{direction}")
                if v is not None:
                    self._child(self.camera_fps, (cam, direction)).set(v)
            self._advance(self.camera_dropped, (cam,), c.get("dropped"))
            self._advance(self.camera_stale, (cam,), c.get("dropped_stale"))
            self._advance(self.camera_reconnects, (cam,), c.get("reconnects"))
            self._advance(self.camera_loops, (cam,), c.get("loops"))
            self._advance(self.camera_decode_errors, (cam,), c.get("decode_errors"))
            if c.get("frame_age_ms") is not None:
                self._child(self.camera_frame_age, (cam,)).set(c["frame_age_ms"] / 1000.0)

    def _update_gpus(self, gpus: Mapping[str, Any]) -> None:
        for idx, g in gpus.items():
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

    def _update_mqtt(self, mq: Mapping[str, Any]) -> None:
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
