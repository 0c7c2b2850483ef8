"""The compiled tracking, zones and lines kernels (pipelines/kernels/*.pyx) against the numpy reference.

Both paths run side by side on the same frames; every result a caller sees must be identical: the track
table bit for bit, the step (detection -> track, ids, confirmed, improved, ended, row map), zone and line
states, transitions and counts. Scenes: the benchmark's synthetic crossings, occlusions and crowds, three
classes at once with label filters and mixed anchors, resets, a gap, a reconfiguration; and random
frames with ties (identical boxes), degenerate and non-finite boxes, unknown and negative class ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agent.bench.track_eval import SceneOptions, scene
from pipelines import kernels, regions, tracking
from pipelines.analytics import Analysis, AnalyticsSettings, CameraAnalytics
from pipelines.frames import Detections
from pipelines.lines import Lines
from pipelines.regions import RegionSpec
from pipelines.tracking import Tracker, TrackerParams
from pipelines.zones import Zones

SIZE = (1280, 720)
ZONES = (
    # Loitering (a zone rule: numpy on both paths, on the table the kernel updates) on two of the zones.
    RegionSpec("zone", "left", ((0.0, 0.5), (0.5, 0.5), (0.5, 1.0), (0.0, 1.0)), params=(("loiter_s", 0.3),)),
    RegionSpec("zone", "right", ((0.5, 0.5), (1.0, 0.5), (1.0, 1.0), (0.5, 1.0)), labels=(0, 2), inertia=3),
    RegionSpec(  # time-based inertia: 0.1 s from the streak's first frame (4 frames at 25 fps)
        "zone",
        "pent",
        ((0.1, 0.1), (0.4, 0.05), (0.45, 0.4), (0.2, 0.45), (0.05, 0.3)),
        anchor="center",
        inertia=1,
        inertia_s=0.1,
    ),
    RegionSpec(
        "zone",
        "quad",
        ((0.6, 0.0), (0.9, 0.1), (0.95, 0.45), (0.55, 0.3)),
        labels=(1,),
        inertia=1,
        params=(("loiter_s", 0.1),),
    ),
)
LINES = (
    RegionSpec("line", "v", ((0.5, 0.0), (0.5, 1.0))),
    RegionSpec("line", "h", ((0.0, 0.6), (1.0, 0.6)), labels=(1, 2), anchor="right_center"),
    RegionSpec("line", "short", ((0.3, 0.2), (0.7, 0.4)), labels=(0,)),
)


def _pair(settings: AnalyticsSettings, n_classes: int = 3) -> tuple[CameraAnalytics, CameraAnalytics]:
    fast, ref = CameraAnalytics(settings, n_classes), CameraAnalytics(settings, n_classes, compiled=False)
    assert fast.tracker.compiled and fast.zones._module is not None and fast.lines._module is not None
    assert not ref.tracker.compiled and ref.zones._module is None and ref.lines._module is None
    return fast, ref


def _same(a: np.ndarray | None, b: np.ndarray | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None and b is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), what


def _compare(fa: CameraAnalytics, ra: CameraAnalytics, x: Analysis, y: Analysis, where: str) -> None:
    assert x.transitions == y.transitions, where
    assert (x.zones_changed, x.lines_changed, x.reset) == (y.zones_changed, y.lines_changed, y.reset), where
    for name in ("track_ids", "active", "table", "inside", "ended_zones"):
        _same(getattr(x, name), getattr(y, name), f"{where}: {name}")
    for name in ("boxes", "scores", "class_ids"):
        _same(getattr(x.detections, name), getattr(y.detections, name), f"{where}: detections.{name}")
    for name in ("det_rows", "confirmed", "improved", "row_map", "ids", "active"):
        _same(getattr(x.step, name), getattr(y.step, name), f"{where}: step.{name}")
    assert (x.step.ended is None) == (y.step.ended is None), where
    if x.step.ended is not None and y.step.ended is not None:
        assert x.step.ended.reason == y.step.ended.reason, where
        _same(x.step.ended.rows, y.step.ended.rows, f"{where}: ended.rows")
        _same(x.step.ended.table, y.step.ended.table, f"{where}: ended.table")
    _same(fa.tracker.table, ra.tracker.table, f"{where}: tracker table")
    assert fa.tracker.next_id == ra.tracker.next_id, where
    for j in range(len(fa.zones)):  # the zone rules' counts (loitering)
        assert fa.zones.state_fields(j) == ra.zones.state_fields(j), (where, j)
    for what, fast, ref in (("zones", fa.zones, ra.zones), ("lines", fa.lines, ra.lines)):
        assert list(fast.state) == list(ref.state), where
        for name in fast.state:  # every column of the state table, the rules' too
            _same(fast.state[name], ref.state[name], f"{where}: {what}.{name}")
        _same(fast.counts, ref.counts, f"{where}: {what}.counts")


def _run(fa: CameraAnalytics, ra: CameraAnalytics, frames: list[tuple[Detections, float]], tag: str) -> int:
    """Both through ``frames`` (detections, t); returns the number of transitions seen."""
    seen = 0
    for i, (dets, t) in enumerate(frames):
        x = fa.process(dets, t, 1e9 + t, i, SIZE)
        y = ra.process(dets, t, 1e9 + t, i, SIZE)
        _compare(fa, ra, x, y, f"{tag} frame {i}")
        seen += len(x.transitions)
        KINDS.update(tr.kind for tr in x.transitions)
    return seen


KINDS: set[str] = set()  # the transitions' types seen by every comparison so far


def _three_classes(kind: str, seed: int, opts: SceneOptions | None = None) -> list[tuple[Detections, float]]:
    """Three independent scenes of one kind merged into one, as classes 0, 1 and 2."""
    scenes = [scene(kind, seed * 3 + c, opts) for c in range(3)]
    out = []
    for frames in zip(*scenes, strict=False):
        dets = [f.detections for f in frames]
        out.append(
            (
                Detections(
                    np.concatenate([d.boxes for d in dets]).astype(np.float32),
                    np.concatenate([d.scores for d in dets]).astype(np.float32),
                    np.concatenate([np.full(len(d), c, np.int32) for c, d in enumerate(dets)]),
                ),
                frames[0].t,
            )
        )
    return out


def test_the_kernels_are_built() -> None:
    """The install (README: pip install -e .) compiles them; without a C compiler the agent would run the
    numpy code, several times slower (README "Tracking, zones and events")."""
    assert Tracker().compiled and Zones(ZONES, 3)._module is not None and Lines(LINES, 3)._module is not None
    assert not Tracker(TrackerParams(match="optimal")).compiled  # Hungarian: numpy + scipy, comparisons only


def test_numpy_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT_KERNELS", "numpy")
    assert not Tracker().compiled
    assert Zones(ZONES, 3)._module is None and Lines(LINES, 3)._module is None


def test_a_stale_build_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel built for another table layout (an old build beside newer Python code) falls back to numpy,
    with a warning, instead of reading the wrong rows."""
    mod = kernels.load("tracking", tracking._LAYOUT)
    assert mod is not None
    monkeypatch.setattr(mod, "LAYOUT", {**mod.LAYOUT, "HITS": 38})
    monkeypatch.setattr(kernels, "_said", set())
    with caplog.at_level("WARNING", logger="pipelines.kernels"):
        assert not Tracker().compiled
    assert "another table layout" in caplog.text and "reinstall" in caplog.text


