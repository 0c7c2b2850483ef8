"""Tracker evaluation: synthetic scenes with ground truth, and the MOT identity metrics on them.

Used by `edge-agent bench --sections tracking` and tests/test_tracking.py. Nothing here runs in the daemon.

Scenes (``scene(kind, ...)``): objects moving at constant velocity with a little wander, observed through a
noisy detector: box jitter, missed detections, low scores now and then, false positives. Kinds:
``crossing`` (two objects passing each other, their boxes' IoU at most ``overlap``), ``occlusion`` (an
object invisible for ``occluded`` frames in the middle of its path), ``crowd`` (``objects`` walkers at
once, entering and leaving).

Metrics (``mot_metrics``), as py-motmetrics computes them (Ristani et al. 2016 for IDF1; Bernardin and
Stiefelhagen 2008 for the CLEAR MOT counts): per frame, ground truth and tracker boxes match at IoU >=
0.5, previous correspondences kept first, the rest by the Hungarian method; an ID switch is a ground-truth
object matched to another track id than at its previous match. IDF1 = 2 IDTP / (2 IDTP + IDFP + IDFN) with
IDTP from the one-to-one assignment of ground-truth ids to track ids that maximises the frames they
share. The Hungarian method here is a small numpy one (scipy is not a dependency); a test checks it
against scipy's where installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.frames import Detections
from pipelines.matching import iou_matrix


# ---- assignment ----
def hungarian(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost assignment of a rectangular cost matrix: (rows, cols), min(n, m) pairs.

    The shortest augmenting path method with potentials (Kuhn-Munkres, O(n^2 m)), the inner scan over
    columns vectorised. For evaluation-sized matrices (tens of rows), not for the per-frame hot path.
    """
    cost = np.asarray(cost, dtype=np.float64)
    transposed = cost.shape[0] > cost.shape[1]
    if transposed:
        cost = cost.T
    n, m = cost.shape
    if n == 0:
        return np.zeros(0, np.intp), np.zeros(0, np.intp)
    u = np.zeros(n + 1)
    v = np.zeros(m + 1)
    p = np.zeros(m + 1, np.intp)  # p[j]: row (1-based) assigned to column j; column 0 is the root
    way = np.zeros(m + 1, np.intp)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            free = ~used[1:]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(cand)) + 1
            delta = cand[j1 - 1]
            used_cols = np.flatnonzero(used)
            u[p[used_cols]] += delta
            v[used_cols] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    cols = np.flatnonzero(p[1:])
    rows = p[1:][cols] - 1
    order = np.argsort(rows)
    rows, cols = rows[order], cols[order]
    return (cols, rows) if transposed else (rows, cols)


# ---- scenes ----
_Track = tuple[int, int, np.ndarray, np.ndarray, np.ndarray]  # id, start, centre (n, 2), wh, visible (n,)


@dataclass
class SceneFrame:
    t: float
    gt_ids: np.ndarray  # (G,) ground-truth object ids in this frame (visible or not detected)
    gt_boxes: np.ndarray  # (G, 4)
    detections: Detections  # what the detector reported (noisy, with misses and false positives)


@dataclass(frozen=True)
class SceneOptions:
    frames: int = 200
    fps: float = 25.0
    size: tuple[int, int] = (1280, 720)
    jitter: float = 0.03  # box noise, fraction of the box size (std)
    miss: float = 0.05  # probability that a visible object is not detected
    low: float = 0.1  # probability that a detection comes with a low score (0.15..0.39)
    false_positives: float = 0.2  # mean false detections per frame
    objects: int = 20  # crowd
    overlap: float = 0.4  # crossing: the largest IoU of the two passing boxes
    occluded: int = 10  # occlusion: frames without any detection of the object


def scene(kind: str, seed: int = 0, opts: SceneOptions | None = None) -> list[SceneFrame]:
    """A synthetic scene with ground truth (see the module docstring)."""
    o = opts or SceneOptions()
    rng = np.random.default_rng(seed)
    n = o.frames | 1 if kind == "crossing" else o.frames  # odd: the two meet on a frame
    tracks = _paths(kind, o, n, rng)
    return [_observe(tracks, f, o, rng) for f in range(n)]


