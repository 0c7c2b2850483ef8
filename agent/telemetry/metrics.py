"""Prometheus view of the telemetry payload: ``Metrics.update`` brings the metrics of ``MetricDefs`` to a
``build_telemetry`` dict, field by declared field; ``start_http`` serves them on /metrics."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from functools import cached_property
from typing import Any

from prometheus_client import start_http_server

from agent.telemetry.metric_defs import MetricDefs
from agent.telemetry.spec import Field, Kind, MetricSpec, walk

Series = tuple[str, ...]  # a metric's label values


class Metrics(MetricDefs):
    """Prometheus view of the telemetry payload, in a registry of its own (several may coexist), with the
    standard process_*, python_gc_* and python_info collectors of the process serving it.

    Units follow Prometheus conventions (seconds, bytes); values are the same data as the payload. What
    only grows (dropped frames, reconnects, refusals, ...) is a Counter (``_total``): each update adds the
    increase of the reported total since the previous update; a total that went down (a camera, a shard
    or the MQTT client started over) restarted from 0, so its new value is the increase. Latencies are
    histograms per stage (fixed buckets LATENCY_BUCKETS_S: sum them across a fleet and take quantiles
    with histogram_quantile); the window's exact quantiles stay as gauges. README "Telemetry fields" lists
    every field and its metric.
    """

    def __init__(self, namespace: str = "edge_agent") -> None:
        super().__init__(namespace)
        self._totals: dict[tuple[str, Series], float] = {}  # last totals seen, for the counters' increments
        # Series made so far of the metrics that lose series (a camera's, a zone's), by metric name.
        self._series: dict[str, set[Series]] = {
            s.name: set() for s in self.specs.values() if s.per_camera or s.forget
        }
        self._server: Any = None

    def update(self, fields: Mapping[str, Any], cameras: Collection[str] | None = None) -> None:
        """Update every metric from a ``build_telemetry`` dict. ``cameras``: the configured (enabled) ones;
        series of any other camera are removed (None: keep every camera seen)."""
        for spec in self.specs.values():
            seen: set[Series] = set()
            for f in spec.fields:
                self._update_field(spec, f, fields, seen)
            if spec.forget:  # e.g. a zone removed by a reload
                for gone in self._series[spec.name] - seen:
                    self._remove(spec, gone)
        if cameras is not None:
            self._forget_cameras(set(cameras))
            self._zero_cameras(cameras)

    def _update_field(self, spec: MetricSpec, f: Field, fields: Mapping[str, Any], seen: set[Series]) -> None:
        metric = self.metric(spec.name)
        if f.kind is Kind.HISTOGRAM:  # its counts ride beside the payload on its section
            hists = getattr(fields.get(f.path.split(".", 1)[0]), "histograms", None)
            if hists:
                metric.advance(hists)
            return
        const = tuple(v for _, v in f.const)
        for keys, raw in walk(f.path, fields):
            labels = (*keys, *const)
            if f.kind is Kind.INFO:
                labels, raw = (*labels, str(raw)), 1
            value = f.sample(raw)
            if value is None:
                continue
            if f.kind is Kind.TOTAL:
                self._advance(spec, labels, value)
            elif f.kind is Kind.INCREMENT:
                child = self._child(spec, labels)  # at 0 from its first report (increase() sees the first)
                if value > 0:
                    child.inc(value)
            else:
                self._child(spec, labels).set(value)
                seen.add(labels)

    def _child(self, spec: MetricSpec, labels: Series) -> Any:
        """The series of ``labels`` (the metric itself when it has none), noted where series may go."""
        metric = self.metric(spec.name)
        if not labels:
            return metric
        series = self._series.get(spec.name)
        if series is not None:
            series.add(labels)
        return metric.labels(*labels)

    def _remove(self, spec: MetricSpec, labels: Series) -> None:
        self.metric(spec.name).remove(*labels)
        self._series[spec.name].discard(labels)
        self._totals.pop((spec.name, labels), None)

    def _zero_cameras(self, cameras: Collection[str]) -> None:
        """Every counter whose only wildcard is the camera (fields.py says which) has a series at 0 for
        each configured camera, from the moment the camera is, reported or not: ``increase()`` over a
        series that appears at its first increment misses that increment (a camera's first outage). The
        series of its zones, lines and event types start at 0 with the first payload that names them."""
        for spec in self._camera_counters:
            for f in spec.fields:
                const = tuple(v for _, v in f.const)
                for camera in cameras:
                    self._child(spec, (camera, *const))

    @cached_property
    def _camera_counters(self) -> tuple[MetricSpec, ...]:
        return tuple(
            s
            for s in self.specs.values()
            if s.kind.prometheus == "counter" and all(f.keys == ("camera",) for f in s.fields)
        )

    def _forget_cameras(self, keep: set[str]) -> None:
        """Remove every series of a camera not in ``keep`` (removed or disabled by a reload): a dashboard
        must not show its last values forever. Its counters start from 0 if it comes back."""
        for spec in self.specs.values():
            if spec.per_camera:
                for labels in [s for s in self._series[spec.name] if s[0] not in keep]:
                    self._remove(spec, labels)
        self._totals = {
            k: v for k, v in self._totals.items() if not self.specs[k[0]].per_camera or k[1][0] in keep
        }

    def _advance(self, spec: MetricSpec, labels: Series, total: float) -> None:
        """Bring a Counter to a total reported by the agent: the increase since the last update; a total that
        went down restarted from 0 (a camera, shard or client started over), so all of it is the increase."""
        key = (spec.name, labels)
        last = self._totals.get(key, 0.0)
        step = total - last if total >= last else total
        child = self._child(spec, labels)  # at 0 from its first report, so increase() sees the first step
        if step > 0:
            child.inc(step)
        self._totals[key] = total

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
