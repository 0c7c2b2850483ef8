"""The shard's end of its pipe to the supervisor (messages: agent.shards.protocol). The daemon's Agent sends
its camera, telemetry, engine and event news through it; apart from the daemon so that neither imports the
other."""

from __future__ import annotations

import json
import threading
from multiprocessing.connection import Connection
from typing import Any

from agent.runtime.reports import CameraState
from agent.shards.protocol import (
    CameraChanged,
    EngineState,
    RebuildAsked,
    RegionState,
    TelemetryReport,
    TrackEvent,
    Up,
)
from engines.precision import Precision

# The events whose copies the supervisor keeps, to close a dead shard's tracks (agent.shards.tracks).
MIRRORED = frozenset(("new", "update", "end", "zone_enter", "zone_leave"))


class ShardLink:
    """The shard's end of the pipe; thread-safe sends; a lost pipe stops the shard."""

    def __init__(self, index: int, conn: Connection) -> None:
        self.index = index
        self._conn = conn
        self._lock = threading.Lock()
        self.lost = threading.Event()

    def send(self, msg: Up) -> None:
        if self.lost.is_set():
            return
        with self._lock:
            try:
                self._conn.send(msg)
            except (OSError, EOFError, ValueError):  # the supervisor is gone: stop (main loop)
                self.lost.set()

    # ---- what the Agent calls ------------------------------------------------------------------
    def camera_state(self, camera: str, state: CameraState) -> None:
        self.send(CameraChanged(camera, state))

    def telemetry(self, fields: dict[str, Any], stages: dict[str, Any]) -> None:
        self.send(TelemetryReport(fields, stages))

    def engine_state(self, model: str, fields: dict[str, Any]) -> None:
        self.send(EngineState(model, fields))

    def request_rebuild(
        self, model: str, force: bool, precision: Precision | None, reasons: list[str] | None
    ) -> bool:
        self.send(RebuildAsked(model, force, precision, reasons))
        return True  # asked: the supervisor's manager starts it, or says it is already under way

    def mirror(self, topic: str, body: bytes, state: bool) -> None:
        """A copy of what the camera events published (agent.runtime.sinks.EventOut): retained zone and
        line states, and the object and zone events (decoded here: they are few, frames are many)."""
        if state:
            self.send(RegionState(topic, body))
        elif topic.endswith("/events"):
            fields = json.loads(body)
            if fields.get("type") in MIRRORED:
                self.send(TrackEvent(fields["camera"], fields))
