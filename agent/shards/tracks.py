"""What a shard left open, as its supervisor keeps it: the tracks that had `new` and no `end`, the zones
they are in, the retained zone and line states. When the shard dies these are closed by the supervisor,
so the events contract holds across the death (docs/DESIGN.md): every `new` gets its `end`, every
`zone_enter` its `zone_leave` (reason "shard_died"), and the zone and line states go to zero.

Track ids never repeat in a run (``TrackEpochs``): every shard's first start numbers its cameras' tracks
from 1, as one process does; each later start of a shard, and each hand-over of cameras to a shard by a
reload (added, moved from another shard, back after a removal), numbers them from a fresh epoch
``first_id(n)`` that no start or hand-over had before (agent.shards.host hands it over in protocol.Assign
and protocol.Reload). Within a process a camera's ids go on above its own (agent.runtime.wiring).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.config import AgentConfig, ZoneConfig
from agent.events.regions import fresh_zone_fields, line_state, zone_state
from agent.mqtt.topics import payload

log = logging.getLogger(__name__)

ID_EPOCH = 1 << 32  # ids per camera per epoch; float64 tables keep ids exact for 2**21 epochs
DIED = "shard_died"  # the `reason` of the events the supervisor closes a dead shard's tracks with

_OBJECT = ("type", "track_id", "label", "class_id", "first_seen", "last_seen", "score", "box", "best")


def first_id(epoch: int) -> int:
    """The first track id of an epoch (0: a shard's first start; ids from 1 as in one process)."""
    return epoch * ID_EPOCH + 1


class TrackEpochs:
    """The epochs of one supervisor's run (see the module docstring): epoch 0 for each shard's first start
    (a camera is on one shard then), then 1, 2, ... once each, for later starts and hand-overs. Thread-safe:
    host threads start shards, the main thread reloads."""

    def __init__(self) -> None:
        self._next = 1
        self._lock = threading.Lock()

    def start(self, starts: int) -> int:
        """The first track id of a shard's start after `starts` earlier ones."""
        return first_id(0) if starts == 0 else self.fresh()

    def fresh(self) -> int:
        """The first track id of an epoch never handed out before."""
        with self._lock:
            epoch, self._next = self._next, self._next + 1
        return first_id(epoch)


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

    def close(
        self, now: float | None = None, cfg: AgentConfig | None = None
    ) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
        """The events (camera, event payload) and retained states (topic, payload) that close what the
        dead shard left open: per camera its zone leaves, then its tracks' ends; then every zone and line
        state at zero, as a fresh start publishes it (the fields of the zone rules `cfg` turns on for the
        zone too). Empties the table."""
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
        states = [(topic, _zeroed(fields, cfg)) for topic, fields in sorted(self._regions.items())]
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


def _zeroed(fields: dict[str, Any], cfg: AgentConfig | None) -> bytes | None:
    """A zone or line state with nothing inside and nothing counted (its labels kept, at zero), built as
    the events code builds it (agent.events.regions)."""
    schema = fields.get("schema")
    if schema == "edge-agent/zone/1":
        counts = {label: 0 for label in fields.get("counts") or {}}
        zone = _zone(cfg, fields["camera"], fields["zone"])
        return zone_state(fields["camera"], fields["zone"], counts, fresh_zone_fields(zone))
    if schema == "edge-agent/line/1":
        by_label = {label: {"in": 0, "out": 0} for label in fields.get("by_label") or {}}
        return line_state(fields["camera"], fields["line"], {"in": 0, "out": 0}, by_label)
    return None


def _zone(cfg: AgentConfig | None, camera: str, zone: str) -> ZoneConfig | None:
    cam = cfg.cameras.get(camera) if cfg is not None else None
    return cam.zones.get(zone) if cam is not None else None
