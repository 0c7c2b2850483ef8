"""The fields of an ``edge-agent/telemetry/1`` payload (published on MQTT, and fed to ``Metrics.update``,
so both always agree)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.telemetry.process import gpu_stats, process_stats
from agent.telemetry.window import QUANTILES, StageRows


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
            # accepted, rejected, dropped, retained_ignored, failed (agent.mqtt.commands)
            "commands": dict((mqtt or {}).get("commands", {})),
        },
    }
    if window_s is not None:
        fields["window_s"] = window_s
    return fields
