"""The Prometheus metrics of the telemetry fields (agent.telemetry.fields), defined in one registry per
``MetricDefs`` (several may coexist). ``Metrics`` fills them in; README "Telemetry fields" lists them."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)

from agent.telemetry.collectors import LatencyHistogram
from agent.telemetry.fields import FIELDS
from agent.telemetry.spec import Field, Kind, MetricSpec, metric_specs


class MetricDefs:
    """A metric per declared one (``specs``, by name: ``metric``), after the standard process_*, python_gc_*
    and python_info collectors of the process serving them, in the fields' order (the order of /metrics)."""

    def __init__(self, namespace: str = "edge_agent", fields: tuple[Field, ...] = FIELDS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.specs: dict[str, MetricSpec] = metric_specs(fields)
        self._metrics: dict[str, Any] = {}
        for spec in self.specs.values():
            self._metrics[spec.name] = self._define(spec, namespace)

    def _define(self, spec: MetricSpec, ns: str) -> Gauge | Counter | LatencyHistogram:
        labels = list(spec.labels)
        if spec.kind is Kind.HISTOGRAM:
            hist = LatencyHistogram(f"{ns}_{spec.name}", spec.help, labels)
            self.registry.register(hist)
            return hist
        if spec.kind.prometheus == "counter":
            return Counter(spec.name, spec.help, labels, namespace=ns, registry=self.registry)
        return Gauge(spec.name, spec.help, labels, namespace=ns, registry=self.registry)

    def metric(self, name: str) -> Any:
        """The prometheus_client metric (or collector) of a declared metric name."""
        return self._metrics[name]
