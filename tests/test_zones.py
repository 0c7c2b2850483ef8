"""Zones and lines (pipelines.zones, .lines) through a camera's analytics, on scripted boxes."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.analytics import Analysis, AnalyticsSettings, CameraAnalytics
from pipelines.frames import Detections
from pipelines.regions import RegionSpec, Transition, polygon_problem, segment_problem
from pipelines.tracking import ID, TrackerParams

SIZE = (1000, 500)
PERSON, CAR = 0, 2
RIGHT_HALF = RegionSpec("zone", "right", ((0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0)))
MIDDLE = RegionSpec("line", "middle", ((0.5, 0.0), (0.5, 1.0)))  # A above B: "in" is right to left


def analytics(
    zones: tuple[RegionSpec, ...] = (), lines: tuple[RegionSpec, ...] = (), **tracker: float
) -> CameraAnalytics:
    params = TrackerParams(**{"high_score": 0.4, "min_hits": 2, **tracker})  # type: ignore[arg-type]
    return CameraAnalytics(AnalyticsSettings(params, 0.4, 2.0, zones, lines), 80)


class Walk:
    """Feeds one camera's analytics frame by frame (25 fps) and keeps every transition."""

    def __init__(self, an: CameraAnalytics) -> None:
        self.an = an
        self.frame = 0
        self.log: list[tuple[int, Transition]] = []

    def step(self, *objects: tuple[float, float, int], w: float = 40, h: float = 100) -> Analysis:
        """Objects as (bottom-centre x, y, class) in pixels."""
        boxes = [(x - w / 2, y - h, x + w / 2, y) for x, y, _ in objects]
        n = len(objects)
        dets = Detections(
            np.asarray(boxes, np.float32).reshape(n, 4),
            np.full(n, 0.9, np.float32),
            np.asarray([c for _, _, c in objects], np.int32),
        )
        t = self.frame / 25
        a = self.an.process(dets, t, 1000.0 + t, self.frame, SIZE)
        self.log += [(self.frame, tr) for tr in a.transitions]
        self.frame += 1
        return a

    def kinds(self) -> list[tuple[str, int, str | None]]:
        return [(tr.kind, tr.track_id, tr.direction or tr.reason) for _, tr in self.log]


# ---- geometry checks ----
@pytest.mark.parametrize(
    ("points", "problem"),
    [
        ([(0, 0), (1, 0), (1, 1), (0, 1)], None),
        ([(0, 0), (1, 0), (0.2, 0.1), (0.5, 1)], None),  # concave is fine
        ([(0, 0), (1, 1), (1, 0), (0, 1)], "edges 1 ([0, 0]-[1, 1]) and 3 ([1, 0]-[0, 1]) cross"),
        ([(0, 0), (1, 0)], "at least 3 points"),
        ([(0, 0), (1, 0), (2, 0)], "no area"),
        ([(0, 0), (1, 0), (1, 0), (0, 1)], "points 2 and 3 are the same"),
        ([(0, 1), (0, 0), (2, 0), (1, 0)], "cross or touch"),  # edge 3 runs back along edge 2
        ([(0, 0), (1, 0), (1, 1), (0.5, 0), (0, 1)], "cross or touch"),  # a corner on another edge
        ([(float(i), float(i % 2)) for i in range(70)], "at most 64 points"),
    ],
)
def test_polygon_problems(points: list[tuple[float, float]], problem: str | None) -> None:
    found = polygon_problem(points)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_segment_problems() -> None:
    assert segment_problem([(0, 0), (1, 1)]) is None
    assert "degenerate" in (segment_problem([(0.5, 0.5), (0.5, 0.5)]) or "")
    assert "exactly 2 points" in (segment_problem([(0, 0), (1, 1), (2, 2)]) or "")


# ---- zones ----
def test_enter_and_leave_a_zone_with_inertia_and_dwell() -> None:
    walk = Walk(analytics(zones=(RIGHT_HALF,)))
    for x in range(300, 700, 10):  # left to right across x = 500 (the zone starts there)
        walk.step((x, 300, PERSON))
    enters = [(f, tr) for f, tr in walk.log if tr.kind == "zone_enter"]
    assert len(enters) == 1 and enters[0][1].track_id == 1
    first_inside = next(f for f, x in enumerate(range(300, 700, 10)) if x > 500)
    assert enters[0][0] == first_inside + 1  # inertia 2: the second frame inside
    assert walk.an.zones.counts[0, PERSON] == 1
    for x in range(700, 300, -10):  # and back
        walk.step((x, 300, PERSON))
    leaves = [(f, tr) for f, tr in walk.log if tr.kind == "zone_leave"]
    assert len(leaves) == 1 and leaves[0][1].reason is None
    assert leaves[0][1].dwell_s == pytest.approx((leaves[0][0] - enters[0][0]) / 25)
    assert walk.an.zones.counts[0].sum() == 0


