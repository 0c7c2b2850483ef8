"""The tracker (pipelines.tracking) and its evaluation (agent.bench.track_eval): matching, the Kalman filter,
id stability on synthetic scenes with ground truth and on the bundled clip's recorded detections."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from agent.bench.track_eval import (
    MotMetrics,
    SceneOptions,
    hungarian,
    load_recorded,
    mot_metrics,
    run_scene,
    scene,
)
from pipelines.frames import Detections
from pipelines.matching import greedy_match, iou_matrix
from pipelines.tracking import (
    BOX,
    COV_PV,
    ID,
    POS,
    VAR_POS,
    VAR_VEL,
    VEL,
    Tracker,
    TrackerParams,
)

RECORDED = Path(__file__).parent / "data" / "bikes_detections.npz"


def dets(*boxes: tuple[float, float, float, float], score: float = 0.9, cls: int = 0) -> Detections:
    n = len(boxes)
    return Detections(
        np.asarray(boxes, np.float32).reshape(n, 4), np.full(n, score, np.float32), np.full(n, cls, np.int32)
    )


def track_fn(params: TrackerParams | None = None):  # type: ignore[no-untyped-def]
    """A run_scene callback: the ids and detection boxes of confirmed tracks matched in each frame."""
    tracker = Tracker(params or TrackerParams(new_score=0.5))

    def step(d: Detections, t: float) -> tuple[np.ndarray, np.ndarray]:
        tracker.update(d, t, t)
        rows = np.flatnonzero(tracker.matched() & (tracker.table[ID] > 0))
        return tracker.table[ID, rows].astype(np.int64), tracker.table[BOX][:, rows].T

    return step


# ---- matching ----
def brute_greedy(score: np.ndarray, floor: float) -> set[tuple[int, int]]:
    """The textbook greedy matching: repeatedly the highest remaining pair (first in row-major order)."""
    s = np.where(score >= floor, score, -np.inf)
    pairs = set()
    while np.isfinite(s).any() and s.max() >= floor:
        r, c = np.unravel_index(np.argmax(s), s.shape)
        pairs.add((int(r), int(c)))
        s[r, :] = -np.inf
        s[:, c] = -np.inf
    return pairs


@pytest.mark.parametrize("seed", range(40))
def test_greedy_match_is_the_global_greedy_matching(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m = rng.integers(1, 14, 2)
    score = rng.random((n, m))
    if seed % 3 == 0:
        score = np.round(score * 4) / 4  # ties
    rows, cols = greedy_match(score.copy(), 0.3)
    assert set(zip(rows.tolist(), cols.tolist(), strict=True)) == brute_greedy(score, 0.3)


@pytest.mark.parametrize("seed", range(30))
def test_hungarian_is_optimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, m = (int(v) for v in rng.integers(1, 6, 2))
    cost = rng.random((n, m))
    if seed % 2:
        cost = np.round(cost * 3)
    rows, cols = hungarian(cost)
    assert len(rows) == min(n, m) == len(set(rows.tolist())) == len(set(cols.tolist()))
    if n <= m:
        best = min(sum(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(m), n))
    else:
        best = min(sum(cost[p[j], j] for j in range(m)) for p in itertools.permutations(range(n), m))
    assert cost[rows, cols].sum() == pytest.approx(best)


def test_hungarian_agrees_with_scipy() -> None:
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(7)
    for _ in range(50):
        cost = rng.random(tuple(rng.integers(1, 30, 2)))
        r1, c1 = hungarian(cost)
        r2, c2 = scipy_optimize.linear_sum_assignment(cost)
        assert cost[r1, c1].sum() == pytest.approx(cost[r2, c2].sum())


def test_iou_matrix() -> None:
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 0]], float)
    b = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]], float)
    np.testing.assert_allclose(iou_matrix(a, b), [[1.0, 50 / 150, 0.0], [0.0, 0.0, 0.0]])


# ---- the Kalman filter ----
def test_kalman_blocks_equal_the_full_filter() -> None:
    """The element-wise 2x2 blocks give exactly the 8x8 constant-velocity filter's mean and covariance."""
    tracker = Tracker(TrackerParams(min_hits=1))
    rng = np.random.default_rng(3)
    box = np.array([100.0, 50.0, 140.0, 170.0])
    tracker.update(dets(tuple(box)), 0.0, 0.0)
    # The same filter with full matrices (state cx, cy, w, h, vx, vy, vw, vh; ByteTrack's weights).
    wp, wv = 1 / 20, 1 / 160
    x = np.zeros(8)
    x[:4] = [120, 110, 40, 120]
    size = np.array([40, 120, 40, 120.0])
    p = np.diag(np.concatenate(((2 * wp * size) ** 2, (10 * wv * size) ** 2)))
    t = 0.0
    for _ in range(25):
        dt = float(rng.uniform(0.02, 0.2))
        t += dt
        k = dt * 25.0
        f = np.eye(8)
        f[:4, 4:] = k * np.eye(4)
        s = np.maximum(x[[2, 3, 2, 3]], 1.0)
        q = np.diag(np.concatenate((k * (wp * s) ** 2, k * (wv * s) ** 2)))
        x = f @ x
        p = f @ p @ f.T + q
        box = (box + rng.normal(0, 2, 4) + np.array([3, 1, 3, 1])).astype(np.float32).astype(np.float64)
        z = np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2, box[2] - box[0], box[3] - box[1]])
        h = np.hstack((np.eye(4), np.zeros((4, 4))))
        r = np.diag((wp * np.maximum(x[[2, 3, 2, 3]], 1.0)) ** 2)
        gain = p @ h.T @ np.linalg.inv(h @ p @ h.T + r)
        x = x + gain @ (z - h @ x)
        p = (np.eye(8) - gain @ h) @ p
        tracker.update(dets(tuple(box)), t, t)
        tab = tracker.table[:, 0]
        np.testing.assert_allclose(tab[POS], x[:4], rtol=1e-9)
        np.testing.assert_allclose(tab[VEL], x[4:], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(tab[VAR_POS], np.diag(p)[:4], rtol=1e-9)
        np.testing.assert_allclose(tab[COV_PV], np.diag(p[:4, 4:]), rtol=1e-9)
        np.testing.assert_allclose(tab[VAR_VEL], np.diag(p)[4:], rtol=1e-9)
        off_block = p.copy()
        for i in range(4):
            off_block[i, i] = off_block[i + 4, i + 4] = off_block[i, i + 4] = off_block[i + 4, i] = 0.0
        np.testing.assert_allclose(off_block, 0.0, atol=1e-12)  # the four 2x2 blocks are all there is


# ---- lifecycle ----
def test_confirmation_ids_and_low_score_continuation() -> None:
    tracker = Tracker(TrackerParams(high_score=0.5, low_score=0.1, min_hits=2))
    s1 = tracker.update(dets((0, 0, 10, 20)), 0.0, 100.0, frame_id=1)
    assert s1.det_rows.tolist() == [0] and tracker.table[ID, 0] == 0  # tentative: no id yet
    s2 = tracker.update(dets((1, 0, 11, 20)), 0.04, 100.04, frame_id=2)
    assert s2.confirmed.tolist() == [0] and tracker.table[ID, 0] == 1
    # A low score (below high_score) continues the track (ByteTrack's second stage) ...
    tracker.update(dets((2, 0, 12, 20), score=0.2), 0.08, 100.08, frame_id=3)
    assert tracker.matched().tolist() == [True]
    # ... but does not start one.
    s4 = tracker.update(dets((2, 0, 12, 20), (200, 0, 210, 20), score=0.2), 0.12, 100.12, frame_id=4)
    assert s4.det_rows.tolist() == [0, -1] and len(tracker) == 1


def test_tracks_survive_misses_then_end_as_lost() -> None:
    tracker = Tracker(TrackerParams(min_hits=1, max_lost_s=0.5))
    t = 0.0
    for i in range(5):
        tracker.update(dets((4 * i, 0, 4 * i + 20, 40)), t, t)
        t += 0.04
    for _ in range(10):  # 0.4 s without a detection: still there, lost
        step = tracker.update(dets(), t, t)
        assert step.ended is None and len(tracker) == 1
        t += 0.04
    step = tracker.update(dets((60, 0, 80, 40)), t, t)  # where the motion predicted it
    assert step.det_rows.tolist() == [0] and int(tracker.table[ID, 0]) == 1
    while True:
        t += 0.04
        step = tracker.update(dets(), t, t)
        if step.ended is not None:
            break
    assert step.ended.reason == "lost" and step.ended.table[ID].tolist() == [1] and len(tracker) == 0


def test_classes_never_share_a_track() -> None:
    tracker = Tracker(TrackerParams(min_hits=1))
    tracker.update(dets((0, 0, 10, 20), cls=0), 0.0, 0.0)
    step = tracker.update(dets((0, 0, 10, 20), cls=2), 0.04, 0.04)
    assert step.det_rows.tolist() == [1] and tracker.table[ID].tolist() == [1, 2]


def test_reset_ends_every_track_and_ids_go_on() -> None:
    tracker = Tracker(TrackerParams(min_hits=1))
    tracker.update(dets((0, 0, 10, 20), (50, 0, 60, 20)), 0.0, 0.0)
    step = tracker.reset("reconnect")
    assert step.ended is not None and step.ended.reason == "reconnect"
    assert sorted(step.ended.table[ID].tolist()) == [1, 2] and len(tracker) == 0
    tracker.update(dets((0, 0, 10, 20)), 10.0, 10.0)
    assert tracker.table[ID].tolist() == [3]  # no id comes back


def test_frames_dropped_by_the_pipeline_widen_the_prediction() -> None:
    """Motion is per second: a frame after a 4-frame gap lands where the object went."""
    tracker = Tracker(TrackerParams(min_hits=1, match_iou=0.3))
    for i in range(10):
        tracker.update(dets((20 * i, 0, 20 * i + 60, 120)), 0.04 * i, 0.04 * i)
    assert len(tracker) == 1
    step = tracker.update(dets((20 * 14, 0, 20 * 14 + 60, 120)), 0.04 * 14, 0.04 * 14)
    assert step.det_rows.tolist() == [0]


# ---- synthetic scenes with ground truth ----
@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.35, 0.49])
@pytest.mark.parametrize("seed", range(3))
def test_two_objects_crossing_keep_their_ids(overlap: float, seed: int) -> None:
    """Two people walking past each other, their boxes overlapping up to just under 50 % IoU, with box
    noise, 5 % missed detections, low scores and false positives: no ID switch."""
    frames = scene("crossing", seed, SceneOptions(overlap=overlap))
    peak = max(
        float(iou_matrix(f.gt_boxes[:1], f.gt_boxes[1:2])[0, 0]) for f in frames if len(f.gt_boxes) == 2
    )
    assert peak == pytest.approx(overlap, abs=0.02)
    m = run_scene(frames, track_fn())
    assert m.id_switches == 0, m
    assert m.idf1 > 0.9, m