@pytest.mark.parametrize("kind", ["crossing", "occlusion", "crowd"])
@pytest.mark.parametrize(
    "params",
    [
        TrackerParams(),
        TrackerParams(high_score=0.4, new_score=0.5),
        TrackerParams(min_hits=1, max_lost_s=0.5),
        TrackerParams(min_hits=3, match_iou=0.4, low_score=0.2),
    ],
    ids=["defaults", "new_score", "min_hits_1", "min_hits_3"],
)
def test_scenes_give_the_same_results(kind: str, params: TrackerParams) -> None:
    fast, ref = _pair(AnalyticsSettings(params, max(0.4, params.low_score), 2.0, ZONES, LINES))
    seen = 0
    KINDS.clear()
    for seed in range(2):
        seen += _run(fast, ref, _three_classes(kind, seed), f"{kind} seed {seed}")
        fast.reset("reconnect", 0.0)
        ref.reset("reconnect", 0.0)
    assert seen > 0  # zones were entered and left, lines crossed: the comparison saw events
    assert {"zone_enter", "zone_leave", "line_cross", "zone_loiter"} <= KINDS


def test_a_gap_and_a_reconfiguration_give_the_same_results() -> None:
    settings = AnalyticsSettings(TrackerParams(), 0.4, 2.0, ZONES, LINES)
    fast, ref = _pair(settings)
    frames = _three_classes("crowd", 5)
    _run(fast, ref, frames[:60], "before")
    # A gap longer than reset_gap_s: every track ends, the frame after it starts new ones.
    _run(fast, ref, [(d, t + 10.0) for d, t in frames[60:90]], "after the gap")
    # Zones and lines changed in place (kept ones keep their state), then the tracker's settings.
    changed = AnalyticsSettings(TrackerParams(), 0.4, 2.0, ZONES[1:] + ZONES[:1], LINES[:2])
    assert fast.reconfigure(changed, 1e9) is None and ref.reconfigure(changed, 1e9) is None
    _run(fast, ref, [(d, t + 10.0) for d, t in frames[90:130]], "zones changed")
    tracker_changed = dataclasses.replace(changed, tracker=TrackerParams(min_hits=1))
    x, y = fast.reconfigure(tracker_changed, 2e9), ref.reconfigure(tracker_changed, 2e9)
    assert x is not None and y is not None
    _compare(fast, ref, x, y, "tracker reconfigured")
    _run(fast, ref, [(d, t + 10.0) for d, t in frames[130:]], "tracker changed")


