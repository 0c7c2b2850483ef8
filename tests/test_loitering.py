"""Zone loitering (pipelines/rules/loitering.py, `cameras.C.zones.Z.loiter_s`) and the rule framework it
plugs into (pipelines.rules, pipelines.state): events once per stay on frame time, counts, the events'
and retained states' payloads, the config's checks. Home Assistant's entity: tests/test_discovery.py; on
the real agent: tests/test_events_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import CameraConfig, ConfigError, load_config, parse_config
from agent.events import EVENT_TYPES, CameraEvents
from agent.mqtt.topics import Topics
from pipelines.analytics import AnalyticsSettings, CameraAnalytics
from pipelines.frames import Detections, Frame
from pipelines.regions import RegionSpec, Transition
from pipelines.rules import event_types, registered, zone_rules
from pipelines.rules.loitering import Loitering
from pipelines.state import StateTable
from pipelines.tracking import TrackerParams

SIZE = (1000, 500)
PERSON, CAR = 0, 2
RIGHT = ((0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0))
LEFT = ((0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0))
IN, OUT = 750.0, 250.0  # x of the bottom centre: right half, left half


def zone(name: str, points: tuple[tuple[float, float], ...], loiter_s: float | None) -> RegionSpec:
    params = (("loiter_s", loiter_s),) if loiter_s is not None else ()
    return RegionSpec("zone", name, points, params=params)


def analytics(*zones: RegionSpec, compiled: bool = True) -> CameraAnalytics:
    settings = AnalyticsSettings(TrackerParams(high_score=0.4, min_hits=2), 0.4, 2.0, zones)
    return CameraAnalytics(settings, 80, compiled=compiled)


class Walk:
    """Frames at ``fps`` (frame time = capture time; nothing here reads a clock), every transition kept."""

    def __init__(self, an: CameraAnalytics, fps: float = 25.0) -> None:
        self.an, self.fps, self.frame = an, fps, 0
        self.log: list[tuple[int, Transition]] = []

    def step(self, *xs: float, cls: int = PERSON) -> None:
        boxes = [(x - 100, 300.0, x + 100, 400.0) for x in xs]  # wide: walking and turning stay tracked
        dets = Detections(
            np.asarray(boxes, np.float32).reshape(len(xs), 4),
            np.full(len(xs), 0.9, np.float32),
            np.full(len(xs), cls, np.int32),
        )
        t = self.frame / self.fps
        a = self.an.process(dets, t, 1000.0 + t, self.frame, SIZE)
        self.log += [(self.frame, tr) for tr in a.transitions]
        self.frame += 1

    def for_s(self, seconds: float, *xs: float) -> None:
        for _ in range(round(seconds * self.fps)):
            self.step(*xs)

    def move(self, x0: float, x1: float, seconds: float = 1.0) -> None:
        """Walks from x0 to x1 in ``seconds``."""
        n = round(seconds * self.fps)
        for k in range(1, n + 1):
            self.step(x0 + (x1 - x0) * k / n)

    def of(self, kind: str) -> list[tuple[int, Transition]]:
        return [(f, tr) for f, tr in self.log if tr.kind == kind]


def loitering(an: CameraAnalytics, j: int = 0) -> dict[str, Any]:
    return an.zones.state_fields(j).get("loitering", {})


# ---- the rule ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_once_per_stay_not_before_loiter_s_and_again_after_a_new_entry(compiled: bool) -> None:
    walk = Walk(analytics(zone("right", RIGHT, 2.0), compiled=compiled))
    walk.for_s(5.0, IN)  # stands in the zone for 5 s
    ((enter_frame, enter),) = walk.of("zone_enter")
    ((frame, loiter),) = walk.of("zone_loiter")  # one event in 5 s, though 2 s passed twice over
    # The first frame at 2 s after the enter (frame times: 25 fps), not one earlier.
    assert (frame - enter_frame) / 25 >= 2.0 > (frame - 1 - enter_frame) / 25
    assert loiter.track_id == enter.track_id and loiter.class_id == PERSON and loiter.region == 0
    assert loiter.dwell_s == pytest.approx((frame - enter_frame) / 25)
    assert loitering(walk.an) == {"count": 1, "total": 1}
    walk.move(IN, OUT)  # leaves: not loitering any more, the total stays
    walk.for_s(0.5, OUT)
    assert len(walk.of("zone_leave")) == 1 and len(walk.of("zone_loiter")) == 1
    assert loitering(walk.an) == {"count": 0, "total": 1}
    walk.move(OUT, IN)
    walk.for_s(1.0, IN)  # back in: a new stay, 1.5 s so far
    assert len(walk.of("zone_enter")) == 2 and len(walk.of("zone_loiter")) == 1
    walk.for_s(1.0, IN)
    (_, first), (_, second) = walk.of("zone_loiter")
    assert second.track_id == first.track_id  # the same track, its second stay
    assert loitering(walk.an) == {"count": 1, "total": 2}


def test_a_short_stay_never_loiters() -> None:
    walk = Walk(analytics(zone("right", RIGHT, 2.0)))
    walk.for_s(0.2, OUT)
    for _ in range(3):  # about 1.5 s in the zone each time
        walk.move(OUT, IN)
        walk.for_s(0.5, IN)
        walk.move(IN, OUT)
    assert len(walk.of("zone_enter")) == 3 and len(walk.of("zone_leave")) == 3
    assert not walk.of("zone_loiter") and {tr.track_id for _, tr in walk.log} == {1}
    assert loitering(walk.an) == {"count": 0, "total": 0}


def test_frame_time_decides_not_how_fast_frames_come() -> None:
    """A slow camera (1 frame a second): loiter_s 3 is 3 frames after the enter, however fast they run."""
    walk = Walk(analytics(zone("right", RIGHT, 3.0)), fps=1.0)
    for _ in range(10):
        walk.step(IN)
    ((enter_frame, _),) = walk.of("zone_enter")
    ((frame, tr),) = walk.of("zone_loiter")
    assert frame - enter_frame == 3 and tr.dwell_s == 3.0


def test_counts_per_zone_and_only_for_zones_that_ask() -> None:
    an = analytics(zone("left", LEFT, None), zone("right", RIGHT, 1.0))
    walk = Walk(an)
    walk.for_s(2.0, IN, IN + 100, OUT)  # two in the right half, one in the left
    assert sorted(tr.track_id for _, tr in walk.of("zone_loiter")) == [1, 2]
    assert {tr.region for _, tr in walk.of("zone_loiter")} == {1}
    assert an.zones.state_fields(0) == {}  # no loiter_s: nothing added to its state
    assert loitering(an, 1) == {"count": 2, "total": 2}
    assert an.zones.after("zone_loiter", 1) == {"count": 2, "loitering": {"count": 2, "total": 2}}
    assert an.zones.after("zone_enter", 1) == {"count": 2}  # other events keep their fields


def test_no_rule_no_column() -> None:
    """Cameras whose zones do not ask pay nothing: no rule runs, the table has occupancy's columns only."""
    an = analytics(zone("right", RIGHT, None))
    assert an.zones.rules == () and "loitered" not in an.zones.state
    assert "loitered" in analytics(zone("right", RIGHT, 5.0)).zones.state


