"""Multi-object tracking per camera: ByteTrack's two-stage association on a Kalman motion model.

One ``Tracker`` per camera, fed each frame's detections in capture order (the model's delivery thread).
Every live track is one row of a float64 table (``Tracker.table``, columns below): prediction,
association and the Kalman update run over all rows at once, and selecting, appending or dropping tracks
is one numpy call whatever the number of values per track. No Python loop per box.

Two implementations of ``update``: the compiled kernel (pipelines/kernels/tracking.pyx, used where the
package was built with it, about 10x cheaper at 20 objects: numpy's fixed cost per call dominates these
small arrays) and the numpy code below, which is its reference (tests/test_kernels.py: identical tables
and steps, bit for bit) and the fallback. Both take the same steps in the same order.

Per frame (``update``), as ByteTrack (Zhang et al., ECCV 2022, github.com/ifzhang/ByteTrack) does it:
1. predict every track to the frame's time (constant velocity; the time step is the real one, so frames
   the pipeline dropped widen the prediction instead of confusing it);
2. confirmed tracks (tracked or lost) <-> detections with score >= ``high_score``, IoU >= ``match_iou``;
3. tracks tracked until the previous frame and still free <-> the low-score detections (``low_score`` <=
   score < ``high_score``, which the camera does not report), IoU >= 0.5: an occluded or blurred object
   keeps its track through a dip in score;
4. tentative tracks (matched fewer than ``min_hits`` frames in a row) <-> the high-score detections left,
   IoU >= 0.3; a tentative track that misses a frame is dropped (it never had an id on the wire);
5. high-score detections still free, scoring at least ``new_score`` (ByteTrack: 0.1 above the tracking
   threshold), start tentative tracks; tracked tracks left unmatched become lost, and lost ones end
   ``max_lost_s`` after their last match. A confirmed track unmatched for more than ``max_lost_s`` at this
   frame's time (lost, or tracked before frames went missing) takes no part in step 2: it ends in this
   frame, whatever it would have matched (issue 36: a new person walking into an old track's predicted box
   got its id).
Association is class-aware (a car never continues a person's track). Matching is greedy by IoU, best
pair first. The three stages run as one greedy matching on IoU plus a stage bonus (2 for stage 2 pairs, 1
for stage 3, 0 for stage 4), which takes every pair of an earlier stage before any of a later one: the
same pairs as the stages one after the other, in one pass. The greedy matching itself is computed in
rounds of mutually-best pairs (``greedy_match``). ``match="optimal"`` runs the stages with the
Hungarian method instead (scipy; for the benchmark's comparison: docs/BENCHMARKS.md "Which tracker").

Kalman filter: state (cx, cy, w, h) and their velocities, noise proportional to the box size (ByteTrack's
weights; the width for x and w, the height for y and h, as BoT-SORT does). With diagonal initial, process
and measurement noise and each coordinate moved only by its own velocity, the 8x8 covariance stays four
independent 2x2 blocks, kept as three columns groups (var(pos), cov(pos, vel), var(vel)): every step is
element-wise and gives exactly the full filter's result.

Ids: per tracker, from 1, increasing for the tracker's life (``reset`` ends every track but never reuses
an id). A track gets its id when confirmed.

Frame times (``admit``): a NaN or infinite ``t`` or ``ts`` (a broken capture clock or container timestamp)
is replaced by the last finite one plus the nominal frame interval (1/25 s), before either path runs: kept,
it would become the last-match time of every track matched in that frame, and ``t - NaN > max_lost_s`` is
never true, so those tracks would never end (no ``end``, no ``zone_leave``, counts stuck). A frame without
any finite time before it (the tracker's first) is not tracked: its detections get no track.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from pipelines import kernels
from pipelines.frames import Detections
from pipelines.matching import greedy_match, optimal_match

# Kalman noise weights per nominal frame (ByteTrack's), scaled by the box size.
_STD_POS = 1.0 / 20.0
_STD_VEL = 1.0 / 160.0
_NOMINAL_FPS = 25.0  # the weights are per frame at this rate; other rates scale by the elapsed time
_FRAME_S = 1.0 / _NOMINAL_FPS  # what a frame without a finite time is taken to follow the previous one by
# Least IoU in the low-score and tentative stages (ByteTrack's 0.5 and 0.7 as costs 1 - IoU).
_LOW_IOU = 0.5
_TENTATIVE_IOU = 0.3


@dataclass(frozen=True)
class TrackerParams:
    """What ``Tracker`` needs (agent.config.TrackingConfig holds the user-facing keys and defaults)."""

    high_score: float = 0.4  # detections at or above continue tracks (the camera's min_score)
    new_score: float = 0.0  # ... and start new ones if also at or above this (0: high_score)
    low_score: float = 0.1  # second-stage floor; detections below never reach the tracker
    match_iou: float = 0.2  # first stage: least IoU between a predicted track and a detection
    min_hits: int = 2  # frames matched in a row before a track is confirmed (and gets its id)
    max_lost_s: float = 1.5  # a confirmed track unmatched this long ends
    match: str = "greedy"  # greedy | optimal (Hungarian per stage, needs scipy; for comparisons)

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_score <= self.high_score <= 1.0:
            got = f"{self.low_score}, {self.high_score}"
            raise ValueError(f"need 0 <= low_score <= high_score <= 1, got {got}")
        if not 0.0 < self.match_iou < 1.0:
            raise ValueError(f"match_iou: must be in (0, 1), got {self.match_iou}")
        if self.min_hits < 1 or self.max_lost_s <= 0:
            raise ValueError("min_hits must be >= 1 and max_lost_s > 0")
        if self.match not in ("greedy", "optimal"):
            raise ValueError(f"match: greedy or optimal, got {self.match!r}")


_EMPTY = np.zeros(0, dtype=np.intp)
_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_TRACKS = np.zeros(0, dtype=bool)


# ---- the track table: one float64 column per track ----
# Row k of ``Tracker.table`` (shape (ROWS, tracks)) holds one value of every track, so each quantity is a
# contiguous vector: element-wise numpy on (4, N) blocks runs at full speed, where (N, 4) column slices of
# a row-per-track table cost several times more (a 4-element inner loop per track). Selecting, appending
# or dropping tracks is one numpy call on the whole table. Ids, classes, states and counts are exact in
# float64.
POS = slice(0, 4)  # Kalman mean: cx, cy, w, h ...
VEL = slice(4, 8)  # ... and their velocities (per nominal frame)
VAR_POS = slice(8, 12)  # covariance blocks per coordinate
COV_PV = slice(12, 16)
VAR_VEL = slice(16, 20)
CUR = slice(20, 27)  # the last matched detection: x1, y1, x2, y2, score, ts (wall clock), frame id
BOX = slice(20, 24)
SCORE = 24
LAST_SEEN = 25
LAST_FRAME = 26
BEST = slice(27, 34)  # the best-scoring detection, same layout as CUR
BEST_BOX = slice(27, 31)
BEST_SCORE = 31
BEST_TS = 32
BEST_FRAME = 33
LAST_T = 34  # monotonic time of the last match (motion and ageing)
FIRST_SEEN = 35
ID = 36  # 0 while tentative
CLS = 37
STATE = 38
HITS = 39
ROWS = 40

TENTATIVE, TRACKED, LOST = 0.0, 1.0, 2.0
_NEVER = 2.0  # an IoU no pair reaches: the pair matches in no stage
# Per (track state, detection is high-score): the stage's bonus and least IoU (see the module docstring).
_STAGE_BONUS = np.array([[0.0, 0.0], [1.0, 2.0], [0.0, 2.0]])
_SIZE_ROWS = np.array([2, 3, 2, 3])  # the width scales x and w, the height y and h


# What the compiled step indexes (pipelines/kernels/tracking.pyx has the same numbers as its LAYOUT).
_LAYOUT = {
    name: (v.start if isinstance(v, slice) else v)
    for name, v in (
        ("VEL", VEL),
        ("VAR_POS", VAR_POS),
        ("COV_PV", COV_PV),
        ("VAR_VEL", VAR_VEL),
        ("CUR", CUR),
        ("SCORE", SCORE),
        ("BEST", BEST),
        ("BEST_SCORE", BEST_SCORE),
        ("LAST_T", LAST_T),
        ("FIRST_SEEN", FIRST_SEEN),
        ("ID", ID),
        ("CLS", CLS),
        ("STATE", STATE),
        ("HITS", HITS),
        ("ROWS", ROWS),
        ("STEP", 2),  # the step's revision (2: expiry before matching): an older build falls back to numpy
    )
}


def _kernel_module() -> ModuleType | None:
    """The compiled step, if built and laid out as this module's table (pipelines.kernels)."""
    return kernels.load("tracking", _LAYOUT)


