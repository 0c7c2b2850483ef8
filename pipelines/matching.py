"""IoU of box sets and the matchings the tracker uses (pipelines.tracking), in numpy.

``greedy_match`` is the tracker's (and its compiled kernel's reference, pipelines/kernels/tracking.pyx);
``optimal_match`` (Hungarian, scipy) is there for the benchmark's comparison; ``iou_matrix`` also serves
the tracking evaluation (agent.bench.track_eval).
"""

from __future__ import annotations

import numpy as np


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` (N, 4) with every box of ``b`` (M, 4), x1y1x2y2 -> (N, M).

    Column by column ((N, 1) against (M,)): broadcasting whole (N, 1, 2) and (1, M, 2) views costs several
    times more at these sizes.
    """
    ax1, ay1, ax2, ay2 = a[:, 0:1], a[:, 1:2], a[:, 2:3], a[:, 3:4]
    bx1, by1, bx2, by2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    iw = np.minimum(ax2, bx2)
    iw -= np.maximum(ax1, bx1)
    np.maximum(iw, 0.0, out=iw)
    ih = np.minimum(ay2, by2)
    ih -= np.maximum(ay1, by1)
    np.maximum(ih, 0.0, out=ih)
    iw *= ih  # intersection
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1)
    union -= iw
    np.maximum(union, 1e-9, out=union)
    iw /= union
    return iw


_EMPTY = np.zeros(0, dtype=np.intp)


def greedy_match(
    score: np.ndarray, min_score: float, prepared: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns paired greedily, highest ``score`` first; pairs below ``min_score`` never.

    In rounds: every row whose best column has that row as its best too is paired, all at once; their
    rows and columns leave; repeat while a pair is left. The lexicographically first maximum is always
    mutually best, so every round pairs at least one, and the result is the global greedy matching.
    ``score`` is overwritten; ``prepared``: it already holds -1 (or less) for every pair below ``min_score``.
    """
    n, m = score.shape
    if n == 0 or m == 0:
        return _EMPTY, _EMPTY
    s = score
    if not prepared:
        s[s < min_score] = -1.0
    ar = np.arange(n)
    flat_row = ar * m
    rows_out: list[np.ndarray] = []
    cols_out: list[np.ndarray] = []
    while True:
        best_c = s.argmax(axis=1)
        best_r = s.argmax(axis=0)
        mutual = best_r.take(best_c) == ar
        mutual &= s.take(flat_row + best_c) >= min_score
        rows = mutual.nonzero()[0]
        if rows.size == 0:
            break
        cols = best_c.take(rows)
        rows_out.append(rows)
        cols_out.append(cols)
        if rows.size == n or rows.size == m:
            break
        s[rows] = -1.0
        s[:, cols] = -1.0
        if s.max() < min_score:
            break
    if len(rows_out) == 1:
        return rows_out[0], cols_out[0]
    if not rows_out:
        return _EMPTY, _EMPTY
    return np.concatenate(rows_out), np.concatenate(cols_out)


def optimal_match(score: np.ndarray, min_score: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairing of maximal total score (Hungarian, scipy), pairs below ``min_score`` dropped."""
    from scipy.optimize import linear_sum_assignment  # comparisons only: scipy is not a dependency

    n, m = score.shape
    if n == 0 or m == 0:
        return _EMPTY, _EMPTY
    s = np.where(score >= min_score, score, 0.0)
    rows, cols = linear_sum_assignment(s, maximize=True)
    keep = (s[rows, cols] >= min_score) & (s[rows, cols] > 0.0)
    return rows[keep], cols[keep]
