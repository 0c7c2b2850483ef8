"""What a shard left open, as its supervisor keeps it: the tracks that had `new` and no `end`, the zones
they are in, the retained zone and line states. When the shard dies these are closed by the supervisor,
so the events contract holds across the death (docs/DESIGN.md): every `new` gets its `end`, every
`zone_enter` its `zone_leave` (reason "shard_died"), and the zone and line states go to zero.

Track ids of a restarted shard do not repeat: the n-th start of a shard numbers its tracks from
``first_id(n)`` (agent.shards.host hands it over in protocol.Assign).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from agent.mqtt.topics import payload

log = logging.getLogger(__name__)

ID_EPOCH = 1 << 32  # ids per camera per shard start; float64 tables keep ids exact for 2**21 starts
DIED = "shard_died"  # the `reason` of the events the supervisor closes a dead shard's tracks with

_OBJECT = ("type", "track_id", "label", "class_id", "first_seen", "last_seen", "score", "box", "best")


def first_id(start: int) -> int:
    """The first track id of a shard's `start`-th start (0: its first; ids from 1 as in one process)."""
    return start * ID_EPOCH + 1


@dataclass
class _Camera:
    tracks: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> its last new/update fields
    entered: dict[int, list[str]] = field(default_factory=dict)  # id -> zones it entered, in order
    inside: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict)  # (id, zone) -> enter


class OpenTracks:
    """One shard's open tracks and region states, fed with the copies of what it published (its host
    thread); `close` empties it."""

    def __init__(self) -> None:
        self._cams: dict[str, _Camera] = {}
        self._regions: dict[str, dict[str, Any]] = {}  # retained zone/line topic -> its last fields

    def event(self, camera: str, body: dict[str, Any]) -> None:
        kind, tid = body.get("type"), body.get("track_id")
        if not isinstance(tid, int):
            return
        cam = self._cams.setdefault(camera, _Camera())
        if kind in ("new", "update"):
            cam.tracks[tid] = body
            for zone in body.get("entered_zones") or []:
                _add(cam.entered.setdefault(tid, []), zone)
        elif kind == "end":
            cam.tracks.pop(tid, None)
            cam.entered.pop(tid, None)
        elif kind == "zone_enter":
            cam.inside[(tid, body["zone"])] = body
            _add(cam.entered.setdefault(tid, []), body["zone"])
        elif kind == "zone_leave":
            cam.inside.pop((tid, body["zone"]), None)

    def region(self, topic: str, body: bytes) -> None:
        if not body:
            self._regions.pop(topic, None)
            return
        try:
            self._regions[topic] = json.loads(body)
        except ValueError:
            log.warning("unreadable zone/line state copy on %s", topic)

    def close(self, now: float | None = None) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
        """The events (camera, event payload) and retained states (topic, payload) that close what the
        dead shard left open: per camera its zone leaves, then its tracks' ends; then every zone and line
        state at zero. Empties the table."""
        now = time.time() if now is None else now
        events: list[tuple[str, bytes]] = []
        for camera, cam in sorted(self._cams.items()):
            occupancy: dict[str, int] = {}
            for _, zone in cam.inside:
                occupancy[zone] = occupancy.get(zone, 0) + 1
            for (_, zone), enter in sorted(cam.inside.items()):
                occupancy[zone] -= 1
                events.append((camera, _event(camera, now, _leave(enter, now, occupancy[zone]))))
            for tid, last in sorted(cam.tracks.items()):
                events.append((camera, _event(camera, now, _end(last, now, cam.entered.get(tid, [])))))
        states = [(topic, _zeroed(fields)) for topic, fields in sorted(self._regions.items())]
        self._cams.clear()
        self._regions.clear()
        return events, [(t, b) for t, b in states if b is not None]


def _add(zones: list[str], zone: str) -> None:
    if zone not in zones:
        zones.append(zone)


def _event(camera: str, ts: float, fields: dict[str, Any]) -> bytes:
    return payload("event", ts=ts, camera=camera, **fields)


def _leave(enter: dict[str, Any], now: float, count: int) -> dict[str, Any]:
    """`zone_leave` for a track inside a zone when its shard died: dwell up to the death."""
    fields = {k: enter[k] for k in ("zone", "track_id", "label", "class_id", "frame_id")}
    dwell = max(0.0, now - float(enter.get("ts") or now))
    return {
        "type": "zone_leave",
        **fields,
        "dwell_s": round(dwell, 3),
        "reason": DIED,
        "count": max(0, count),
    }


def _end(last: dict[str, Any], now: float, entered: list[str]) -> dict[str, Any]:
    """`end` of a track from its last `new`/`update` (what was last known of it)."""
    fields = {k: last[k] for k in _OBJECT if k in last}
    fields["type"] = "end"
    duration = float(last.get("last_seen", 0.0)) - float(last.get("first_seen", 0.0))
    return {
        **fields,
        "frame_id": last.get("frame_id"),
        "reason": DIED,
        "duration_s": round(max(0.0, duration), 3),
        "zones": [],
        "entered_zones": entered,
        "snapshot": False,
    }


def _zeroed(fields: dict[str, Any]) -> bytes | None:
    """A zone or line state with nothing inside and nothing counted (its labels kept, at zero)."""
    schema = fields.get("schema")
    if schema == "edge-agent/zone/1":
        counts = {label: 0 for label in fields.get("counts") or {}}
        return payload(
            "zone", camera=fields["camera"], zone=fields["zone"], occupied=False, count=0, counts=counts
        )
    if schema == "edge-agent/line/1":
        by_label = {label: {"in": 0, "out": 0} for label in fields.get("by_label") or {}}
        return payload(
            "line",
            camera=fields["camera"],
            line=fields["line"],
            counts={"in": 0, "out": 0},
            by_label=by_label,
        )
    return None
