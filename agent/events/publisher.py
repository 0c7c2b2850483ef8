"""Where a camera's events and retained zone/line states go, and the event types it counts."""

from __future__ import annotations

from typing import Protocol

from agent.mqtt.topics import Topics

EVENT_TYPES = ("new", "update", "end", "zone_enter", "zone_leave", "line_cross")


class Publisher(Protocol):
    """Where events go (the daemon's MQTT client as it is now: a reload may replace it)."""

    @property
    def topics(self) -> Topics: ...

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None: ...

    def connected(self) -> bool: ...
