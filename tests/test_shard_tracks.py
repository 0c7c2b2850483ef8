"""What a dead shard left open, closed by its supervisor (agent.shards.tracks): zone leaves and ends in the
event payload shapes with reason "shard_died", zone and line states at zero, and track ids of a restarted
shard that never repeat those of an earlier start."""

from __future__ import annotations

import itertools
import json
from typing import Any

from agent.shards.tracks import DIED, ID_EPOCH, OpenTracks, first_id


def obj(kind: str, tid: int, **extra: Any) -> dict[str, Any]:
    return {
        "schema": "edge-agent/event/1",
        "ts": 100.0,
        "camera": "a",
        "type": kind,
        "track_id": tid,
        "label": "person",
        "class_id": 0,
        "first_seen": 90.0,
        "last_seen": 99.5,
        "score": 0.8,
        "box": [1.0, 2.0, 3.0, 4.0],
        "best": {"score": 0.9, "box": [1.0, 2.0, 3.0, 4.0], "frame_id": 7, "ts": 95.0},
        "frame_id": 9,
        "zones": [],
        "entered_zones": [],
        **extra,
    }


def zone(kind: str, tid: int, name: str, ts: float = 96.0, **extra: Any) -> dict[str, Any]:
    body = {"schema": "edge-agent/event/1", "ts": ts, "camera": "a", "type": kind, "zone": name}
    return {**body, "track_id": tid, "label": "person", "class_id": 0, "frame_id": 8, "count": 1, **extra}


def test_open_tracks_and_zone_entries_are_closed_leaves_first() -> None:
    t = OpenTracks()
    t.event("a", obj("new", 1))
    t.event("a", obj("new", 2))
    t.event("a", zone("zone_enter", 1, "door"))
    t.event("a", zone("zone_enter", 2, "door", count=2))
    t.event("a", obj("update", 1, last_seen=99.9, frame_id=12, entered_zones=["door"]))
    t.event("a", zone("zone_leave", 2, "door", dwell_s=1.0, reason=None))
    t.event("a", obj("end", 2, reason="lost"))  # closed by the shard itself: not again
    t.event("a", zone("zone_enter", 5, "yard"))  # a track without `new` (events.objects: in_zones)
    events, _ = t.close(now=110.0)
    bodies = [(cam, json.loads(b)) for cam, b in events]
    assert [cam for cam, _ in bodies] == ["a", "a", "a"]
    leave_door, leave_yard, end = (b for _, b in bodies)
    assert leave_door == {
        "schema": "edge-agent/event/1",
        "ts": 110.0,
        "camera": "a",
        "type": "zone_leave",
        "zone": "door",
        "track_id": 1,
        "label": "person",
        "class_id": 0,
        "frame_id": 8,
        "dwell_s": 14.0,
        "reason": DIED,
        "count": 0,
    }
    assert leave_yard["track_id"] == 5 and leave_yard["zone"] == "yard" and leave_yard["count"] == 0
    assert list(end) == [  # the shard's own `end` payload, in its order
        "schema", "ts", "camera", "type", "track_id", "label", "class_id", "first_seen", "last_seen",
        "score", "box", "best", "frame_id", "reason", "duration_s", "zones", "entered_zones", "snapshot",
    ]  # fmt: skip
    assert end["type"] == "end" and end["track_id"] == 1 and end["reason"] == DIED
    assert end["frame_id"] == 12 and end["duration_s"] == 9.9 and end["last_seen"] == 99.9
    assert end["zones"] == [] and end["entered_zones"] == ["door"] and end["snapshot"] is False
    assert t.close() == ([], [])  # emptied


def test_zone_and_line_states_go_to_zero_and_deleted_ones_stay_deleted() -> None:
    t = OpenTracks()
    zone_state = {"schema": "edge-agent/zone/1", "ts": 1.0, "camera": "a", "zone": "door"}
    zone_state |= {"occupied": True, "count": 3, "counts": {"person": 2, "car": 1}}
    line_state = {"schema": "edge-agent/line/1", "ts": 1.0, "camera": "a", "line": "gate"}
    line_state |= {"counts": {"in": 4, "out": 1}, "by_label": {"person": {"in": 4, "out": 1}}}
    t.region("p/d/cameras/a/zones/door", json.dumps(zone_state).encode())
    t.region("p/d/cameras/a/lines/gate", json.dumps(line_state).encode())
    t.region("p/d/cameras/a/zones/gone", json.dumps(zone_state).encode())
    t.region("p/d/cameras/a/zones/gone", b"")  # deleted by a reload: not brought back
    _, states = t.close(now=5.0)
    got = {topic: json.loads(body) for topic, body in states}
    assert sorted(got) == ["p/d/cameras/a/lines/gate", "p/d/cameras/a/zones/door"]
    door = got["p/d/cameras/a/zones/door"]
    assert {k: v for k, v in door.items() if k != "ts"} == {
        "schema": "edge-agent/zone/1",
        "camera": "a",
        "zone": "door",
        "occupied": False,
        "count": 0,
        "counts": {"person": 0, "car": 0},
    }
    gate = got["p/d/cameras/a/lines/gate"]
    assert gate["counts"] == {"in": 0, "out": 0} and gate["by_label"] == {"person": {"in": 0, "out": 0}}


def test_each_start_numbers_from_its_own_range() -> None:
    assert first_id(0) == 1  # a shard's first start: ids from 1, as one process
    starts = [range(first_id(n), first_id(n) + ID_EPOCH) for n in range(4)]
    for a, b in itertools.pairwise(starts):
        assert a.stop == b.start  # adjacent, disjoint
    last = first_id(2**21 - 1) + ID_EPOCH - 1
    assert int(float(last)) == last  # the tracker's float64 table holds it exactly