def _size2(pos: np.ndarray) -> np.ndarray:
    """(4, N) squared box size per coordinate (width for x and w, height for y and h), at least 1."""
    s = np.maximum(pos.take(_SIZE_ROWS, axis=0), 1.0)
    s *= s
    return s


def _cxcywh(box: np.ndarray) -> np.ndarray:
    """(4, N) x1, y1, x2, y2 -> cx, cy, w, h."""
    out = np.empty(box.shape)
    np.add(box[0:2], box[2:4], out=out[0:2])
    out[0:2] *= 0.5
    np.subtract(box[2:4], box[0:2], out=out[2:4])
    return out


@dataclass(slots=True)
class Ended:
    """Confirmed tracks that ended in one step: their last table columns (rows as ``Tracker.table``)."""

    table: np.ndarray  # (ROWS, K)
    rows: np.ndarray  # their columns before the step, for state kept beside the tracker
    reason: str  # lost | gap | reconnect | stopped | removed | reconfigured

    def __len__(self) -> int:
        return int(self.table.shape[1])


class Step:
    """What one ``update`` (or ``reset``) did, in track indices (table columns) after it.

    ``row_map[i]``: the index that track ``i`` had before the step, -1 for a track started in it; None when
    the tracks did not change. State kept beside the tracker (zones, lines, events) follows with
    ``state[row_map]``.
    """

    __slots__ = ("active", "confirmed", "det_rows", "ended", "ids", "improved", "row_map")

    def __init__(self, det_rows: np.ndarray, row_map: np.ndarray | None = None, ended: Ended | None = None):
        self.det_rows = det_rows  # (detections,) the track of each detection, -1 for none
        self.row_map = row_map
        self.confirmed = _EMPTY  # tracks confirmed in this frame (their first frame with an id), oldest first
        self.improved = _EMPTY  # tracks whose best detection is this frame's (new ones included), same order
        self.ended = ended
        self.ids = _NO_IDS  # (detections,) int64 the id of each detection's track, 0 for none (yet)
        self.active = _NO_TRACKS  # (tracks,) bool: confirmed and matched in this frame