def test_a_reset_ends_loitering_and_keeps_the_total() -> None:
    an = analytics(zone("right", RIGHT, 1.0))
    walk = Walk(an)
    walk.for_s(2.0, IN)
    assert loitering(an) == {"count": 1, "total": 1}
    a = an.reset("reconnect", 2000.0)
    assert [tr.kind for tr in a.transitions] == ["zone_leave"]  # a reset's leaves; no zone_loiter
    assert loitering(an) == {"count": 0, "total": 1}


def test_a_reconfiguration_keeps_unchanged_zones_and_restarts_changed_ones() -> None:
    right, left = zone("right", RIGHT, 1.0), zone("left", LEFT, 1.0)
    an = analytics(right, left)
    walk = Walk(an)
    walk.for_s(2.0, IN, OUT)
    assert loitering(an, 0) == loitering(an, 1) == {"count": 1, "total": 1}
    tracker = an.settings.tracker
    an.reconfigure(AnalyticsSettings(tracker, 0.4, 2.0, (right, zone("left", LEFT, 9.0))), 3000.0)
    assert loitering(an, 0) == {"count": 1, "total": 1}  # kept, its track still loitering
    assert loitering(an, 1) == {"count": 0, "total": 0}  # loiter_s changed: a new zone
    walk.for_s(1.0, IN, OUT)
    assert len(walk.of("zone_loiter")) == 2  # no second event for the stay that had one


