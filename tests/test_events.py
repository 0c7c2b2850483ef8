"""Events of a camera's tracks, zones and lines (agent.events) as they go to MQTT, with a recording
publisher: order, payloads, rate limits, retained states, resets from another thread, reconfiguration,
snapshots, and the message count with `publish.detections: off` on the bundled clip."""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.bench.track_eval import load_recorded
from agent.config import CameraConfig, ConfigError, parse_config
from agent.events import CameraEvents, track_floor
from agent.mqtt.topics import Topics
from agent.results import detection_fields
from agent.runtime.cameras import CameraRuntime
from agent.runtime.sinks import detections_due
from pipelines.frames import Detections, Frame
from pipelines.postprocess import load_labels
from pipelines.scheduler import Result
from pipelines.tracking import ID

REPO = Path(__file__).resolve().parents[1]
LABELS = load_labels(REPO / "agent" / "assets" / "coco.names")
RECORDED = Path(__file__).parent / "data" / "bikes_detections.npz"
PERSON, CAR = 0, 2
RIGHT_THIRD = [[0.66, 0], [1, 0], [1, 1], [0.66, 1]]
SIZE = (640, 272)


class Out:
    """agent.events.Publisher that records (topic, payload, retained, qos)."""

    def __init__(self) -> None:
        self.topics = Topics("edge-agent", "dev")
        self.messages: list[tuple[str, bytes, bool, int]] = []
        self.online = True
        self._lock = threading.Lock()

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None:
        with self._lock:
            self.messages.append((topic, body, state, qos))

    def connected(self) -> bool:
        return self.online

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(b) for t, b, _, _ in self.messages if t.endswith("/events")]

    def retained(self, kind: str) -> dict[str, dict[str, Any] | None]:
        """Latest retained payload per zone/line topic (None: deleted)."""
        out: dict[str, dict[str, Any] | None] = {}
        for t, b, state, _ in self.messages:
            if state and f"/{kind}/" in t:
                out[t.rsplit("/", 1)[1]] = json.loads(b) if b else None
        return out


def camera(**settings: Any) -> CameraConfig:
    cfg = parse_config(
        {
            "models": {"d": {"onnx": "/m.onnx"}},
            "cameras": {"cam": {"url": "/v.mp4", "model": "d", **settings}},
        }
    )
    return cfg.cameras["cam"]


class Feed:
    """Frames at 25 fps through a camera's events, the way the scheduler's route calls it."""

    def __init__(self, events: CameraEvents) -> None:
        self.events = events
        self.n = 0
        self.image = np.full((SIZE[1], SIZE[0], 3), 90, np.uint8)

    def frame(self, *objects: tuple[float, float, int], score: float = 0.9) -> Any:
        """Objects as (bottom-centre x, y, class), boxes 40 x 100 pixels."""
        n = len(objects)
        boxes = [(x - 20, y - 100, x + 20, y) for x, y, _ in objects]
        dets = Detections(
            np.asarray(boxes, np.float32).reshape(n, 4),
            np.full(n, score, np.float32),
            np.asarray([c for *_, c in objects], np.int32),
        )
        t = self.n / 25
        frame = Frame("cam", self.n, self.image, 1000.0 + t, {"captured": t})
        self.n += 1
        return self.events(frame, dets)


def events_of(cam: CameraConfig) -> tuple[CameraEvents, Out, Feed]:
    out = Out()
    events = CameraEvents("cam", cam, LABELS, "coco.names", out)
    return events, out, Feed(events)


