"""Every field of the ``edge-agent/telemetry/1`` payload, declared once (agent.telemetry.spec says what a
declaration holds). The payload's defaults (payload.py), the Prometheus metrics (metric_defs.py, metrics.py),
how the sharded supervisor combines its shards (shards.py) and README's "Telemetry fields" table all follow
from ``FIELDS``; a new field is one entry here (and the line that measures it).

``python -m agent.telemetry`` prints README's table; tests/test_telemetry.py checks that they agree.
"""

from __future__ import annotations

from typing import Any

from agent.telemetry.spec import Field, Kind, Shards

# Short names, so that a declaration fits a line or two: Field(path, kind, unit, shards, help, metric, ...).
G, T, W, INFO, H, P = Kind.GAUGE, Kind.TOTAL, Kind.INCREMENT, Kind.INFO, Kind.HISTOGRAM, Kind.PAYLOAD
OWNER, SUM, MEAN, COUNT, WINDOW, SUP = (
    Shards.OWNER,
    Shards.SUM,
    Shards.MEAN,
    Shards.COUNT,
    Shards.WINDOW,
    Shards.SUPERVISOR,
)
CAM = "cameras.{camera}"
TRACK = "cameras.{camera}.tracking"


def _running(state: Any) -> float:
    return 1.0 if state == "running" else 0.0


def _count(items: Any) -> float:
    return float(len(items or ()))


_EVENTS = "Events published on cameras/C/events, by type"
_FPS = "Frames per second"
_QUANTILE = "Per-stage latency quantile over the last telemetry window"