# ---- the framework -------------------------------------------------------------------------------------
def test_event_types_come_from_the_rules() -> None:
    assert event_types() == ("zone_enter", "zone_leave", "line_cross", "zone_loiter")
    assert ("new", "update", "end", *event_types()) == EVENT_TYPES
    assert Loitering in zone_rules() and {r.name for r in registered()} >= {"occupancy", "crossing"}


def test_state_table_follows_carries_and_clears() -> None:
    table = StateTable(2, {"a": np.bool_, "b": np.float64})
    table.follow(np.array([-1, -1, -1], np.intp))  # three new tracks
    table["a"][:] = [[True, False], [False, True], [True, True]]
    table["b"][:, 1] = [1.0, 2.0, 3.0]
    table.follow(np.array([2, -1, 0], np.intp))  # track 1 gone, a new one in row 1
    assert table["a"].tolist() == [[True, True], [False, False], [True, False]]
    assert table["b"][:, 1].tolist() == [3.0, 0.0, 1.0]
    table.add({"c": np.int8})
    assert table["c"].shape == (3, 2) and not table["c"].any()
    with pytest.raises(ValueError, match="'a' declared twice"):
        table.add({"a": np.bool_})
    new = StateTable(3, {"a": np.bool_, "d": np.int16})
    new.carry(table, [1, None, 0], 3)  # region 0 was 1, region 1 is new, region 2 was 0
    assert new["a"].tolist() == [[True, False, True], [False, False, False], [False, False, True]]
    assert new["d"].shape == (3, 3) and not new["d"].any()  # a column the old table had not: zero
    new.clear()
    assert list(new) == ["a", "d"] and new.tracks == 0 and new["a"].shape == (0, 3)


# ---- events and retained states ------------------------------------------------------------------------
class Out:
    def __init__(self) -> None:
        self.topics = Topics("edge-agent", "dev")
        self.messages: list[tuple[str, bytes, bool]] = []

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None:
        self.messages.append((topic, body, state))

    def connected(self) -> bool:
        return True

    def events(self, kind: str) -> list[dict[str, Any]]:
        out = [json.loads(b) for t, b, _ in self.messages if t.endswith("/events")]
        return [e for e in out if e["type"] == kind]

    def zone_state(self, name: str) -> dict[str, Any]:
        return [json.loads(b) for t, b, s in self.messages if s and t.endswith(f"/zones/{name}")][-1]


def camera(**zones: dict[str, Any]) -> CameraConfig:
    cam: dict[str, Any] = {"url": "/v.mp4", "model": "d", "zones": zones}
    data = {"models": {"d": {"onnx": "/m.onnx"}}, "cameras": {"cam": cam}}
    return parse_config(data).cameras["cam"]