def _paths(kind: str, o: SceneOptions, n: int, rng: np.random.Generator) -> list[_Track]:
    """The ground truth of a scene kind: every object's path and visibility over `n` frames."""
    w, h = o.size
    tracks: list[_Track] = []
    if kind == "crossing":
        # Two people walking towards each other on close parallel paths; vertical offset sets the overlap.
        bw, bh = 60.0, 160.0
        # IoU of two equal boxes offset vertically by dy (same x): (bh - dy) / (bh + dy).
        dy = bh * (1 - o.overlap) / (1 + o.overlap)
        for k, (x0, x1) in enumerate(((100.0, w - 100.0), (w - 100.0, 100.0))):
            xs = np.linspace(x0, x1, n)
            ys = np.full(n, h / 2 + (dy / 2 if k else -dy / 2))
            tracks.append((k + 1, 0, np.stack((xs, ys), 1), np.array([bw, bh]), np.ones(n, bool)))
    elif kind == "occlusion":
        xs = np.linspace(100.0, w - 100.0, n)
        vis = np.ones(n, bool)
        mid = n // 2
        vis[mid - o.occluded // 2 : mid - o.occluded // 2 + o.occluded] = False
        tracks.append((1, 0, np.stack((xs, np.full(n, h / 2)), 1), np.array([60.0, 160.0]), vis))
        # A second object nearby that stays visible (so the occluded one could be mistaken for it).
        xs2 = np.linspace(w - 100.0, 100.0, n)
        tracks.append(
            (2, 0, np.stack((xs2, np.full(n, h / 2 + 200)), 1), np.array([60.0, 160.0]), np.ones(n, bool))
        )
    elif kind == "crowd":
        return _crowd(o, n, rng)
    else:
        raise ValueError(f"scene kind: crossing, occlusion or crowd, got {kind!r}")
    return tracks


def _crowd(o: SceneOptions, n: int, rng: np.random.Generator) -> list[_Track]:
    """`objects` walkers from the start, as many more entering later; each leaves with its centre."""
    w, h = o.size
    tracks: list[_Track] = []
    for k in range(o.objects * 2):
        start = int(rng.integers(0, max(1, n - n // 4))) if k >= o.objects else 0
        life = n - start
        bh = float(rng.uniform(60, 200))
        bw = bh * float(rng.uniform(0.3, 0.6))
        p0 = np.array([rng.uniform(bw, w - bw), rng.uniform(bh, h - bh)])
        speed = rng.uniform(20, 120) / o.fps  # px per frame
        angle = rng.uniform(0, 2 * np.pi)
        vel = speed * np.array([np.cos(angle), np.sin(angle)])
        wander = np.cumsum(rng.normal(0, 0.3, (life, 2)), axis=0)
        c = p0 + np.arange(life)[:, None] * vel + wander
        # Objects leave when their centre leaves the picture.
        inside = (c[:, 0] > 0) & (c[:, 0] < w) & (c[:, 1] > 0) & (c[:, 1] < h)
        centre = np.full((n, 2), np.nan)
        centre[start:] = c
        vis = np.zeros(n, bool)
        vis[start:] = np.logical_and.accumulate(inside)
        tracks.append((k + 1, start, centre, np.array([bw, bh]), vis))
    return tracks


def _observe(tracks: list[_Track], f: int, o: SceneOptions, rng: np.random.Generator) -> SceneFrame:
    """Frame `f` of the scene: its ground truth, and what the noisy detector reports of it."""
    w, h = o.size
    gt_ids, gt_boxes, boxes, scores = [], [], [], []
    for tid, _start, centre, wh, vis in tracks:
        if not vis[f]:
            continue
        box = np.concatenate((centre[f] - wh / 2, centre[f] + wh / 2))
        gt_ids.append(tid)
        gt_boxes.append(box)
        if rng.random() < o.miss:
            continue
        noisy = box + rng.normal(0, o.jitter, 4) * np.concatenate((wh, wh))
        boxes.append(noisy)
        scores.append(rng.uniform(0.15, 0.39) if rng.random() < o.low else rng.uniform(0.5, 0.95))
    for _ in range(rng.poisson(o.false_positives)):
        bh = rng.uniform(40, 150)
        x, y = rng.uniform(0, w - bh), rng.uniform(0, h - bh)
        boxes.append(np.array([x, y, x + bh * 0.5, y + bh]))
        scores.append(rng.uniform(0.3, 0.6))
    k = len(boxes)
    dets = Detections(
        np.asarray(boxes, np.float32).reshape(k, 4),
        np.asarray(scores, np.float32).reshape(k),
        np.zeros(k, np.int32),
    )
    return SceneFrame(f / o.fps, np.asarray(gt_ids, np.int64), np.asarray(gt_boxes).reshape(-1, 4), dets)


# ---- metrics ----
@dataclass
class MotMetrics:
    idf1: float
    idp: float
    idr: float
    id_switches: int
    mota: float
    gt: int  # ground-truth boxes
    matches: int
    misses: int
    false_positives: int
    gt_objects: int
    track_ids: int  # distinct track ids reported

    def as_dict(self) -> dict[str, float | int]:
        return {
            "idf1": round(self.idf1, 4),
            "idp": round(self.idp, 4),
            "idr": round(self.idr, 4),
            "id_switches": self.id_switches,
            "mota": round(self.mota, 4),
            "gt": self.gt,
            "matches": self.matches,
            "misses": self.misses,
            "false_positives": self.false_positives,
            "gt_objects": self.gt_objects,
            "track_ids": self.track_ids,
        }


Frames = Sequence[tuple[np.ndarray, np.ndarray]]  # per frame: (ids (K,), boxes (K, 4))


def mot_metrics(gt: Frames, hyp: Frames, min_iou: float = 0.5) -> MotMetrics:
    """IDF1, ID switches and MOTA of tracker output ``hyp`` against ``gt`` (see the module docstring)."""
    gt_ids = sorted({int(i) for ids, _ in gt for i in ids})
    hyp_ids = sorted({int(i) for ids, _ in hyp for i in ids})
    gi = {g: k for k, g in enumerate(gt_ids)}
    hi = {h: k for k, h in enumerate(hyp_ids)}
    shared = np.zeros((len(gt_ids), len(hyp_ids)))  # frames each (gt, hyp) pair overlaps at >= min_iou
    last: dict[int, int] = {}  # gt id -> hyp id at its latest match
    switches = matches = n_gt = n_hyp = 0
    for (g_ids, g_boxes), (h_ids, h_boxes) in zip(gt, hyp, strict=True):
        n_gt += len(g_ids)
        n_hyp += len(h_ids)
        if not len(g_ids) or not len(h_ids):
            continue
        iou = iou_matrix(np.asarray(g_boxes, np.float64), np.asarray(h_boxes, np.float64))
        ok = iou >= min_iou
        rows, cols = np.nonzero(ok)
        shared[[gi[int(g_ids[r])] for r in rows], [hi[int(h_ids[c])] for c in cols]] += 1
        pairs = _clear_pairs(g_ids, h_ids, iou, ok, last)
        for r, c in pairs:
            g, hid = int(g_ids[r]), int(h_ids[c])
            if g in last and last[g] != hid:
                switches += 1
            last[g] = hid
        matches += len(pairs)
    idtp = 0.0
    if shared.size:
        r, c = hungarian(-shared)
        idtp = float(shared[r, c].sum())
    idfp, idfn = n_hyp - idtp, n_gt - idtp
    misses, fps = n_gt - matches, n_hyp - matches
    return MotMetrics(
        idf1=2 * idtp / (2 * idtp + idfp + idfn) if n_gt + n_hyp else 1.0,
        idp=idtp / n_hyp if n_hyp else 0.0,
        idr=idtp / n_gt if n_gt else 0.0,
        id_switches=switches,
        mota=1.0 - (misses + fps + switches) / n_gt if n_gt else 0.0,
        gt=n_gt,
        matches=matches,
        misses=misses,
        false_positives=fps,
        gt_objects=len(gt_ids),
        track_ids=len(hyp_ids),
    )


def _clear_pairs(
    g_ids: np.ndarray, h_ids: np.ndarray, iou: np.ndarray, ok: np.ndarray, last: dict[int, int]
) -> list[tuple[int, int]]:
    """One frame's (gt row, hyp column) matches, CLEAR MOT's way: last frame's correspondences that still
    overlap are kept, then the Hungarian method on the rest."""
    pairs: list[tuple[int, int]] = []
    taken_g: set[int] = set()
    taken_h: set[int] = set()
    h_pos = {int(h): c for c, h in enumerate(h_ids)}
    for r, g in enumerate(g_ids):
        c = h_pos.get(last.get(int(g), -1))
        if c is not None and ok[r, c] and c not in taken_h:
            pairs.append((r, c))
            taken_g.add(r)
            taken_h.add(c)
    free_g = [r for r in range(len(g_ids)) if r not in taken_g]
    free_h = [c for c in range(len(h_ids)) if c not in taken_h]
    if free_g and free_h:
        sub = np.where(ok[np.ix_(free_g, free_h)], 1.0 - iou[np.ix_(free_g, free_h)], 2.0)
        for a, b in zip(*hungarian(sub), strict=True):
            if sub[a, b] <= 1.0:
                pairs.append((free_g[a], free_h[b]))
    return pairs


TrackFn = Callable[[Detections, float], tuple[np.ndarray, np.ndarray]]  # dets, t -> (ids, boxes)


def run_scene(frames: Sequence[SceneFrame], track: TrackFn) -> MotMetrics:
    """Feed a scene to ``track`` (one call per frame, returning the tracked ids and boxes it reports)."""
    gt = [(f.gt_ids, f.gt_boxes) for f in frames]
    hyp = [track(f.detections, f.t) for f in frames]
    return mot_metrics(gt, hyp)


def load_recorded(path: Path) -> tuple[list[Detections], float, tuple[int, int]]:
    """(detections per frame, fps, (w, h)) from a tools/record_detections.py recording."""
    with np.load(path) as z:
        frame, boxes, scores, cls = z["frame"], z["boxes"], z["scores"], z["class_ids"]
        n, fps, size = int(z["frames"]), float(z["fps"]), [int(v) for v in z["size"]]
    per_frame = [Detections(boxes[frame == i], scores[frame == i], cls[frame == i]) for i in range(n)]
    return per_frame, fps, (size[0], size[1])
