"""Tracker evaluation on real trajectories: the MOT15 sequences py-motmetrics ships (TUD-Campus,
TUD-Stadtmitte), their zone entries, and the camera's analytics run over them (tools/track_eval.py,
tests/test_track_eval.py). The metrics and synthetic scenes are agent.bench.track_eval's. Nothing here runs
in the daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.bench.track_eval import MotMetrics, SceneOptions, mot_metrics
from pipelines.frames import Detections
from pipelines.tracking import BOX, ID, TrackerParams

# ---- real trajectories: the MOT15 sequences py-motmetrics ships ----
# TUD-Campus (71 frames) and TUD-Stadtmitte (179 frames), 640x480 at 25 fps: gt.txt (ground truth) and
# test.txt (a detector-tracker's boxes; MOT15 rows: frame, id, x, y, w, h, score, ...). Two detection sources
# (``load_mot15``): "test", test.txt's boxes (their ids dropped): real detections, but already filtered by
# that tracker (no low scores, no flicker left; MOTA at most about 0.53 / 0.56, their recall); "gt_noisy",
# the ground-truth people seen through a noisy detector (``noisy_detections``: box jitter, misses, score
# dips, false positives, seeded), where the tracker's second stage and the zones' inertia have work to do.
# Neither file has detector scores (-1): both sources score a box from the picture (``occlusion_scores``).
MOT15 = ("TUD-Campus", "TUD-Stadtmitte")
MOT15_FPS = 25.0
MOT15_SIZE = (640, 480)
# Zones drawn on both scenes for counting (normalised, bottom-centre anchor): the right half of the picture,
# and a band across the middle; people walk across both, some start inside.
MOT15_ZONES: dict[str, tuple[tuple[float, float], ...]] = {
    "right_half": ((0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0)),
    "middle": ((0.35, 0.0), (0.65, 0.0), (0.65, 1.0), (0.35, 1.0)),
}


@dataclass
class MotSequence:
    name: str
    fps: float
    size: tuple[int, int]
    gt: list[tuple[np.ndarray, np.ndarray]]  # per frame: ground-truth ids (K,), boxes (K, 4) x1y1x2y2
    detections: list[Detections]  # per frame, class 0, scores from ``occlusion_scores``


def mot15_root() -> Path | None:
    """py-motmetrics' data folder (with TUD-Campus/ and TUD-Stadtmitte/), None if it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("motmetrics")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "data"
    return root if (root / MOT15[0] / "gt.txt").is_file() else None