def test_the_event_and_the_retained_state() -> None:
    out = Out()
    cam = camera(
        right={"polygon": [list(p) for p in RIGHT], "loiter_s": 1}, left={"polygon": [list(p) for p in LEFT]}
    )
    events = CameraEvents("cam", cam, ["person", "bicycle", "car"], "labels.txt", out)
    events.publish_states()
    assert out.zone_state("right")["loitering"] == {"count": 0, "total": 0}
    assert "loitering" not in out.zone_state("left")  # no loiter_s: the state as it always was
    for i in range(50):  # 2 s at 25 fps in the right half
        dets = Detections(
            np.array([[IN - 20, 100, IN + 20, 200]], np.float32),
            np.ones(1, np.float32),
            np.zeros(1, np.int32),
        )
        events(
            Frame("cam", i, np.zeros((500, 1000, 3), np.uint8), 1000.0 + i / 25, {"captured": i / 25}), dets
        )
    (enter,) = out.events("zone_enter")
    (loiter,) = out.events("zone_loiter")
    assert list(loiter) == [
        "schema",
        "ts",
        "camera",
        "type",
        "zone",
        "track_id",
        "label",
        "class_id",
        "frame_id",
        "dwell_s",
        "count",
        "loitering",
    ]
    assert (
        loiter["zone"] == "right" and loiter["track_id"] == enter["track_id"] and loiter["label"] == "person"
    )
    assert loiter["dwell_s"] == pytest.approx(1.0, abs=0.04) and loiter["count"] == 1
    assert loiter["loitering"] == {"count": 1, "total": 1}
    assert loiter["frame_id"] - enter["frame_id"] == 25 and loiter["ts"] > enter["ts"]
    assert out.zone_state("right")["loitering"] == {"count": 1, "total": 1}
    assert events.stats()["events"]["zone_loiter"] == 1
    events.close("stopped", clear=False)
    assert out.zone_state("right")["loitering"] == {"count": 0, "total": 1}
    assert out.zone_state("right")["count"] == 0


# ---- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, "must be > 0"),
        (-5, "must be > 0"),
        (86401, "must be <= 86400"),
        ("30", "must be a number, not a string"),
        (True, "must be a number, not true/false"),
    ],
)
def test_loiter_s_errors_name_the_file_and_the_key(tmp_path: Path, value: object, error: str) -> None:
    path = tmp_path / "agent.yaml"
    cfg = {
        "models": {"d": {"onnx": "/m.onnx"}},
        "cameras": {
            "gate": {
                "url": "/v.mp4",
                "model": "d",
                "zones": {"porch": {"polygon": [list(p) for p in RIGHT], "loiter_s": value}},
            }
        },
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML
    with pytest.raises(ConfigError, match=rf"^{path}: cameras\.gate\.zones\.porch\.loiter_s: {error}"):
        load_config(path)


def test_loiter_s_is_off_by_default_and_reaches_the_analytics() -> None:
    assert camera(z={"polygon": [list(p) for p in RIGHT]}).zones["z"].loiter_s is None
    cam = camera(z={"polygon": [list(p) for p in RIGHT], "loiter_s": 86400})
    events = CameraEvents("cam", cam, ["person"], "labels.txt", Out())
    assert events.analytics.zones.specs[0].param("loiter_s") == 86400.0
    assert [type(r) for r in events.analytics.zones.rules] == [Loitering]


def test_a_loiter_s_change_is_applied_in_place_by_a_reload() -> None:
    from agent.config.reload import plan_reload

    def config(**zone: Any) -> Any:
        gate = {"url": "/v.mp4", "model": "d", "zones": {"z": {"polygon": [list(p) for p in RIGHT], **zone}}}
        return parse_config({"models": {"d": {"onnx": "/m.onnx"}}, "cameras": {"gate": gate}})

    for before, after in (
        ({}, {"loiter_s": 10}),
        ({"loiter_s": 10}, {"loiter_s": 20}),
        ({"loiter_s": 10}, {}),
    ):
        plan = plan_reload(config(**before), config(**after))
        assert plan.cameras_analytics == ["gate"] and not plan.cameras_restarted, (before, after)