# ---- object events ----
def test_object_lifecycle_new_zone_update_end() -> None:
    _events, out, feed = events_of(
        camera(
            zones={"right": {"polygon": RIGHT_THIRD}},
            events={"update_interval_s": 0.5},
            tracking={"max_lost_s": 0.3},
        )
    )
    for x in range(200, 600, 8):  # into the right third
        feed.frame((x, 200, PERSON))
    for _ in range(20):
        feed.frame()
    kinds = [(e["type"], e.get("track_id")) for e in out.events()]
    assert kinds[0] == ("new", 1)
    assert ("zone_enter", 1) in kinds and ("update", 1) in kinds  # the zone change made an update due
    assert kinds[-2:] == [("zone_leave", 1), ("end", 1)]  # its zones are left first
    new, end = out.events()[0], out.events()[-1]
    assert new["schema"] == "edge-agent/event/1" and new["camera"] == "cam" and new["label"] == "person"
    assert new["zones"] == [] and set(new) >= {"first_seen", "last_seen", "score", "box", "best", "frame_id"}
    update = [e for e in out.events() if e["type"] == "update"][-1]
    assert update["zones"] == ["right"] and update["entered_zones"] == ["right"]
    assert end["reason"] == "lost" and end["zones"] == [] and end["entered_zones"] == ["right"]
    assert end["duration_s"] == pytest.approx(end["last_seen"] - end["first_seen"], abs=1e-3)
    assert end["best"]["score"] == pytest.approx(0.9) and end["snapshot"] is False
    leave = out.events()[-2]
    assert leave["reason"] == "lost" and leave["dwell_s"] > 0 and leave["count"] == 0
    for _, _, _state, qos in out.messages:
        assert qos == 1  # events and states: QoS 1


def test_updates_are_rate_limited_and_need_a_meaningful_change() -> None:
    _events, out, feed = events_of(camera(events={"update_interval_s": 1.0, "update_move": 0.1}))
    for _ in range(100):  # 4 s standing still: no update
        feed.frame((300, 200, PERSON))
    assert [e["type"] for e in out.events()] == ["new"]
    for x in range(300, 640, 4):  # walking: moved 10 % of the diagonal (70 px) ... at most 1 per second
        feed.frame((x, 200, PERSON))
    updates = [e for e in out.events() if e["type"] == "update"]
    assert 2 <= len(updates) <= 4
    gaps = np.diff([e["ts"] for e in updates])
    assert (gaps >= 1.0 - 1e-6).all()


def test_objects_in_zones_and_none() -> None:
    zones = {"right": {"polygon": RIGHT_THIRD}}
    _, out, feed = events_of(
        camera(zones=zones, events={"objects": "in_zones"}, tracking={"max_lost_s": 0.2})
    )
    for x in range(100, 300, 8):  # never in the zone: no object events at all
        feed.frame((x, 200, PERSON), (100 + x, 250, CAR))
    for x in range(300, 600, 8):  # the person enters: `new` comes with its first zone entry
        feed.frame((x, 200, PERSON))
    for _ in range(15):
        feed.frame()
    kinds = [(e["type"], e.get("label")) for e in out.events()]
    assert kinds == [("new", "person"), ("zone_enter", "person"), ("zone_leave", "person"), ("end", "person")]
    _, out, feed = events_of(camera(zones=zones, events={"objects": "none"}, tracking={"max_lost_s": 0.2}))
    for x in range(300, 600, 8):
        feed.frame((x, 200, PERSON))
    for _ in range(15):
        feed.frame()
    assert [e["type"] for e in out.events()] == ["zone_enter", "zone_leave"]


def test_min_duration_holds_new_until_the_track_has_lived_that_long() -> None:
    """`events.min_duration_s: 1`: a person seen for 0.4 s (a flicker) has neither `new` nor `end`; one
    seen for 3 s gets its `new` once it has been followed 1 s, then its `end`."""
    _, out, feed = events_of(camera(events={"min_duration_s": 1.0}, tracking={"max_lost_s": 0.2}))
    for _ in range(10):  # 0.4 s
        feed.frame((100, 200, PERSON))
    for _ in range(15):
        feed.frame()
    assert out.events() == []
    for _ in range(75):  # 3 s
        feed.frame((400, 200, PERSON))
    for _ in range(15):
        feed.frame()
    events = out.events()
    assert [e["type"] for e in events] == ["new", "end"], events
    new, end = events
    assert new["last_seen"] - new["first_seen"] == pytest.approx(1.0, abs=0.05)
    assert end["track_id"] == new["track_id"] and end["duration_s"] == pytest.approx(2.96, abs=0.05)


