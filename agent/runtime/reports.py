"""What the pipeline of one process reports about itself: a camera's retained state, the telemetry fields
(agent.telemetry builds the payload) and the progress the service supervisor watches (READY, WATCHDOG)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from agent.lifecycle.manager import EngineManager
from agent.mqtt.topics import payload
from agent.runtime.cameras import CameraRuntime
from agent.runtime.wiring import Pipeline
from agent.service.supervisor import ModelProgress, Progress
from agent.telemetry import StageWindow, build_telemetry, process_stats
from pipelines.scheduler import ModelWorker


@dataclass(frozen=True)
class CameraState:
    """The fields of a camera's retained `camera-state` payload (in payload order)."""

    state: str
    fps_in: float = 0.0
    fps_out: float = 0.0
    reconnects: int = 0
    loops: int = 0  # a looping file's passes (a loop is not a reconnect)
    last_error: str | None = None
    decoder: str | None = None
    decoder_reason: str | None = None


def camera_state(cam: CameraRuntime) -> CameraState:
    """A running camera's state as its reader and counters say now."""
    return CameraState(
        state=cam.state,
        fps_in=round(cam.fps_in.rate(), 2),
        fps_out=round(cam.fps_out.rate(), 2),
        reconnects=cam.reader.reconnects,
        loops=cam.reader.loops,
        last_error=cam.reader.last_error,
        decoder=cam.reader.decoder,
        decoder_reason=cam.reader.decoder_reason,
    )


def camera_state_payload(state: CameraState) -> bytes:
    """The one builder of the `camera-state` payload (a process's own cameras, and a dead shard's, which
    its supervisor publishes)."""
    return payload("camera-state", **asdict(state))


def _camera_row(name: str, cam: CameraRuntime, worker: ModelWorker) -> dict[str, Any]:
    """A camera's telemetry; advances its fps_in counter to the frames its reader took."""
    frames_in = cam.reader.frames_in
    cam.fps_in.tick(frames_in - cam.last_frame_in)
    cam.last_frame_in = frames_in
    route = worker.route(name)
    row: dict[str, Any] = {
        "state": cam.state,
        "fps_in": round(cam.fps_in.rate(), 2),
        "fps_out": round(cam.fps_out.rate(), 2),
        "frames_in": frames_in,  # read since start
        "frames_out": cam.fps_out.total,  # processed since start (a hot swap of the model goes on counting)
        "dropped": route.slot.dropped if route else 0,
        "dropped_stale": route.stale if route else 0,  # older than models.M.max_age_ms
        "reconnects": cam.reader.reconnects,
        "loops": cam.reader.loops,
        "decoder": cam.reader.decoder,  # nvdec, cpu or pipeline
        # Packets NVDEC rejected (corrupt bitstream; decoding resumed at the next key frame).
        "decode_errors": cam.reader.decode_errors,
        # CPU seconds the reader thread spent in demux and decode (which camera costs the CPU: rate() it).
        "decode_cpu_s": round(cam.reader.demux_cpu_s + cam.reader.decode_cpu_s, 3),
        # How stale the newest result is: grows when a camera or the model stalls.
        "frame_age_ms": None
        if cam.last_capture_ts is None
        else round((time.time() - cam.last_capture_ts) * 1000.0, 1),
    }
    if cam.events is not None:  # tracks_active, tracks_started, events, zones, lines
        row["tracking"] = cam.events.stats()
    return row


def telemetry_fields(
    pipeline: Pipeline, stages: StageWindow, mqtt: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The telemetry payload's fields; `mqtt`: the client's and the command intake's stats, if any."""
    cams = {
        name: _camera_row(name, cam, pipeline.workers[cam.cfg.model])
        for name, cam in list(pipeline.cameras.items())  # a reload may change the dict meanwhile
    }
    workers = pipeline.workers
    fills = [w.batch_fill_sum / w.batches for w in workers.values() if w.batches]
    return build_telemetry(
        cameras=cams,
        stages=stages.summary(),
        backend={name: w.backend.name for name, w in workers.items()},
        batch_fill=round(float(np.mean(fills)), 3) if fills else None,
        process=process_stats(),
        mqtt=mqtt,
    )


def progress(pipeline: Pipeline, results_out: Mapping[str, int], engines: EngineManager) -> Progress:
    """For the supervisor (READY, STATUS, WATCHDOG): cameras tried, frames in, results out, and what the
    engine lifecycle has to say about each model."""
    cams = dict(pipeline.cameras)
    models = {}
    for name, worker in list(pipeline.workers.items()):
        mine = [c for c in cams.values() if c.cfg.model == name]
        backend = worker.backend
        models[name] = ModelProgress(
            frames_in=sum(c.reader.frames_in for c in mine),
            results=results_out.get(name, 0),
            running=worker.running,
            serving=f"{backend.name} {backend.precision}",
            streaming_cameras=sum(1 for c in mine if c.state == "streaming"),
            note=engines.summary(name),
        )
    fps = sum(c.fps_out.rate() for c in cams.values())
    return Progress({n: c.state for n, c in cams.items()}, models, fps)
