"""Lines (directed segments A -> B) of a camera, and which tracks crossed them.

Each track has a side per line, set when its anchor is more than 5 % of its box height away from the line
(hysteresis: jitter on the line counts nothing). A change of side, with the anchor's projection within the
segment at that moment, is a crossing: ``in`` from the left of A -> B to its right as seen on the picture
(y down: for a line drawn left to right, ``in`` is downwards), ``out`` the other way.

Everything per frame is vectorised over tracks x lines; compiled where built (pipelines/kernels/
regions.pyx), the numpy code here being the reference and fallback (tests/test_kernels.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines.regions import ANCHORS, Regions, RegionSpec, Transition, classes
from pipelines.rules import Crossing
from pipelines.tracking import CLS, ID, POS

LINE_HYSTERESIS = 0.05  # of the box height


class Lines(Regions):
    """The lines of one camera, each track's side of each, and the crossings counted."""

    def __init__(self, specs: Sequence[RegionSpec], n_classes: int, compiled: bool = True) -> None:
        super().__init__(specs, n_classes, Crossing.columns, compiled)
        n = len(self.specs)
        # One anchor for every line (the usual case): (N, 1) anchors instead of (N, lines).
        self._anchor = ANCHORS[self.specs[0].anchor] if len({s.anchor for s in self.specs}) == 1 else None
        self._size: tuple[int, int] | None = None
        self.counts = np.zeros((n, 2, n_classes + 1), np.int64)  # per line: [in, out] per class

    def _compile(self, size: tuple[int, int]) -> None:
        a = np.array([s.pixels(size)[0] for s in self.specs]).reshape(-1, 2)
        b = np.array([s.pixels(size)[1] for s in self.specs]).reshape(-1, 2)
        d = b - a
        length = np.hypot(d[:, 0], d[:, 1])
        # Signed distance to the line through A and B: positive on the right of A -> B (y down).
        self._nx, self._ny = -d[:, 1] / length, d[:, 0] / length
        self._c = self._nx * a[:, 0] + self._ny * a[:, 1]
        # Projection onto A -> B as a fraction of its length (0 at A, 1 at B).
        self._ux, self._uy = d[:, 0] / length**2, d[:, 1] / length**2
        self._u0 = self._ux * a[:, 0] + self._uy * a[:, 1]
        self._size = size
        if self._module is not None:
            self._kernel = self._module.LinesKernel(
                self._nx,
                self._ny,
                self._c,
                self._ux,
                self._uy,
                self._u0,
                self._offsets_c,
                self._mask_u8,
                LINE_HYSTERESIS,
                self.n_classes,
            )

    def update(
        self,
        table: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        size: tuple[int, int],
        out: list[Transition],
    ) -> bool:
        """One frame (after ``follow``): sides of the ``active`` tracks (confirmed and seen in this frame);
        crossings appended to ``out``; True when a count changed. Tracks confirmed in this frame only take
        their side."""
        if self._size != size:
            self._compile(size)
        if self._kernel is None:
            return self._update_numpy(table, classes(table, self.n_classes), active, confirmed, out)
        tracks, lines, dirs, cls = self._kernel.step(table, active, confirmed, self.side)
        if not tracks.size:
            return False
        for t, j, d, c in zip(tracks.tolist(), lines.tolist(), dirs.tolist(), cls.tolist(), strict=True):
            self.counts[j, d, c] += 1
            out.append(_crossing(table, t, j, d))
        return True

    def _update_numpy(
        self,
        table: np.ndarray,
        cls: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        out: list[Transition],
    ) -> bool:
        pos = table[POS]
        cx, cy, w, h = pos[0][:, None], pos[1][:, None], pos[2][:, None], pos[3][:, None]
        if self._anchor is not None:
            ox, oy = self._anchor
            x = cx + ox * w  # also for 0: the compiled step computes the same (NaN for an infinite box)
            y = cy + oy * h
        else:
            x = cx + w * self._offsets[0]
            y = cy + h * self._offsets[1]
        dist = x * self._nx
        dist += y * self._ny
        dist -= self._c
        eps = LINE_HYSTERESIS * h
        now = (dist > eps).view(np.int8) - (dist < -eps).view(np.int8)
        np.copyto(now, 0, where=~active[:, None])
        crossed = (now * self.side) < 0
        if confirmed.size:
            crossed[confirmed] = False
        np.copyto(self.side, now, where=now != 0)
        if not np.count_nonzero(crossed):
            return False
        tracks, lines = crossed.nonzero()
        changed = False
        for t, j in zip(tracks.tolist(), lines.tolist(), strict=True):
            u = x[t, j % x.shape[1]] * self._ux[j] + y[t, j % y.shape[1]] * self._uy[j] - self._u0[j]
            if not 0.0 <= u <= 1.0:
                continue  # went round the end of the segment: a new side, no crossing
            c = int(cls[t])
            if not self._mask[c, j]:
                continue
            direction = 0 if now[t, j] > 0 else 1
            self.counts[j, direction, c] += 1
            out.append(_crossing(table, t, j, direction))
            changed = True
        return changed

    @property
    def side(self) -> np.ndarray:
        """(tracks, lines) int8: each track's side of each line, -1 left, +1 right, 0 not yet known."""
        return self.state["side"]

    def clear_sides(self) -> None:
        """Every track gone (a reset); the counts stay."""
        self.state.clear()

    def after(self, kind: str, j: int) -> dict[str, Any]:
        """``counts`` {in, out}: the line's crossings after the event."""
        return {"counts": {"in": int(self.counts[j, 0].sum()), "out": int(self.counts[j, 1].sum())}}


def _crossing(table: np.ndarray, t: int, j: int, direction: int) -> Transition:
    fields = {"direction": ("in", "out")[direction]}
    return Transition("line_cross", j, int(table[ID, t]), int(table[CLS, t]), fields)