def test_min_duration_with_objects_in_zones_keeps_every_zone_event() -> None:
    """in_zones + min_duration_s: a short visit to the zone still gives its enter and leave, no object
    events; a long one gives `new` once it has lived min_duration_s and is in a zone, before its leave."""
    zones = {"right": {"polygon": RIGHT_THIRD}}
    _, out, feed = events_of(
        camera(
            zones=zones, events={"objects": "in_zones", "min_duration_s": 1.0}, tracking={"max_lost_s": 0.2}
        )
    )
    for _ in range(8):  # 0.32 s, in the zone
        feed.frame((550, 200, PERSON))
    for _ in range(15):
        feed.frame()
    assert [e["type"] for e in out.events()] == ["zone_enter", "zone_leave"]
    for x in range(100, 600, 5):  # 4 s: 2.6 s outside the zone, then in it
        feed.frame((x, 200, PERSON))
    for _ in range(15):
        feed.frame()
    kinds = [e["type"] for e in out.events()[2:]]
    assert kinds == ["new", "zone_enter", "zone_leave", "end"], kinds


def test_events_off_still_counts() -> None:
    events, out, feed = events_of(
        camera(zones={"right": {"polygon": RIGHT_THIRD}}, events={"enabled": False})
    )
    for x in range(300, 600, 8):
        feed.frame((x, 200, PERSON))
    assert out.events() == []
    assert out.retained("zones")["right"] == {**out.retained("zones")["right"], "occupied": True, "count": 1}
    assert events.stats()["tracks_started"] == 1


# ---- retained zone and line states ----
def test_zone_and_line_states_are_retained_and_published_on_change() -> None:
    events, out, feed = events_of(
        camera(
            zones={"right": {"polygon": RIGHT_THIRD, "labels": ["person", "car"]}},
            lines={"mid": {"points": [[0.5, 0], [0.5, 1]]}},
        )
    )
    events.publish_states()
    zone, line = out.retained("zones")["right"], out.retained("lines")["mid"]
    assert zone is not None and line is not None
    assert zone["schema"] == "edge-agent/zone/1" and zone["occupied"] is False and zone["count"] == 0
    assert zone["counts"] == {"person": 0, "car": 0}  # every counted label, zeros included
    assert line["schema"] == "edge-agent/line/1" and line["counts"] == {"in": 0, "out": 0}
    before = len(out.messages)
    for _ in range(20):
        feed.frame((100, 200, PERSON))
    assert len(out.messages) == before + 1  # its `new` only: no state changed
    for x in range(100, 600, 8):
        feed.frame((x, 200, PERSON), (80, 250, CAR))
    zone, line = out.retained("zones")["right"], out.retained("lines")["mid"]
    assert zone is not None and zone["counts"] == {"person": 1, "car": 0} and zone["occupied"] is True
    assert line is not None and line["counts"] == {"in": 0, "out": 1}
    assert line["by_label"]["person"] == {"in": 0, "out": 1}
    cross = next(e for e in out.events() if e["type"] == "line_cross")
    assert cross["line"] == "mid" and cross["direction"] == "out" and cross["counts"] == {"in": 0, "out": 1}
    states = [t for t, _, state, _ in out.messages if state]
    assert len(states) == len(set(states)) + 2  # one zone change and one line change after the first states
    stats = events.stats()
    assert stats["zones"] == {"right": {"person": 1, "car": 0}} and stats["lines"] == {
        "mid": {"in": 0, "out": 1}
    }


def test_reconfigure_deletes_removed_zones_and_keeps_the_rest() -> None:
    zones = {"right": {"polygon": RIGHT_THIRD}, "left": {"polygon": [[0, 0], [0.3, 0], [0.3, 1], [0, 1]]}}
    events, out, feed = events_of(camera(zones=zones, lines={"mid": {"points": [[0.5, 0], [0.5, 1]]}}))
    events.publish_states()
    for x in range(200, 600, 8):
        feed.frame((x, 200, PERSON))
    events.reconfigure(camera(zones={"right": zones["right"]}), LABELS, "coco.names")
    assert out.retained("zones") == {**out.retained("zones"), "left": None}  # deleted (empty retained)
    assert out.retained("lines")["mid"] is None
    right = out.retained("zones")["right"]
    assert right is not None and right["count"] == 1  # unchanged zone: its state goes on
    feed.frame((590, 200, PERSON))
    assert [e["type"] for e in out.events()].count("zone_enter") == 1  # no second enter