@pytest.mark.parametrize("seed", range(4))
def test_a_ten_frame_occlusion_keeps_the_id(seed: int) -> None:
    frames = scene("occlusion", seed, SceneOptions(occluded=10))
    hidden = [i for i, f in enumerate(frames) if 1 not in f.gt_ids.tolist()]
    assert len(hidden) == 10
    step = track_fn()
    ids_before, ids_after = set(), set()
    gt, hyp = [], []
    for i, f in enumerate(frames):
        ids, boxes = step(f.detections, f.t)
        gt.append((f.gt_ids, f.gt_boxes))
        hyp.append((ids, boxes))
        if len(f.gt_ids) and 1 in f.gt_ids.tolist():
            own = f.gt_boxes[f.gt_ids.tolist().index(1)][None]
            match = ids[iou_matrix(own, boxes)[0] > 0.5] if len(ids) else ids
            (ids_before if i < hidden[0] else ids_after).update(match.tolist())
    assert ids_before and ids_before == ids_after  # the same id before and after the occlusion
    assert mot_metrics(gt, hyp).id_switches == 0


def test_crowd_identity_metrics() -> None:
    """20 walkers at once (40 over the scene), noisy detector: IDF1 and ID switches (numbers: README)."""
    results = [run_scene(scene("crowd", seed), track_fn()) for seed in range(3)]
    assert min(m.idf1 for m in results) > 0.9, results
    assert sum(m.id_switches for m in results) <= 15, results