def _read_mot(path: Path, frames: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rows = np.loadtxt(path, delimiter=",", ndmin=2)
    out = []
    for f in range(1, frames + 1):
        r = rows[rows[:, 0] == f]
        boxes = np.stack((r[:, 2], r[:, 3], r[:, 2] + r[:, 4], r[:, 3] + r[:, 5]), axis=1)
        out.append((r[:, 1].astype(np.int64), boxes.reshape(-1, 4)))
    return out


def occlusion_scores(boxes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(K,) a detector-like score per box of one frame: 0.95 less the fraction of the box covered by the
    boxes in front of it (bottom edge lower in the picture), each counted alone, plus noise (std 0.08)."""
    k = len(boxes)
    covered = np.zeros(k)
    if k > 1:
        x1, y1, x2, y2 = boxes.T
        iw = np.clip(np.minimum(x2[:, None], x2) - np.maximum(x1[:, None], x1), 0, None)
        ih = np.clip(np.minimum(y2[:, None], y2) - np.maximum(y1[:, None], y1), 0, None)
        area = np.maximum((x2 - x1) * (y2 - y1), 1.0)
        front = y2[None, :] > y2[:, None]  # [i, j]: j is in front of i
        covered = np.minimum((iw * ih * front).sum(axis=1) / area, 1.0)
    return np.clip(0.95 - covered + rng.normal(0.0, 0.08, k), 0.01, 0.99)


def noisy_detections(
    gt: list[tuple[np.ndarray, np.ndarray]], rng: np.random.Generator, opts: SceneOptions | None = None
) -> list[Detections]:
    """The ground truth through a noisy detector: each box missed with ``opts.miss``, jittered by
    ``opts.jitter`` of its size, scored by ``occlusion_scores`` but dipping to 0.1-0.4 with ``opts.low``
    (blur, a partial occlusion), and ``opts.false_positives`` false boxes a frame scoring 0.3-0.6."""
    o = opts or SceneOptions(jitter=0.04, miss=0.05, low=0.15, false_positives=0.2, size=MOT15_SIZE)
    w, h = o.size
    out = []
    for _ids, boxes in gt:
        k = len(boxes)
        wh = np.concatenate((boxes[:, 2:4] - boxes[:, 0:2],) * 2, axis=1)
        noisy = boxes + rng.normal(0.0, o.jitter, (k, 4)) * wh
        scores = occlusion_scores(boxes, rng)
        dip = rng.random(k) < o.low
        scores[dip] = rng.uniform(0.1, 0.4, int(dip.sum()))
        seen = rng.random(k) >= o.miss
        n_fp = int(rng.poisson(o.false_positives))
        fh = rng.uniform(40, 150, n_fp)
        fx, fy = rng.uniform(0, w - fh), rng.uniform(0, h - fh)
        fp = np.stack((fx, fy, fx + fh * 0.4, fy + fh), axis=1)
        all_boxes = np.concatenate((noisy[seen], fp)).astype(np.float32)
        all_scores = np.concatenate((scores[seen], rng.uniform(0.3, 0.6, n_fp))).astype(np.float32)
        out.append(Detections(all_boxes, all_scores, np.zeros(len(all_boxes), np.int32)))
    return out


def load_mot15(name: str, source: str = "test", root: Path | None = None, seed: int = 0) -> MotSequence:
    """One of ``MOT15`` from py-motmetrics' data (``root``: its folder; default where it is installed), with
    detections from ``source`` ("test" or "gt_noisy", the comment above)."""
    if source not in ("test", "gt_noisy"):
        raise ValueError(f"source: test or gt_noisy, got {source!r}")
    base = (root or mot15_root() or Path("/nonexistent")) / name
    if not (base / "gt.txt").is_file():
        raise FileNotFoundError(f"{base}/gt.txt: not found (the MOT15 sequences come with py-motmetrics)")
    frames = int(np.loadtxt(base / "gt.txt", delimiter=",", ndmin=2)[:, 0].max())
    gt = _read_mot(base / "gt.txt", frames)
    rng = np.random.default_rng(seed)
    if source == "gt_noisy":
        return MotSequence(name, MOT15_FPS, MOT15_SIZE, gt, noisy_detections(gt, rng))
    dets = []
    for _ids, boxes in _read_mot(base / "test.txt", frames):
        k = len(boxes)
        scores = occlusion_scores(boxes, rng)
        dets.append(Detections(boxes.astype(np.float32), scores.astype(np.float32), np.zeros(k, np.int32)))
    return MotSequence(name, MOT15_FPS, MOT15_SIZE, gt, dets)


def every(seq: MotSequence, k: int) -> MotSequence:
    """Every ``k``-th frame of ``seq``: the same scene from a camera at 1/k of the rate."""
    return MotSequence(seq.name, seq.fps / k, seq.size, seq.gt[::k], seq.detections[::k])


def inside_polygon(x: np.ndarray, y: np.ndarray, polygon: np.ndarray) -> np.ndarray:
    """(K,) bool: points inside the polygon ((P, 2), pixels), by the crossing-number test."""
    inside = np.zeros(len(x), bool)
    for (x1, y1), (x2, y2) in zip(polygon, np.roll(polygon, -1, axis=0), strict=True):
        crosses = (y1 > y) != (y2 > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            xint = x1 + (y - y1) * (x2 - x1) / (y2 - y1)
        inside ^= crosses & (x < xint)
    return inside


def true_entries(seq: MotSequence, polygon: Sequence[tuple[float, float]]) -> int:
    """Zone entries in the ground truth: each object's bottom centre inside at its first frame, or going from
    outside to inside later (the annotations are smooth: no flicker to filter)."""
    pts = np.asarray(polygon, np.float64) * np.asarray(seq.size, np.float64)
    was: dict[int, bool] = {}
    entries = 0
    for ids, boxes in seq.gt:
        now = inside_polygon(0.5 * (boxes[:, 0] + boxes[:, 2]), boxes[:, 3], pts)
        for i, inside in zip(ids.tolist(), now.tolist(), strict=True):
            entries += inside and not was.get(i, False)
            was[i] = inside
    return entries


@dataclass
class SequenceResult:
    metrics: MotMetrics
    entries: dict[str, int]  # zone -> zone_enter events counted
    truth: dict[str, int]  # zone -> entries in the ground truth


def evaluate_sequence(
    seq: MotSequence, params: TrackerParams, min_score: float = 0.4, inertia: int = 1, inertia_s: float = 0.0
) -> SequenceResult:
    """The camera's analytics (tracker and ``MOT15_ZONES``) on a sequence's detections at or above
    ``params.low_score`` (what the route keeps): MOT metrics of the tracks confirmed and matched in each
    frame (their detections' boxes, low-score ones included, as supervision's ByteTrack reports them)
    against the ground truth, and the zone entries counted against the true ones."""
    from pipelines.analytics import AnalyticsSettings, CameraAnalytics
    from pipelines.regions import RegionSpec

    zones = tuple(
        RegionSpec("zone", name, pts, inertia=inertia, inertia_s=inertia_s)
        for name, pts in MOT15_ZONES.items()
    )
    an = CameraAnalytics(AnalyticsSettings(params, min_score, 2.0, zones), 1)
    names = list(MOT15_ZONES)
    entries = dict.fromkeys(names, 0)
    hyp = []
    for f, dets in enumerate(seq.detections):
        keep = dets.scores >= params.low_score
        kept = Detections(dets.boxes[keep], dets.scores[keep], dets.class_ids[keep])
        t = f / seq.fps
        a = an.process(kept, t, t, f, seq.size)
        rows = a.active.nonzero()[0]  # what the tracker follows: confirmed and matched, low scores too
        hyp.append((a.table[ID].take(rows).astype(np.int64), a.table[BOX].take(rows, axis=1).T))
        for tr in a.transitions:
            if tr.kind == "zone_enter":
                entries[names[tr.region]] += 1
    truth = {name: true_entries(seq, pts) for name, pts in MOT15_ZONES.items()}
    return SequenceResult(mot_metrics(seq.gt, hyp), entries, truth)