def test_unknown_zone_label_against_the_model_labels() -> None:
    with pytest.raises(ConfigError, match=r"cameras\.cam\.zones\.z\.labels: unknown label 'unicorn'"):
        CameraEvents(
            "cam", camera(zones={"z": {"polygon": RIGHT_THIRD, "labels": ["unicorn"]}}), LABELS, "x", Out()
        )


# ---- resets ----
def test_reset_from_another_thread_never_reorders_a_track() -> None:
    """The reader thread resets (reconnect) while frames go through: per track, `new` comes first, one `end`
    last, zone enters and leaves alternate."""
    events, out, feed = events_of(camera(zones={"right": {"polygon": RIGHT_THIRD}}))
    stop = threading.Event()

    def resets() -> None:
        while not stop.is_set():
            events.reset("reconnect")

    thread = threading.Thread(target=resets)
    thread.start()
    try:
        for i in range(400):
            x = 100 + (i * 7) % 500
            feed.frame((x, 200, PERSON), (600 - (i * 5) % 500, 260, CAR))
    finally:
        stop.set()
        thread.join()
    per_track: dict[int, list[str]] = {}
    for e in out.events():
        per_track.setdefault(e["track_id"], []).append(e["type"])
    assert per_track
    for track, kinds in per_track.items():
        objects = [k for k in kinds if k in ("new", "update", "end")]
        assert objects[0] == "new" and objects.count("new") == 1, (track, kinds)
        assert objects.count("end") <= 1 and (objects[-1] == "end" or "end" not in objects), (track, kinds)
        zone = [k for k in kinds if k.startswith("zone")]
        assert all(a != b for a, b in itertools.pairwise(zone)), (track, kinds)
        if "end" in kinds:
            assert kinds[-1] == "end"


def test_close_clears_retained_states() -> None:
    events, out, _ = events_of(camera(zones={"right": {"polygon": RIGHT_THIRD}}))
    events.publish_states()
    events.close("removed", clear=True)
    assert out.retained("zones") == {"right": None}


# ---- snapshots ----
def test_best_detection_snapshot_follows_end_rate_limited() -> None:
    _events, out, feed = events_of(
        camera(events={"snapshot": {"enabled": True, "min_interval_s": 60}}, tracking={"max_lost_s": 0.2})
    )
    for score in (0.5, 0.95, 0.6, 0.7):  # the best is the second frame's
        feed.frame((300, 200, PERSON), score=score)
    for _ in range(10):
        feed.frame()
    for _ in range(3):
        feed.frame((100, 200, CAR))
    for _ in range(10):
        feed.frame()
    ends = [e for e in out.events() if e["type"] == "end"]
    assert [e["snapshot"] for e in ends] == [True, False]  # the second within min_interval_s
    jpegs = [(t, b) for t, b, _, _ in out.messages if t.endswith("/snapshot")]
    assert [t for t, _ in jpegs] == ["edge-agent/dev/cameras/cam/tracks/1/snapshot"]
    image = __import__("cv2").imdecode(np.frombuffer(jpegs[0][1], np.uint8), 1)
    assert image.shape[:2] == (130, 52)  # the 40 x 100 box plus 15 % on each side


def test_no_snapshot_while_offline() -> None:
    _events, out, feed = events_of(
        camera(events={"snapshot": {"enabled": True}}, tracking={"max_lost_s": 0.2})
    )
    out.online = False
    for _ in range(3):
        feed.frame((300, 200, PERSON))
    for _ in range(10):
        feed.frame()
    assert [e["snapshot"] for e in out.events() if e["type"] == "end"] == [False]


# ---- detections payload and publish modes ----
def test_track_ids_in_the_detections_payload() -> None:
    _events, _, feed = events_of(camera())
    feed.frame((300, 200, PERSON))
    analysis = feed.frame((302, 200, PERSON), (500, 200, CAR))
    frame = Frame("cam", 1, feed.image, 1000.0)
    result = Result(frame, analysis.detections, "d", "onnxruntime", "fp32", 1, analysis=analysis)
    items = detection_fields(result, LABELS)["detections"]
    assert [(d["label"], d["track_id"]) for d in items] == [("person", 1), ("car", None)]  # car: not yet
    plain = Result(frame, analysis.detections, "d", "onnxruntime", "fp32", 1)
    assert all("track_id" not in d for d in detection_fields(plain, LABELS)["detections"])