def test_metrics_on_perfect_and_swapped_tracks() -> None:
    boxes = np.array([[0, 0, 10, 10], [50, 0, 60, 10]], float)
    gt = [(np.array([1, 2]), boxes)] * 10
    assert mot_metrics(gt, gt).idf1 == 1.0 and mot_metrics(gt, gt).id_switches == 0
    swapped = [(np.array([1, 2]), boxes)] * 5 + [(np.array([2, 1]), boxes)] * 5
    m = mot_metrics(gt, swapped)
    assert m.id_switches == 2 and m.idf1 == pytest.approx(0.5)


def test_metrics_agree_with_motmetrics() -> None:
    mm = pytest.importorskip("motmetrics")
    frames = scene("crowd", 1, SceneOptions(frames=120, objects=8))
    step = track_fn()
    acc = mm.MOTAccumulator(auto_id=True)
    gt, hyp = [], []
    for f in frames:
        ids, boxes = step(f.detections, f.t)
        gt.append((f.gt_ids, f.gt_boxes))
        hyp.append((ids, boxes))
        dist = 1.0 - iou_matrix(f.gt_boxes.reshape(-1, 4), boxes.reshape(-1, 4))
        dist[dist > 0.5] = np.nan
        acc.update(f.gt_ids.tolist(), ids.tolist(), dist)
    summary = mm.metrics.create().compute(acc, metrics=["idf1", "num_switches", "mota"])
    ours: MotMetrics = mot_metrics(gt, hyp)
    assert ours.idf1 == pytest.approx(float(summary["idf1"].iloc[0]), abs=1e-9)
    assert ours.id_switches == int(summary["num_switches"].iloc[0])
    assert ours.mota == pytest.approx(float(summary["mota"].iloc[0]), abs=1e-9)