# fmt: off
FIELDS: tuple[Field, ...] = (
    # ---- per camera (each from the shard that runs it) ----
    Field(f"{CAM}.state", P, "", OWNER, "Starting, streaming, reconnecting, failed or ended"),
    Field(f"{CAM}.fps_in", G, "frames/s", OWNER, _FPS, "camera_fps", (("direction", "in"),), default=None),
    Field(f"{CAM}.fps_out", G, "frames/s", OWNER, _FPS, "camera_fps", (("direction", "out"),), default=None),
    Field(f"{CAM}.dropped", T, "frames", OWNER,
          "Frames dropped (replaced in the slot before the model took them; latest frame wins)",
          "camera_dropped_frames", default=0),
    Field(f"{CAM}.dropped_stale", T, "frames", OWNER,
          "Frames dropped unprocessed for being older than the model's max age", "camera_stale_frames",
          default=0),
    Field(f"{CAM}.reconnects", T, "", OWNER, "Reconnections of the camera's source", "camera_reconnects"),
    Field(f"{CAM}.loops", T, "", OWNER, "Passes of a looping file source", "camera_loops"),
    Field(f"{CAM}.decoder", P, "", OWNER, "What decodes the pictures: nvdec, cpu or pipeline"),
    Field(f"{CAM}.decode_errors", T, "packets", OWNER,
          "Packets the hardware decoder rejected (decoding resumed at the next key frame)",
          "camera_decode_errors"),
    Field(f"{CAM}.decode_cpu_s", T, "s", OWNER, "CPU time of the camera's reader thread in demux and decode",
          "camera_decode_cpu_seconds"),
    Field(f"{CAM}.frame_age_ms", G, "ms", OWNER, "Age of the newest frame", "camera_frame_age_seconds",
          default=None),
    Field(f"{TRACK}.tracks_active", G, "tracks", OWNER, "Confirmed tracks alive (tracked or briefly lost)",
          "tracks_active"),
    Field(f"{TRACK}.tracks_started", T, "tracks", OWNER, "Tracks confirmed (objects seen)", "tracks_started"),
    Field(f"{TRACK}.events.{{type}}", T, "events", OWNER, _EVENTS, "events"),
    Field(f"{TRACK}.zones.{{zone}}.{{label}}", G, "objects", OWNER, "Tracked objects in a zone, by label",
          "zone_objects", forget=True),
    Field(f"{TRACK}.lines.{{line}}.{{direction}}", T, "crossings", OWNER,
          "Line crossings by direction (since the line was configured)", "line_crossings"),
    # ---- per stage (the shards' windows merged) ----
    Field("stages.{stage}", H, "ms", WINDOW, "Per-stage latency of each frame (every sample, since start)",
          "stage_latency_seconds"),
    Field("stages.{stage}.p50", G, "ms", WINDOW, _QUANTILE, "stage_latency_window_seconds",
          (("quantile", "0.5"),)),
    Field("stages.{stage}.p95", G, "ms", WINDOW, _QUANTILE, "stage_latency_window_seconds",
          (("quantile", "0.95"),)),
    Field("stages.{stage}.p99", G, "ms", WINDOW, _QUANTILE, "stage_latency_window_seconds",
          (("quantile", "0.99"),)),
    Field("stages.{stage}.n", W, "samples", WINDOW, "Latency samples recorded per stage", "stage_samples"),
    # ---- the models and the process ----
    Field("backend.{model}", INFO, "", OWNER, "Inference backend in use", "backend_info", info="backend"),
    Field("batch_fill", G, "ratio", MEAN, "Mean batch fill", "batch_fill_ratio", digits=3),
    Field("process.cpu_percent", G, "%", SUM,
          "CPU percent of the agent (all cores; with shards, every process)", "process_cpu_percent",
          digits=1),
    Field("process.rss_mb", G, "MiB", SUM, "RSS of the agent (with shards, every process)",
          "process_resident_memory_bytes", digits=1),
    Field("process.processes", P, "", COUNT, "Processes counted in cpu_percent and rss_mb (with shards)"),
    # ---- GPUs (NVML; what the supervisor reads) ----
    Field("gpu.{gpu}.name", P, "", SUP, "The GPU's name"),
    Field("gpu.{gpu}.util_percent", G, "%", SUP, "GPU utilisation", "gpu_utilization_percent"),
    Field("gpu.{gpu}.mem_used_mb", G, "MiB", SUP, "GPU memory used", "gpu_memory_used_bytes"),
    Field("gpu.{gpu}.mem_total_mb", P, "MiB", SUP, "GPU memory in all"),
    Field("gpu.{gpu}.temp_c", G, "°C", SUP, "GPU temperature", "gpu_temperature_celsius"),
    Field("gpu.{gpu}.decoder_util_percent", G, "%", SUP, "NVDEC utilisation",
          "gpu_decoder_utilization_percent"),
    Field("gpu.{gpu}.nvdec_sessions", G, "cameras", SUP, "Cameras decoding with NVDEC on the GPU",
          "gpu_nvdec_sessions"),
    Field("gpu.{gpu}.shards", P, "", SUP, "The shards placed on the GPU"),
    # ---- the MQTT client (the supervisor's) ----
    Field("mqtt.dropped_offline", T, "events", SUP, "Events dropped while the broker was unreachable",
          "mqtt_dropped_offline", default=0),
    Field("mqtt.queued", G, "events", SUP, "Events queued for the broker", "mqtt_queued", default=0),
    Field("mqtt.reconnects", T, "", SUP, "Connections to the broker after the first", "mqtt_reconnects",
          default=0),
    Field("mqtt.refused", T, "", SUP, "Publishes and subscriptions the broker refused (MQTT 5 reason codes)",
          "mqtt_refused", default=0),
    Field("mqtt.last_refused", P, "", SUP, "The latest refusal (topic and reason)", default=None),
    Field("mqtt.duplicates", G, "agents", SUP, "Other live agents seen publishing with this device id",
          "mqtt_duplicate_device_agents", value=_count, default=[]),
    Field("mqtt.commands.{result}", T, "commands", SUP,
          "MQTT commands by outcome (accepted, rejected, dropped, retained_ignored, failed)", "mqtt_commands",
          default={}),
    # ---- the shared engine cache (engines.cache) and the builds of this device ----
    Field("engine_cache.hits", T, "engines", SUP,
          "Engines pulled from the shared engine cache instead of built", "engine_cache_hits", default=0),
    Field("engine_cache.misses", T, "engines", SUP, "Cache look-ups that found no engine under the key",
          "engine_cache_misses", default=0),
    Field("engine_cache.rejected", T, "engines", SUP,
          "Pulled engines refused (digest, signature, compatibility, or TensorRT at load): built here",
          "engine_cache_rejected", default=0),
    Field("engine_cache.unavailable", T, "", SUP, "Builds started while the registry was down or slow",
          "engine_cache_unavailable", default=0),
    Field("engine_cache.pushes", T, "engines", SUP,
          "Engines this device built, gated and pushed to the cache", "engine_cache_pushes", default=0),
    Field("engine_cache.pulled_bytes", T, "bytes", SUP, "Bytes pulled from the engine cache",
          "engine_cache_pulled_bytes", default=0),
    Field("engine_cache.pushed_bytes", T, "bytes", SUP, "Bytes pushed to the engine cache",
          "engine_cache_pushed_bytes", default=0),
    Field("engine_cache.pull_s", T, "s", SUP, "Seconds spent pulling engines (verification included)",
          "engine_cache_pull_seconds", default=0),
    Field("engine_cache.push_s", T, "s", SUP, "Seconds spent pushing engines", "engine_cache_push_seconds",
          default=0),
    Field("engine_cache.builds", T, "engines", SUP, "Engines built on this device (cache or not)",
          "engine_builds", default=0),
    Field("engine_cache.build_s", T, "s", SUP, "Seconds spent building engines on this device",
          "engine_build_seconds", default=0),
    # ---- the shard processes (pipeline.shards > 1) ----
    Field("shards.{shard}.state", G, "", SUP, "1 while the shard process runs", "shard_up", value=_running),
    Field("shards.{shard}.pid", P, "", SUP, "The shard process's pid"),
    Field("shards.{shard}.gpu", P, "", SUP, "The GPU the shard runs on (null: none)"),
    Field("shards.{shard}.restarts", T, "", SUP, "Restarts of the shard process", "shard_restarts"),
    Field("shards.{shard}.last_exit", P, "", SUP, "How the shard process last ended"),
    Field("shards.{shard}.cameras", P, "", SUP, "The cameras placed on the shard"),
    Field("shards.{shard}.device_memory_mb", G, "MiB", SUP, "Device memory of the shard process",
          "shard_device_memory_bytes"),
    Field("shards.{shard}.failure", P, "", SUP, "Why the shard is not running, while it is not"),
    Field("shards.{shard}.process", P, "", SUP, "The shard process's own cpu_percent and rss_mb"),
)
# fmt: on