def test_a_track_confirmed_inside_enters_at_once_and_its_end_leaves() -> None:
    walk = Walk(analytics(zones=(RIGHT_HALF,), max_lost_s=0.2))
    for _ in range(3):
        walk.step((800, 300, PERSON))
    assert walk.kinds() == [("zone_enter", 1, None)] and walk.log[0][0] == 1  # confirmed in frame 1
    for _ in range(10):
        walk.step()
    assert walk.kinds()[-1] == ("zone_leave", 1, "lost")
    assert walk.an.zones.counts.sum() == 0


def test_a_short_occlusion_is_no_leave() -> None:
    walk = Walk(analytics(zones=(RIGHT_HALF,)))
    for _ in range(5):
        walk.step((800, 300, PERSON))
    for _ in range(10):  # 0.4 s unseen: the track is lost, not ended, and stays in the zone
        walk.step()
    assert walk.kinds() == [("zone_enter", 1, None)]
    assert walk.an.zones.counts[0, PERSON] == 1
    walk.step((800, 300, PERSON))
    assert walk.kinds() == [("zone_enter", 1, None)]


def test_labels_anchor_and_counts_by_label() -> None:
    cars_only = RegionSpec("zone", "lot", RIGHT_HALF.points, labels=(CAR,))
    top = RegionSpec("zone", "top", ((0.0, 0.0), (1.0, 0.0), (1.0, 0.5), (0.0, 0.5)), anchor="top_center")
    walk = Walk(analytics(zones=(cars_only, top)))
    for _ in range(3):
        walk.step((800, 300, PERSON), (600, 300, CAR), (200, 300, CAR))
    lot = walk.an.zones.counts[0]
    assert lot[CAR] == 1 and lot[PERSON] == 0  # the person is in the polygon but not counted
    # Bottom-centre anchors at y = 300 are below "top"; its top-centre anchors (y = 200) are inside.
    assert walk.an.zones.counts[1, CAR] == 2 and walk.an.zones.counts[1, PERSON] == 1


def test_pixel_points_follow_a_stream_of_another_size() -> None:
    # Drawn on a 2000 x 1000 picture; the stream is 1000 x 500.
    zone = RegionSpec(
        "zone", "px", ((1000, 0), (2000, 0), (2000, 1000), (1000, 1000)), frame_size=(2000, 1000)
    )
    walk = Walk(analytics(zones=(zone,)))
    for _ in range(3):
        walk.step((800, 300, PERSON), (200, 300, CAR))
    assert walk.an.zones.counts[0].sum() == 1 and walk.an.zones.counts[0, PERSON] == 1


# ---- lines ----
def test_line_direction_in_and_out() -> None:
    walk = Walk(analytics(lines=(MIDDLE,)))
    for x in range(300, 700, 10):
        walk.step((x, 300, PERSON))
    for x in range(700, 300, -10):
        walk.step((x, 300, PERSON))
    # A -> B points down; its right side (as seen on the picture) is x < 500: left to right is "out".
    assert walk.kinds() == [("line_cross", 1, "out"), ("line_cross", 1, "in")]
    assert walk.an.lines.counts[0, :, PERSON].tolist() == [1, 1]


def test_several_lines_with_their_own_anchors() -> None:
    lines = (MIDDLE, RegionSpec("line", "quarter", ((0.25, 1.0), (0.25, 0.0)), anchor="left_center"))
    walk = Walk(analytics(lines=lines))
    for x in range(100, 700, 10):
        walk.step((x, 300, PERSON))
    # "quarter" points up: left to right is "in"; its anchor (the box's left edge) crosses 20 px later.
    crossings = [(walk.an.lines.specs[tr.region].name, tr.direction) for _, tr in walk.log]
    assert crossings == [("quarter", "in"), ("middle", "out")]


def test_a_horizontal_line_drawn_left_to_right_counts_downwards_as_in() -> None:
    line = RegionSpec("line", "door", ((0.2, 0.5), (0.8, 0.5)))
    walk = Walk(analytics(lines=(line,)))
    for y in range(100, 450, 15):
        walk.step((500, y, PERSON))
    assert walk.kinds() == [("line_cross", 1, "in")]


def test_jitter_on_the_line_counts_nothing() -> None:
    walk = Walk(analytics(lines=(MIDDLE,)))
    rng = np.random.default_rng(0)
    for _ in range(60):
        walk.step((500 + float(rng.uniform(-4, 4)), 300, PERSON))  # within 5 % of the box height
    assert walk.kinds() == []


def test_passing_beyond_the_end_of_a_segment_is_no_crossing() -> None:
    short = RegionSpec("line", "short", ((0.5, 0.0), (0.5, 0.4)))  # ends at y = 200
    walk = Walk(analytics(lines=(short,)))
    for x in range(300, 700, 10):
        walk.step((x, 400, PERSON))  # below its end
    for y in range(400, 150, -10):
        walk.step((700, y, PERSON))
    for x in range(700, 300, -10):
        walk.step((x, 150, PERSON))  # across it
    assert walk.kinds() == [("line_cross", 1, "in")]


