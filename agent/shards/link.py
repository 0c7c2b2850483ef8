"""The shard's end of its pipe to the supervisor (messages: agent.shards.protocol), and the outlet its
LocalRuntime publishes through (agent.runtime.protocol.Outlet): the shard's own MQTT client for its
cameras' topics (no will, status or commands: the supervisor's), camera, engine and telemetry news and
copies of its events up the pipe."""

from __future__ import annotations

import json
import threading
from multiprocessing.connection import Connection
from typing import Any

from agent.config import AgentConfig
from agent.events.publisher import EVENT_TYPES
from agent.mqtt import MqttClient
from agent.runtime.protocol import Mirror, device_topics
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

# The events whose copies the supervisor keeps, to close a dead shard's tracks (agent.shards.tracks): the
# object events and every rule's (pipelines.rules: a new rule's events are mirrored with no change here).
MIRRORED = frozenset(EVENT_TYPES)


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

    # ---- news -----------------------------------------------------------------------------------
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


class ShardOutlet:
    """What the shard's LocalRuntime publishes through (agent.runtime.protocol.Outlet): the shard's own
    MQTT client for its cameras' topics, the rest up the pipe."""

    def __init__(self, link: ShardLink, cfg: AgentConfig) -> None:
        self.link = link
        self.topics = device_topics(cfg)
        self.mqtt = self.make_mqtt(cfg)

    @property
    def mirror(self) -> Mirror:
        return self.link.mirror

    def camera_changed(self, camera: str, state: CameraState) -> None:
        self.link.camera_state(camera, state)  # the supervisor's status counts it

    def status_changed(self) -> None:
        """Nothing: the supervisor's device publishes the status from the camera states it is sent."""

    def engine_state(self, model: str, fields: dict[str, Any]) -> None:
        self.link.engine_state(model, fields)

    def make_mqtt(self, cfg: AgentConfig) -> MqttClient | None:
        """A client for `cfg` (not started): the shard form (agent.mqtt), watching nothing."""
        if not cfg.mqtt.enabled:
            return None
        return MqttClient.from_config(cfg.mqtt, device_topics(cfg), shard=self.link.index)

    def replace_mqtt(self, client: MqttClient | None, cfg: AgentConfig) -> None:
        """A reload's client in place of the old one (closed first; the new one starts)."""
        old, self.mqtt, self.topics = self.mqtt, client, device_topics(cfg)
        if old is not None:
            old.close()
        if client is not None:
            client.start()

    def close(self) -> None:
        if self.mqtt is not None:
            self.mqtt.close()
