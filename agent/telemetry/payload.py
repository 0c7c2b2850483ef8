"""The fields of an ``edge-agent/telemetry/1`` payload (published on MQTT, and fed to ``Metrics.update``,
so both always agree); which keys a section always has, and their defaults, are agent.telemetry.fields'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.telemetry.engine_cache import ENGINE_CACHE
from agent.telemetry.fields import FIELDS
from agent.telemetry.process import gpu_stats, process_stats
from agent.telemetry.spec import UNSET, Field
from agent.telemetry.window import QUANTILES, StageRows


def defaults(section: str, fields: tuple[Field, ...] = FIELDS) -> dict[str, Any]:
    """{key: default} of the keys right under ``section`` whose declared field has one, in declared order
    (``mqtt.commands.{result}`` gives ``commands``)."""
    out = {}
    for f in fields:
        if f.path.startswith(section + ".") and f.default is not UNSET:
            out[f.path[len(section) + 1 :].split(".", 1)[0]] = f.default
    return out


def _copy(value: Any) -> Any:
    """A list or dict of our own (the source's may change while the payload is serialised)."""
    if isinstance(value, (list, tuple, set)):
        return list(value)
    return dict(value) if isinstance(value, Mapping) else value


def build_telemetry(
    *,
    cameras: Mapping[str, Mapping[str, Any]],
    stages: Mapping[str, Mapping[str, Any]],
    backend: Any,
    batch_fill: float | None,
    process: Mapping[str, Any] | None = None,
    gpu: Mapping[str, Any] | None = None,
    mqtt: Mapping[str, Any] | None = None,
    engine_cache: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields of an ``edge-agent/telemetry/1`` payload (pass to ``topics.payload("telemetry", **d)``).

    cameras: {cam: {fps_in, fps_out, dropped, dropped_stale, frame_age_ms, ...}} (the declared defaults
    filled in, extra keys kept); stages: from ``StageWindow.summary()`` (its latency ``histograms`` ride
    along on ``fields["stages"]`` for ``Metrics``, outside the payload); backend: a name or {model: name};
    process/gpu: read now when None; mqtt: ``MqttClient.stats()`` and the command counts (the declared
    ``mqtt`` keys are published, the rest not); engine_cache: the cache's counters (read now when None:
    this process's, agent.telemetry.engine_cache).
    """
    row_defaults = defaults("cameras.{camera}")
    mq = mqtt or {}
    return {
        "cameras": {name: {**row_defaults, **c} for name, c in cameras.items()},
        "stages": StageRows(
            {s: {k: v.get(k) for k in (*QUANTILES, "n") if k in v} for s, v in stages.items()},
            histograms=getattr(stages, "histograms", None),
        ),
        "backend": backend,
        "batch_fill": batch_fill,
        "process": dict(process_stats() if process is None else process),
        "gpu": dict(gpu_stats() if gpu is None else gpu),
        "mqtt": {key: _copy(mq.get(key, default)) for key, default in defaults("mqtt").items()},
        "engine_cache": dict(ENGINE_CACHE.snapshot() if engine_cache is None else engine_cache),
    }