class Tracker:
    """ByteTrack for one camera. Not thread-safe: one caller at a time (the camera's delivery thread).

    ``table``: (ROWS, tracks), one column per live track (tentative, tracked or lost); "row" in the names
    of ``Step`` means a track's index, i.e. its column here.
    """

    def __init__(self, params: TrackerParams | None = None, first_id: int = 1, compiled: bool = True) -> None:
        self._next_id = int(first_id)
        self._t: float | None = None
        # The last finite frame times (``admit``); kept across ``reset``: they only stand in for bad ones.
        self._last_t: float | None = None
        self._last_ts: float | None = None
        self.table = np.zeros((ROWS, 0))
        # The compiled step (pipelines/kernels/tracking.pyx) where it was built; False: the numpy code.
        self._module = _kernel_module() if compiled else None
        self._kernel: Any = None
        self.configure(params or TrackerParams())

    def configure(self, params: TrackerParams) -> None:
        """New settings from the next update on (callers reset first: live tracks must not carry over)."""
        self.params = p = params
        self._stage_iou = np.array([[_NEVER, _TENTATIVE_IOU], [_LOW_IOU, p.match_iou], [_NEVER, p.match_iou]])
        # How long a track may go unmatched, by state: tentative not at all, lost max_lost_s.
        self._max_age = np.array([0.0, np.inf, p.max_lost_s])
        if self._module is not None and p.match == "greedy":
            self._kernel = self._module.Kernel(
                p.high_score,
                p.new_score,
                p.min_hits,
                self._stage_iou.tolist(),
                _STAGE_BONUS.tolist(),
                self._max_age.tolist(),
                _STD_POS**2,
                (_STD_VEL / _STD_POS) ** 2,
                (2.0 * _STD_POS) ** 2,
                (10.0 * _STD_VEL) ** 2,
            )
        else:
            self._kernel = None

    @property
    def compiled(self) -> bool:
        """Whether updates run the compiled kernel (greedy matching only; ``optimal`` is numpy + scipy)."""
        return self._kernel is not None

    def __len__(self) -> int:
        return int(self.table.shape[1])

    @property
    def next_id(self) -> int:
        """The id the next confirmed track gets."""
        return self._next_id

    @property
    def t(self) -> float | None:
        """Monotonic time of the last update (None before the first and after a reset)."""
        return self._t

    def matched(self) -> np.ndarray:
        """(tracks,) bool: matched a detection in the last update."""
        return self.table[LAST_T] == self._t

    def boxes(self) -> np.ndarray:
        """(tracks, 4) the filtered boxes (x1y1x2y2): the Kalman estimate after the last update."""
        pos = self.table[POS]
        half = 0.5 * pos[2:4]
        return np.concatenate((pos[0:2] - half, pos[0:2] + half)).T

    # ---- the step ---------------------------------------------------------------------------------
    def admit(self, t: float, ts: float) -> tuple[float, float] | None:
        """The frame times the tracker uses for (``t``, ``ts``): each NaN or infinite one replaced by the
        last finite one plus 1/25 s (the module docstring says why); None when a bad one has no finite one
        before it (the frame is not tracked). Idempotent for finite times (callers may check first)."""
        t_ok, ts_ok = math.isfinite(t), math.isfinite(ts)
        if (not t_ok and self._last_t is None) or (not ts_ok and self._last_ts is None):
            return None
        t = float(t) if t_ok else self._last_t + _FRAME_S  # type: ignore[operator]
        ts = float(ts) if ts_ok else self._last_ts + _FRAME_S  # type: ignore[operator]
        self._last_t, self._last_ts = t, ts
        return t, ts

    def update(self, dets: Detections, t: float, ts: float, frame_id: int = 0) -> Step:
        """One frame: ``dets`` (scores >= low_score), ``t`` monotonic seconds (motion, ageing; increasing),
        ``ts`` wall clock (first/last seen), ``frame_id`` (kept with the best detection). Non-finite times
        are repaired first (``admit``)."""
        times = self.admit(t, ts)
        if times is None:
            return self._untracked(len(dets.scores))
        t, ts = times
        p = self.params
        k = 0.0 if self._t is None else max(0.0, t - self._t) * _NOMINAL_FPS
        self._t = t
        if self._kernel is not None:
            return self._update_compiled(dets, t, ts, frame_id, k)
        n_old = self.table.shape[1]
        n_det = dets.scores.shape[0]
        det_rows = np.empty(n_det, np.intp)
        det_rows.fill(-1)
        # The detections in the table's CUR layout: box, score, ts, frame.
        cur = np.empty((7, n_det))
        cur[0:4] = dets.boxes.T
        cur[4] = dets.scores
        cur[5] = ts
        cur[6] = frame_id
        high = cur[4] >= p.high_score
        step = Step(det_rows)
        if n_old:
            tab = self.table
            if k > 0.0:
                self._predict(k)
            rows = cols = _EMPTY
            if n_det:
                rows, cols = self._associate(dets.class_ids, cur, high)
                if rows.size > 1:  # in track order: confirmed and improved list tracks oldest first
                    order = rows.argsort()
                    rows, cols = rows.take(order), cols.take(order)
            state = tab[STATE]
            state[state == TRACKED] = LOST  # the matched ones are tracked again in _correct
            if rows.size:
                det_rows[cols] = rows
                self._correct(rows, cur.take(cols, axis=1), t, step)
            drop = (t - tab[LAST_T]) > self._max_age.take(state.astype(np.intp))
            if np.count_nonzero(drop):
                self._drop(drop, step)
        if n_det:
            starts = high if p.new_score <= p.high_score else cur[4] >= p.new_score
            new = (starts & (det_rows < 0)).nonzero()[0]
            if new.size:
                self._append(cur.take(new, axis=1), dets.class_ids.take(new), t, new, step)
        tab = self.table
        step.active = tab[ID] > 0
        step.active &= tab[LAST_T] == t
        if n_det and tab.shape[1]:
            step.ids = tab[ID].take(det_rows, mode="clip").astype(np.int64)  # -1 (no track) clipped ...
            step.ids[det_rows < 0] = 0  # ... and zeroed
        elif n_det:
            step.ids = np.zeros(n_det, np.int64)
        return step

    def _untracked(self, n_det: int) -> Step:
        """A frame the tracker cannot place in time: no detection joins or starts a track."""
        step = Step(np.full(n_det, -1, np.intp))
        step.ids = np.zeros(n_det, np.int64)
        step.active = np.zeros(len(self), bool)
        return step

    def reset(self, reason: str) -> Step:
        """End every track now (a camera reconnect, a frame gap, a reconfiguration); ids keep counting."""
        tab = self.table
        gone = (tab[STATE] != TENTATIVE).nonzero()[0]
        self.table = np.zeros((ROWS, 0))
        self._t = None
        return Step(_EMPTY, _EMPTY, Ended(tab.take(gone, axis=1), gone, reason) if gone.size else None)

    # ---- internals ----------------------------------------------------------------------------
    def _update_compiled(self, dets: Detections, t: float, ts: float, frame_id: int, k: float) -> Step:
        """``update`` by the compiled kernel: the same steps and arithmetic as the numpy code below.
        Detections of other dtypes than pipelines.frames' (float32, int32) are converted first."""
        boxes, scores, cls = dets.boxes, dets.scores, dets.class_ids
        if boxes.dtype != np.float32 or scores.dtype != np.float32 or cls.dtype != np.int32:
            boxes, scores, cls = boxes.astype(np.float32), scores.astype(np.float32), cls.astype(np.int32)
        table, det_rows, row_map, confirmed, improved, gone, ended, ids, active, self._next_id = (
            self._kernel.update(self.table, boxes, scores, cls, t, ts, frame_id, k, self._next_id)
        )
        self.table = table
        step = Step(det_rows, row_map, None if ended is None else Ended(ended, gone, "lost"))
        step.confirmed = confirmed
        step.improved = improved
        step.ids = ids
        step.active = active
        return step

    def _associate(self, cls: np.ndarray, cur: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ByteTrack stages at once: (track indices, detection indices) matched."""
        tab = self.table
        # IoU of the predicted boxes (N) with the detections (M): corners as (2, N, 1) against (2, 1, M), so
        # each step is one numpy call over both axes of the picture.
        pos = tab[POS]
        half = 0.5 * pos[2:4]
        lo = pos[0:2] - half
        hi = pos[0:2] + half
        inter = np.minimum(hi[:, :, None], cur[2:4, None, :])
        inter -= np.maximum(lo[:, :, None], cur[0:2, None, :])
        np.maximum(inter, 0.0, out=inter)
        iou = inter[0] * inter[1]
        union = (pos[2] * pos[3])[:, None] + (cur[2] - cur[0]) * (cur[3] - cur[1])
        union -= iou
        iou /= union  # w, h >= 1 after prediction: never 0
        # Each pair's stage: the least IoU it needs (another class: none is enough) and its bonus.
        state = tab[STATE].astype(np.intp)[:, None]
        hi_det = high.astype(np.intp)
        need = self._stage_iou[state, hi_det]
        need[tab[CLS][:, None] != cls] = _NEVER
        # Confirmed tracks unmatched for longer than max_lost_s at this frame's time end in it: they match
        # nothing (the module docstring). Tentative ones left at their first miss.
        need[(tab[STATE] != TENTATIVE) & ((self._t - tab[LAST_T]) > self.params.max_lost_s)] = _NEVER
        ok = iou >= need
        if self.params.match == "optimal":
            return self._associate_optimal(iou, ok, state[:, 0], hi_det)
        iou += _STAGE_BONUS[state, hi_det]
        iou[~ok] = -1.0
        return greedy_match(iou, 0.0, prepared=True)

    @staticmethod
    def _associate_optimal(
        iou: np.ndarray, ok: np.ndarray, state: np.ndarray, hi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same stages one after the other, each by the Hungarian method (comparisons only)."""
        free_r = np.ones(iou.shape[0], bool)
        free_c = np.ones(iou.shape[1], bool)
        out_r, out_c = [], []
        for stage_states, stage_hi in (((1, 2), 1), ((1,), 0), ((0,), 1)):
            r_sel = (free_r & np.isin(state, stage_states)).nonzero()[0]
            c_sel = (free_c & (hi == stage_hi)).nonzero()[0]
            sub = np.where(ok[np.ix_(r_sel, c_sel)], iou[np.ix_(r_sel, c_sel)], 0.0)
            r, c = optimal_match(sub, 1e-9)
            free_r[r_sel[r]] = False
            free_c[c_sel[c]] = False
            out_r.append(r_sel[r])
            out_c.append(c_sel[c])
        return np.concatenate(out_r), np.concatenate(out_c)

    def _predict(self, k: float) -> None:
        tab = self.table
        n = tab.shape[1]
        size2 = np.maximum(tab[2:4], 1.0)  # (w, h): the size x and w, y and h scale with
        size2 *= size2
        tab[POS] += k * tab[VEL]
        np.maximum(tab[2:4], 1.0, out=tab[2:4])
        var_pos, cov_pv, var_vel = tab[VAR_POS], tab[COV_PV], tab[VAR_VEL]
        grow = var_vel * (k * k)
        grow += (2.0 * k) * cov_pv
        var_pos += grow
        size2 *= k * _STD_POS**2
        var_pos.reshape(2, 2, n)[...] += size2  # rows (x, y), (w, h) against (w, h)
        cov_pv += k * var_vel
        size2 *= (_STD_VEL / _STD_POS) ** 2
        var_vel.reshape(2, 2, n)[...] += size2

    def _correct(self, rows: np.ndarray, cur: np.ndarray, t: float, step: Step) -> None:
        """Kalman update of tracks ``rows`` with their detections (``cur``: (7, K) CUR layout), and their
        bookkeeping."""
        p = self.params
        g = self.table.take(rows, axis=1)
        k = g.shape[1]
        r = np.maximum(g[2:4], 1.0)
        r *= r
        r *= _STD_POS**2  # measurement noise of (x, w) and (y, h)
        s = g[VAR_POS].reshape(2, 2, k) + r  # (x, y), (w, h)
        gain = g[8:16].reshape(2, 4, k) / s.reshape(4, k)  # position and velocity gains: cov(pos, .) / S
        r = r / s  # 1 - position gain, (2, 2, k)
        innovation = _cxcywh(cur[0:4])
        innovation -= g[POS]
        g[0:8].reshape(2, 4, k)[...] += gain * innovation
        g[VAR_VEL] -= gain[1] * g[COV_PV]  # var(vel) - cov(pos, vel)^2 / S, before cov(pos, vel) shrinks
        g[8:16].reshape(2, 4, k)[...] *= r.reshape(4, k)  # var(pos), cov(pos, vel) times (1 - position gain)
        g[CUR] = cur
        g[LAST_T] = t
        hits = g[HITS]
        hits += 1.0
        state = g[STATE]
        full = hits >= p.min_hits
        confirm = (state == TENTATIVE) & full
        state[full] = TRACKED  # confirmed tracks always have min_hits
        n_confirm = np.count_nonzero(confirm)
        if n_confirm:
            # Ids in track order (older tracks first): ``rows`` is sorted.
            g[ID, confirm] = np.arange(self._next_id, self._next_id + n_confirm)
            self._next_id += int(n_confirm)
            step.confirmed = rows[confirm]
        improved = g[SCORE] > g[BEST_SCORE]
        if np.count_nonzero(improved):
            g[BEST][:, improved] = g[CUR][:, improved]
            step.improved = rows[improved]
        self.table[:, rows] = g

    def _drop(self, drop: np.ndarray, step: Step) -> None:
        tab = self.table
        gone = (drop & (tab[STATE] == LOST)).nonzero()[0]
        if gone.size:
            step.ended = Ended(tab.take(gone, axis=1), gone, "lost")
        keep = (~drop).nonzero()[0]
        new_index = np.full(tab.shape[1], -1, np.intp)
        new_index[keep] = np.arange(keep.size)
        hit = step.det_rows >= 0
        step.det_rows[hit] = new_index.take(step.det_rows[hit])
        step.confirmed = new_index.take(step.confirmed)
        step.improved = new_index.take(step.improved)
        self.table = tab.take(keep, axis=1)
        step.row_map = keep

    def _append(self, cur: np.ndarray, cls: np.ndarray, t: float, dets: np.ndarray, step: Step) -> None:
        n = cur.shape[1]
        new = np.zeros((ROWS, n))
        new[POS] = _cxcywh(cur[0:4])
        size2 = _size2(new[POS])
        np.multiply(size2, (2.0 * _STD_POS) ** 2, out=new[VAR_POS])
        np.multiply(size2, (10.0 * _STD_VEL) ** 2, out=new[VAR_VEL])
        new[CUR] = cur
        new[BEST] = cur
        new[LAST_T] = t
        new[FIRST_SEEN] = cur[5]
        new[CLS] = cls
        new[HITS] = 1.0
        n_old = self.table.shape[1]
        added = np.arange(n_old, n_old + n)
        if self.params.min_hits <= 1:  # confirmed at once
            new[STATE] = TRACKED
            new[ID] = np.arange(self._next_id, self._next_id + n)
            self._next_id += int(n)
            step.confirmed = np.concatenate((step.confirmed, added))
        self.table = np.concatenate((self.table, new), axis=1)
        step.det_rows[dets] = added
        step.improved = np.concatenate((step.improved, added))
        kept = step.row_map if step.row_map is not None else np.arange(n_old)
        step.row_map = np.concatenate((kept, np.full(n, -1, np.intp)))
