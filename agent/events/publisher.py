"""Where a camera's events and retained zone/line states go, and the event types it counts."""

from __future__ import annotations

from typing import Protocol

from agent.mqtt.topics import Topics
from pipelines.rules import event_types

# The object events, then those of the zone and line rules (pipelines.rules: a new rule brings its own).
EVENT_TYPES = ("new", "update", "end", *event_types())


class Publisher(Protocol):
    """Where events go (the daemon's MQTT client as it is now: a reload may replace it)."""

    @property
    def topics(self) -> Topics: ...

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None: ...

    def connected(self) -> bool: ...