def _random_frames(rng: np.random.Generator, n: int) -> list[tuple[Detections, float]]:
    """Frames a fuzzer could produce: clusters of identical boxes (IoU ties), zero-size and inverted boxes,
    NaN and infinite coordinates and scores, class ids beyond the labels and negative; NaN and infinite
    frame times (the first frame's too: nothing to stand in for it) and jumps past max_lost_s (tracks
    that end before matching)."""
    frames = []
    base = rng.uniform(0, 1200, (12, 2))
    t = 0.0
    for i in range(n):
        t += 1.6 if rng.random() < 0.03 else 0.04
        bad = rng.random() < 0.05 or (i == 0 and rng.random() < 0.5)
        ft = float(rng.choice([np.nan, np.inf, -np.inf])) if bad else t
        k = int(rng.integers(0, 14))
        xy = base[rng.integers(0, len(base), k)] + rng.normal(0, 4, (k, 2))
        wh = rng.uniform(0, 160, (k, 2))
        boxes = np.concatenate((xy, xy + wh), axis=1)
        if k and rng.random() < 0.3:
            boxes[rng.integers(0, k)] = boxes[0]  # an exact duplicate: ties in the matching
        if k and rng.random() < 0.1:
            boxes[rng.integers(0, k), rng.integers(0, 4)] = rng.choice([np.nan, np.inf, -np.inf])
        if k and rng.random() < 0.1:
            boxes[rng.integers(0, k)] = boxes[rng.integers(0, k)][[2, 3, 0, 1]]  # inverted
        scores = rng.choice([0.1, 0.3, 0.45, 0.6, 0.9], k) + rng.normal(0, 0.02, k)
        if k and rng.random() < 0.05:
            scores[rng.integers(0, k)] = np.nan
        classes = rng.choice([0, 1, 2, 7, -1], k, p=[0.5, 0.2, 0.2, 0.05, 0.05])
        frames.append(
            (
                Detections(boxes.astype(np.float32), scores.astype(np.float32), classes.astype(np.int32)),
                ft,
            )
        )
    return frames


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("seed", range(6))
def test_hostile_frames_give_the_same_results(seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = TrackerParams(min_hits=int(rng.integers(1, 4)), new_score=float(rng.choice([0.0, 0.5])))
    fast, ref = _pair(AnalyticsSettings(params, 0.4, 2.0, ZONES, LINES))
    _run(fast, ref, _random_frames(rng, 300), f"seed {seed}")


def test_strided_and_other_dtypes_are_taken() -> None:
    """Detections that are views (a column slice of a larger array) and float64/int64 arrays work: the
    latter are converted to pipelines.frames' float32/int32 first."""
    frames = _three_classes("crossing", 1)
    fast, ref = _pair(AnalyticsSettings(TrackerParams(), 0.4, 2.0, ZONES, LINES))
    for i, (d, t) in enumerate(frames):
        wide = np.zeros((len(d), 6), np.float32)
        wide[:, 1:5] = d.boxes
        view = Detections(wide[:, 1:5], d.scores, d.class_ids)
        assert not view.boxes.flags.c_contiguous
        _compare(fast, ref, fast.process(view, t, t, i, SIZE), ref.process(d, t, t, i, SIZE), f"frame {i}")
    tracker = Tracker()
    d = frames[0][0]
    step = tracker.update(
        Detections(d.boxes.astype(np.float64), d.scores.astype(np.float64), d.class_ids), 0.0, 0.0
    )
    assert step.det_rows.shape == (len(d),) and len(tracker) == len(d)


def test_wrong_arrays_are_refused_not_read() -> None:
    """The kernels check what they index (no read or write outside an array on a caller's mistake)."""
    mod = kernels.load("regions", regions.KERNEL_LAYOUT)
    assert mod is not None
    table = np.zeros((40, 3))
    with pytest.raises(TypeError, match="state"):
        mod.follow_rows(np.array([0, 1], np.intp), np.zeros((3, 2), np.int16).T)
    with pytest.raises(IndexError, match="row_map"):
        mod.follow_rows(np.array([0, 5], np.intp), np.zeros((3, 2), np.int8))
    zones = Zones(ZONES, 3)
    zones._compile(SIZE)
    z = len(ZONES)
    good = (
        np.zeros((3, z), bool),
        np.zeros((3, z), np.int16),
        np.zeros((3, z)),
        np.zeros((3, z)),
        np.zeros((3, z), bool),
    )
    with pytest.raises(ValueError, match="active"):
        zones._kernel.step(table, np.zeros(2, bool), np.zeros(0, np.intp), *good, 0.0)
    with pytest.raises(TypeError, match="inside"):
        zones._kernel.step(
            table, np.zeros(3, bool), np.zeros(0, np.intp), good[0].astype(np.uint8), *good[1:], 0.0
        )
    with pytest.raises(IndexError, match="confirmed"):
        zones._kernel.step(table, np.ones(3, bool), np.array([3], np.intp), *good, 0.0)
    with pytest.raises(ValueError, match="table"):
        zones._kernel.step(np.zeros((4, 3)), np.ones(3, bool), np.zeros(0, np.intp), *good, 0.0)
    tracker = Tracker()
    d = Detections(np.zeros((2, 4), np.float32), np.ones(2, np.float32), np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="table"):
        tracker._kernel.update(np.zeros((39, 0)), d.boxes, d.scores, d.class_ids, 0.0, 0.0, 0, 0.0, 1)
    with pytest.raises(ValueError, match="detections"):
        tracker._kernel.update(tracker.table, d.boxes, d.scores[:1], d.class_ids, 0.0, 0.0, 0, 0.0, 1)
    with pytest.raises(ValueError, match="detections"):
        three = d.boxes[:, :3].copy()
        tracker._kernel.update(tracker.table, three, d.scores, d.class_ids, 0.0, 0.0, 0, 0.0, 1)