def test_publish_detections_modes() -> None:
    cam_cfg = camera(publish={"detections": "on_change"})
    _events, _, feed = events_of(cam_cfg)
    runtime = CameraRuntime("cam", cam_cfg, reader=None)  # type: ignore[arg-type]
    due = []
    for i in range(30):
        objects = [(300 + i, 200, PERSON)] + ([(500, 200, CAR)] if 10 <= i < 20 else [])
        a = feed.frame(*objects)
        result = Result(Frame("cam", i, feed.image, 0.0), a.detections, "d", "ort", "fp32", 1, analysis=a)
        due.append(detections_due(runtime, result))
    # First frame; person confirmed (id); car appears, car confirmed; car gone: 5 messages of 30.
    assert sum(due) == 5 and due[0] and due[1] and due[10] and due[11] and due[20]
    runtime.cfg = camera(publish={"detections": "off"})
    assert not detections_due(runtime, result)


# ---- the bundled clip ----
def clip_messages(settings: dict[str, Any]) -> tuple[int, Counter[str], CameraEvents]:
    per_frame, fps, _ = load_recorded(RECORDED)
    cam = camera(**settings)
    events, out, feed = events_of(cam)
    events.publish_states()
    first = len(out.messages)
    floor = track_floor(cam)
    for i, d in enumerate(per_frame):
        frame = Frame("cam", i, feed.image, 1000 + i / fps, {"captured": i / fps})
        events(frame, d.select(d.scores >= floor))
    kinds = Counter(
        json.loads(b)["type"] if t.endswith("/events") else t.split("/")[-2]
        for t, b, _, _ in out.messages[first:]
    )
    return len(out.messages) - first, kinds, events


def test_events_only_cut_the_messages_tenfold_on_the_bundled_clip() -> None:
    """The clip's 250 frames would be 250 detections messages; with `publish.detections: off`, a zone for
    people and zone events only (`events.objects: none`), at most a tenth of that, and every zone entry and
    exit the analytics saw is among them."""
    zone = {"z": {"polygon": RIGHT_THIRD, "labels": ["person"]}}
    n, kinds, events = clip_messages(
        {"zones": zone, "events": {"objects": "none"}, "publish": {"detections": "off"}}
    )
    assert n * 10 <= 250, kinds
    assert kinds["zone_enter"] >= 3 and kinds["zone_enter"] == events.counts["zone_enter"]
    assert kinds["zone_leave"] == events.counts["zone_leave"]
    # The others, for the record (README): every object's new/end cost more on this montage of short shots.
    n_all, kinds_all, _ = clip_messages({"zones": zone})
    assert kinds_all["new"] >= kinds_all["end"] >= kinds["zone_leave"] and n_all > n
    # Object events for objects followed at least a second (events.min_duration_s): the flickers of the
    # montage are no events, the people and cars that stay are; a tenth of the messages again.
    n_obj, kinds_obj, events_obj = clip_messages(
        {"events": {"min_duration_s": 1.0}, "publish": {"detections": "off"}}
    )
    assert n_obj * 10 <= 250 and kinds_obj["new"] >= 3, kinds_obj
    assert kinds_obj["new"] + kinds_obj["end"] == n_obj and events_obj.tracks_started > kinds_obj["new"]


def test_a_failing_analytics_reports_untracked_and_ends_its_tracks(monkeypatch: pytest.MonkeyPatch) -> None:
    events, out, feed = events_of(camera())
    for _ in range(3):
        feed.frame((300, 200, PERSON))

    def broken(*_: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(events.analytics, "process", broken)
    analysis = feed.frame((300, 200, PERSON), (500, 200, CAR), score=0.3)  # 0.3: below min_score 0.4
    assert len(analysis.detections) == 0 and analysis.track_ids.tolist() == []
    analysis = feed.frame((300, 200, PERSON))  # a fresh analytics object serves again ...
    assert len(analysis.detections) == 1
    feed.frame((300, 200, PERSON))
    assert events.analytics.tracker.table[ID].tolist() == [2]  # ... and never reuses an id
    assert [(e["type"], e["track_id"], e.get("reason")) for e in out.events()] == [
        ("new", 1, None),
        ("end", 1, "error"),
        ("new", 2, None),
    ]
    assert events.stats()["events"]["errors"] == 1