# ---- the bundled clip ----
def test_ids_are_stable_on_the_bundled_clip() -> None:
    """Recorded NanoDet detections of agent/assets/bikes.mp4 (tools/record_detections.py): a detection that
    overlaps a detection of the previous frame by IoU > 0.7 (same class, both tracked) has its id; and the
    clip's objects make a plausible number of tracks (it is a montage of five shots)."""
    per_frame, fps, _ = load_recorded(RECORDED)
    tracker = Tracker(TrackerParams(high_score=0.4, new_score=0.5))
    prev = None
    kept = 0
    ids: set[int] = set()
    for i, d in enumerate(per_frame):
        step = tracker.update(d, i / fps, i / fps, i)
        reported = d.scores >= 0.4
        rows = step.det_rows[reported]
        track_ids = np.where(rows >= 0, tracker.table[ID].take(np.maximum(rows, 0)) if len(tracker) else 0, 0)
        cur = (d.boxes[reported].astype(float), d.class_ids[reported], track_ids.astype(int))
        ids |= set(cur[2][cur[2] > 0].tolist())
        if prev is not None and len(cur[0]) and len(prev[0]):
            overlap = iou_matrix(prev[0], cur[0]) > 0.7
            for r, c in zip(*overlap.nonzero(), strict=True):
                if prev[1][r] == cur[1][c] and prev[2][r] and cur[2][c]:
                    assert prev[2][r] == cur[2][c], f"frame {i}: track {prev[2][r]} became {cur[2][c]}"
                    kept += 1
        prev = cur
    assert kept > 150  # the check above ran on most of the clip
    assert 8 <= len(ids) <= 30