def test_line_labels() -> None:
    cars = RegionSpec("line", "cars", MIDDLE.points, labels=(CAR,))
    walk = Walk(analytics(lines=(cars,)))
    for x in range(300, 700, 20):
        walk.step((x, 300, PERSON), (x, 100, CAR), h=60)
    assert [k for k, *_ in walk.kinds()] == ["line_cross"] and walk.log[0][1].class_id == CAR


# ---- resets and reconfiguration ----
def test_a_frame_gap_ends_every_track_before_the_frame() -> None:
    an = analytics(zones=(RIGHT_HALF,))
    walk = Walk(an)
    for _ in range(3):
        walk.step((800, 300, PERSON))
    walk.frame += 100  # 4 s without frames (reset_gap_s is 2)
    a = walk.step((800, 300, PERSON))
    assert a.reset == "gap" and a.step.ended is not None
    assert a.step.ended.table[ID].tolist() == [1]
    assert ("zone_leave", 1, "gap") in walk.kinds()
    walk.step((800, 300, PERSON))
    assert an.tracker.table[ID].tolist() == [2]  # a new id, never the old one


def test_reset_reports_leaves_and_ends() -> None:
    an = analytics(zones=(RIGHT_HALF,))
    walk = Walk(an)
    for _ in range(3):
        walk.step((800, 300, PERSON), (200, 300, PERSON))
    a = an.reset("reconnect", 2000.0)
    ended = a.step.ended
    assert ended is not None and sorted(ended.table[ID].tolist()) == [1, 2]
    assert a.ended_zones is not None
    in_zone = {int(i): bool(z) for i, z in zip(ended.table[ID], a.ended_zones[:, 0], strict=True)}
    assert sum(in_zone.values()) == 1
    assert [(tr.kind, tr.reason) for tr in a.transitions] == [("zone_leave", "reconnect")]
    assert an.zones.counts.sum() == 0


def test_reconfigure_keeps_unchanged_zones_and_line_counts() -> None:
    left = RegionSpec("zone", "left", ((0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0)))
    an = analytics(zones=(RIGHT_HALF, left), lines=(MIDDLE,))
    walk = Walk(an)
    for x in range(300, 900, 20):
        walk.step((x, 300, PERSON))
    assert an.zones.counts[0, PERSON] == 1 and an.lines.counts[0].sum() == 1
    moved = RegionSpec("zone", "left", ((0.0, 0.0), (0.4, 0.0), (0.4, 1.0), (0.0, 1.0)))
    settings = AnalyticsSettings(an.settings.tracker, 0.4, 2.0, (moved, RIGHT_HALF), (MIDDLE,))
    assert an.reconfigure(settings, 2000.0) is None  # the tracker did not change: no reset
    assert [z.name for z in an.zones.specs] == ["left", "right"]
    assert an.zones.counts[1, PERSON] == 1 and an.zones.inside[:, 1].tolist() == [True]  # kept
    assert an.lines.counts[0].sum() == 1
    walk.step((900, 300, PERSON))
    assert walk.kinds()[-1][0] != "zone_enter"  # still inside "right": no new enter
    changed_tracker = AnalyticsSettings(TrackerParams(min_hits=3), 0.4, 2.0, (moved,), ())
    result = an.reconfigure(changed_tracker, 2001.0)
    assert result is not None and result.reset == "reconfigured"


def test_a_changed_or_removed_zone_gives_the_leaves_of_the_tracks_inside() -> None:
    """Issue 36.1: every enter has its leave across a reconfiguration; a kept zone keeps its state."""
    left = RegionSpec("zone", "left", ((0.0, 0.0), (0.5, 0.0), (0.5, 1.0), (0.0, 1.0)))
    whole = RegionSpec("zone", "whole", ((0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)))
    an = analytics(zones=(RIGHT_HALF, left, whole))
    walk = Walk(an)
    for _ in range(5):
        walk.step((800, 300, PERSON))
    assert an.zones.counts.sum(axis=1).tolist() == [1, 0, 1]
    moved = RegionSpec("zone", "right", ((0.6, 0.0), (1.0, 0.0), (1.0, 1.0), (0.6, 1.0)))
    settings = AnalyticsSettings(an.settings.tracker, 0.4, 2.0, (moved, left), ())
    leaves = an.leave_zones(settings.zones, 2000.0)
    assert leaves is not None and leaves.zones_changed
    assert [(tr.kind, an.zones.specs[tr.region].name, tr.reason) for tr in leaves.transitions] == [
        ("zone_leave", "right", "zone_changed"),
        ("zone_leave", "whole", "zone_removed"),
    ]
    assert an.zones.counts.sum() == 0
    assert an.reconfigure(settings, 2000.0) is None
    assert an.zones.visited[:, 0].tolist() == [True]  # the object's entered_zones still names "right"
    assert an.leave_zones(settings.zones, 2001.0) is None  # nothing changed: nobody leaves
    for _ in range(5):
        walk.step((800, 300, PERSON))
    assert walk.kinds()[-1][0] == "zone_enter"  # re-entered the changed zone by the normal rule
    assert an.zones.counts.sum(axis=1).tolist() == [1, 0]
