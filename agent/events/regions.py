"""The retained states of one camera's zones and lines: ``cameras/{camera}/zones/{zone}`` (occupancy and
counts by label, then the fields of the zone rules on for it, pipelines.rules; schema edge-agent/zone/1)
and ``cameras/{camera}/lines/{line}`` (counts by direction and label; edge-agent/line/1), published on
change; an empty retained message deletes one that is gone."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from agent.config import CameraConfig, ZoneConfig
from agent.events.publisher import Publisher
from agent.mqtt.topics import payload
from pipelines.analytics import CameraAnalytics
from pipelines.regions import RegionSpec
from pipelines.rules import zone_params, zone_rules


class RegionStates:
    """What each zone and line of a camera last published (CameraEvents' lock guards it). `label(cls)`:
    a class id's name under the labels in use now."""

    def __init__(self, camera: str, out: Publisher, label: Callable[[int], str]) -> None:
        self.camera = camera
        self._out = out
        self._label = label
        self._zone_labels: dict[str, list[str] | None] = {}
        self._line_labels: dict[str, list[str] | None] = {}
        self._published_zones: dict[str, bytes] = {}
        self._published_lines: dict[str, bytes] = {}

    def configure(self, cam: CameraConfig) -> None:
        """The labels each zone and line always lists (its own, or the camera's classes)."""
        self._zone_labels = {n: z.labels or cam.classes for n, z in cam.zones.items()}
        self._line_labels = {n: ln.labels or cam.classes for n, ln in cam.lines.items()}

    def zone_counts(self, analytics: CameraAnalytics, j: int) -> dict[str, int]:
        zones = analytics.zones
        row = zones.counts[j] if j < len(zones.counts) else np.zeros(0, np.int64)
        spec = zones.specs[j]
        named = self._zone_labels.get(spec.name) or []
        out = {label: 0 for label in named}
        for cls in row.nonzero()[0].tolist():
            out[self._label(cls)] = int(row[cls])
        return out

    def line_counts(
        self, analytics: CameraAnalytics, j: int
    ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        counts = analytics.lines.counts[j]  # (2, classes)
        total = {"in": int(counts[0].sum()), "out": int(counts[1].sum())}
        named = self._line_labels.get(analytics.lines.specs[j].name) or []
        by_label = {label: {"in": 0, "out": 0} for label in named}
        for cls in (counts[0] + counts[1]).nonzero()[0].tolist():
            by_label[self._label(cls)] = {"in": int(counts[0, cls]), "out": int(counts[1, cls])}
        return total, by_label

    def publish(self, analytics: CameraAnalytics, force: bool) -> None:
        """Each zone's and line's state where it changed since last published (every one with `force`)."""
        topics = self._out.topics
        for j, spec in enumerate(analytics.zones.specs):
            counts = self.zone_counts(analytics, j)
            total = sum(counts.values())
            ruled = analytics.zones.state_fields(j)
            key = f"{total}:{sorted(counts.items())}:{ruled}".encode()
            if not force and self._published_zones.get(spec.name) == key:
                continue
            self._published_zones[spec.name] = key
            body = zone_state(self.camera, spec.name, counts, ruled)
            self._out.publish(topics.zone(self.camera, spec.name), body, state=True, qos=1)
        for j, spec in enumerate(analytics.lines.specs):
            crossed, by_label = self.line_counts(analytics, j)
            key = f"{crossed}:{sorted(by_label.items())}".encode()
            if not force and self._published_lines.get(spec.name) == key:
                continue
            self._published_lines[spec.name] = key
            body = line_state(self.camera, spec.name, crossed, by_label)
            self._out.publish(topics.line(self.camera, spec.name), body, state=True, qos=1)

    def gone(self, cam: CameraConfig) -> tuple[set[str], set[str]]:
        """The zones and lines published that `cam` no longer has."""
        return set(self._published_zones) - set(cam.zones), set(self._published_lines) - set(cam.lines)

    def delete(self, zones: Iterable[str], lines: Iterable[str]) -> None:
        """Delete these zones' and lines' retained states (in name order)."""
        topics = self._out.topics
        for name in sorted(zones):
            self._out.publish(topics.zone(self.camera, name), b"", state=True, qos=1)
            self._published_zones.pop(name, None)
        for name in sorted(lines):
            self._out.publish(topics.line(self.camera, name), b"", state=True, qos=1)
            self._published_lines.pop(name, None)

    def delete_all(self) -> None:
        self.delete(list(self._published_zones), list(self._published_lines))


def zone_state(camera: str, zone: str, counts: dict[str, int], ruled: dict[str, Any]) -> bytes:
    """A zone's retained state: occupancy and counts by label, then the fields of its zone rules."""
    total = sum(counts.values())
    return payload(
        "zone", camera=camera, zone=zone, occupied=total > 0, count=total, counts=counts, **ruled
    )


def line_state(camera: str, line: str, total: dict[str, int], by_label: dict[str, dict[str, int]]) -> bytes:
    """A line's retained state: crossings by direction, and by label."""
    return payload("line", camera=camera, line=line, counts=total, by_label=by_label)


def fresh_zone_fields(zone: ZoneConfig | None) -> dict[str, Any]:
    """What the zone rules on for `zone` report before anything happened (a fresh start's state; a dead
    shard's zones are reset to it). None: a zone no longer configured, no rule fields."""
    if zone is None:
        return {}
    spec = RegionSpec("zone", "", (), params=zone_params(zone))  # the rules read only their settings
    out: dict[str, Any] = {}
    for rule in zone_rules():
        if rule.wanted([spec]):
            out.update(rule([spec]).fields(0))
    return out
