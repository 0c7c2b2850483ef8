"""Tracker edge cases found on real trajectories (issue 36: 6), on the compiled kernel and the numpy code:
non-finite frame times, a lost track past ``max_lost_s`` is not re-found, ``next_id`` is an int."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.analytics import AnalyticsSettings, CameraAnalytics
from pipelines.frames import Detections
from pipelines.regions import RegionSpec
from pipelines.tracking import ID, LAST_T, Tracker, TrackerParams

SIZE = (1000, 1000)
BOX = (400.0, 400.0, 500.0, 600.0)  # its bottom centre (450, 600) is inside ZONE
ZONE = RegionSpec("zone", "z", ((0.3, 0.3), (0.7, 0.3), (0.7, 0.7), (0.3, 0.7)), inertia=1)
PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])


def one(box: tuple[float, float, float, float] = BOX) -> Detections:
    return Detections(np.asarray([box], np.float32), np.asarray([0.9], np.float32), np.zeros(1, np.int32))


def analytics(compiled: bool) -> CameraAnalytics:
    settings = AnalyticsSettings(TrackerParams(max_lost_s=0.5), 0.4, 2.0, (ZONE,))
    an = CameraAnalytics(settings, 1, compiled=compiled)
    assert an.tracker.compiled is compiled
    return an


@PATHS
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_frame_time_does_not_make_tracks_immortal(compiled: bool, bad: float) -> None:
    """A frame with a NaN or infinite time (t and ts) in the middle of a track: the track still ends
    ``max_lost_s`` after its last detection, leaving its zone, and the count goes back to 0."""
    an = analytics(compiled)
    kinds: list[str] = []
    ended = 0
    for i in range(40):
        t = i * 0.04
        seen = i < 10 or i == 10  # frame 10 is the last with the object, and has the bad time
        ft = bad if i == 10 else t
        a = an.process(one() if seen else Detections.empty(), ft, 1e9 + ft, i, SIZE)
        assert all(math.isfinite(v) for v in an.tracker.table[LAST_T]), f"frame {i}"
        kinds += [tr.kind for tr in a.transitions]
        ended += len(a.step.ended) if a.step.ended is not None else 0
    assert kinds == ["zone_enter", "zone_leave"]
    assert ended == 1 and len(an.tracker) == 0 and int(an.zones.counts.sum()) == 0


@PATHS
def test_a_bad_time_takes_the_previous_one_plus_a_nominal_frame(compiled: bool) -> None:
    tracker = Tracker(compiled=compiled)
    assert tracker.update(one(), math.nan, math.nan).det_rows.tolist() == [-1]  # no time to stand in for it
    assert len(tracker) == 0
    tracker.update(one(), 5.0, 100.0)
    tracker.update(one(), math.nan, math.inf)
    assert tracker.t == pytest.approx(5.04)
    assert tracker.table[LAST_T].tolist() == [pytest.approx(5.04)]
    assert tracker.admit(5.08, 100.08) == (5.08, 100.08)  # finite times pass as they are


@PATHS
def test_a_lost_track_past_max_lost_s_is_not_found_again(compiled: bool) -> None:
    """The object is seen, then the next frame comes 1.6 s later (the camera dropped frames; less than
    reset_gap_s) with a new detection where the old track was: the old track ended (1.5 s), the detection
    starts a new track instead of continuing the old one's id."""
    tracker = Tracker(TrackerParams(max_lost_s=1.5), compiled=compiled)
    for i in range(5):
        tracker.update(one(), i * 0.04, i * 0.04)
    assert tracker.table[ID].tolist() == [1.0]
    t = 0.16 + 1.6
    step = tracker.update(one(), t, t)
    assert step.ended is not None and step.ended.table[ID].tolist() == [1.0]  # ended, reason "lost"
    assert step.ids.tolist() == [0]  # a new, tentative track: no id yet
    tracker.update(one(), t + 0.04, t + 0.04)
    assert tracker.table[ID].tolist() == [2.0]


@PATHS
def test_a_lost_track_within_max_lost_s_is_found_again(compiled: bool) -> None:
    tracker = Tracker(TrackerParams(max_lost_s=1.5), compiled=compiled)
    for i in range(5):
        tracker.update(one(), i * 0.04, i * 0.04)
    step = tracker.update(one(), 0.16 + 1.4, 0.16 + 1.4)
    assert step.ended is None and step.ids.tolist() == [1]


@PATHS
def test_next_id_is_an_int(compiled: bool) -> None:
    tracker = Tracker(first_id=np.int64(7), compiled=compiled)  # type: ignore[arg-type]
    for i in range(3):
        tracker.update(one(), i * 0.04, i * 0.04)
    assert type(tracker.next_id) is int and tracker.next_id == 8
    tracker = Tracker(TrackerParams(min_hits=1), compiled=compiled)
    tracker.update(one(), 0.0, 0.0)
    assert type(tracker.next_id) is int and tracker.next_id == 2


def test_the_kernel_refuses_non_finite_times() -> None:
    """Behind ``Tracker.update`` (which repairs them) the compiled step refuses them outright."""
    tracker = Tracker()
    assert tracker.compiled
    d = one()
    for t, ts, k in ((math.nan, 0.0, 0.0), (0.0, math.inf, 0.0), (0.0, 0.0, math.nan)):
        with pytest.raises(ValueError, match="finite"):
            tracker._kernel.update(tracker.table, d.boxes, d.scores, d.class_ids, t, ts, 0, k, 1)
