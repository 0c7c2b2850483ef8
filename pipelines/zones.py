"""Zones (polygons) of a camera, and which tracks are in them.

A track is *in* a zone once its anchor has been inside the polygon for ``inertia`` consecutive frames in
which it was detected (and out again after as many frames outside); a track confirmed this frame starts in
or out at once. Tracks not detected in a frame (lost for a moment) keep their state, so a short occlusion
is neither a leave nor an enter; a track that ends leaves its zones. Only tracks of the zone's labels
count. Point in polygon is the crossing-number test over every edge of every zone at once.

Everything per frame is vectorised over tracks x zones x edges. Where the package was built with them, the
per-frame steps (test, inertia, enters and leaves, counts, following the tracker's rows) run compiled
(pipelines/kernels/regions.pyx); the numpy code here is their reference and fallback
(tests/test_kernels.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipelines.regions import ANCHORS, Regions, RegionSpec, Transition, classes, follow_rows, moved_rows
from pipelines.tracking import CLS, ID, POS, Ended

_NO_ROWS = np.zeros(0, np.intp)  # a frame in which no track entered or left
_NO_DWELL = np.zeros(0)


class Zones(Regions):
    """The zones of one camera and which tracks are in them (arrays aligned with the tracker's tracks)."""

    def __init__(self, specs: Sequence[RegionSpec], n_classes: int, compiled: bool = True) -> None:
        super().__init__(specs, n_classes, compiled)
        z = len(self.specs)
        self._any_label = all(s.labels is None for s in self.specs)
        self._one_anchor = len({s.anchor for s in self.specs}) <= 1
        self._anchor = ANCHORS[self.specs[0].anchor] if self.specs else (0.0, 0.0)
        inertia = {s.inertia for s in self.specs}
        # One number where every zone has the same (a scalar compare is cheaper than a broadcast one).
        self._inertia: int | np.ndarray = (
            inertia.pop() if len(inertia) == 1 else np.array([s.inertia for s in self.specs], np.int16)
        )
        self._inertia_z = np.array([s.inertia for s in self.specs], np.int16)
        self._size: tuple[int, int] | None = None
        # State per (track, zone).
        self.inside = np.zeros((0, z), bool)  # in the zone (after inertia)
        self.entered_at = np.zeros((0, z))  # wall clock of the enter
        self.visited = np.zeros((0, z), bool)  # ever in it (the object's "zones entered")
        self._streak = np.zeros((0, z), np.int16)  # frames in a row the raw test disagreed with `inside`
        self.counts = np.zeros((z, n_classes + 1), np.int64)  # per zone, per class: tracks inside

    def _compile(self, size: tuple[int, int]) -> None:
        """Edges of every zone in pixels of ``size``, grouped by zone (crossing-number test)."""
        x1s, y1s, x2s, y2s, starts, owner = [], [], [], [], [], []
        for j, spec in enumerate(self.specs):
            pts = spec.pixels(size)
            nxt = np.roll(pts, -1, axis=0)
            starts.append(len(x1s))
            x1s += pts[:, 0].tolist()
            y1s += pts[:, 1].tolist()
            x2s += nxt[:, 0].tolist()
            y2s += nxt[:, 1].tolist()
            owner += [j] * len(pts)
        x1, y1, x2, y2 = (np.asarray(v, np.float64) for v in (x1s, y1s, x2s, y2s))
        dy = y2 - y1
        self._ex1, self._ey1, self._ey2 = x1, y1, y2
        self._slope = np.divide(x2 - x1, dy, out=np.zeros_like(dy), where=dy != 0)
        self._starts = np.asarray(starts, np.intp)
        self._edge_zone = np.asarray(owner, np.intp)
        self._size = size
        if self._module is not None:
            self._kernel = self._module.ZonesKernel(
                self._inertia_z,
                x1,
                y1,
                y2,
                self._slope,
                np.asarray([*starts, len(x1s)], np.intp),  # each zone's first edge, and the end
                self._offsets_c,
                self._mask_u8,
                not self._any_label,
                self.n_classes,
            )

    def test(self, table: np.ndarray, cls: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """(tracks, Z) bool: each track's anchor inside each zone and the zone counting its class
        (``cls``: from ``classes``)."""
        if self._size != size:
            self._compile(size)
        pos = table[POS]
        cx, cy, w, h = pos[0][:, None], pos[1][:, None], pos[2][:, None], pos[3][:, None]
        if self._one_anchor:
            ox, oy = self._anchor
            x = cx + ox * w  # also for 0: the compiled step computes the same (NaN for an infinite box)
            y = cy + oy * h
        else:
            x = (cx + w * self._offsets[0]).take(self._edge_zone, axis=1)
            y = (cy + h * self._offsets[1]).take(self._edge_zone, axis=1)
        crosses = (self._ey1 > y) != (self._ey2 > y)
        xint = y - self._ey1
        xint *= self._slope
        xint += self._ex1
        crosses &= x < xint
        inside = np.logical_xor.reduceat(crosses, self._starts, axis=1)
        if not self._any_label:
            inside &= self._mask.take(cls, axis=0)
        return inside

    def update(
        self,
        table: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        ts: float,
        size: tuple[int, int],
        out: list[Transition],
    ) -> bool:
        """One frame, after the tracker's step (and ``follow``): ``active`` (tracks,) bool, tracks both
        confirmed and seen in this frame (the others keep their state), ``confirmed`` indices of tracks
        confirmed in it. Appends enters and leaves to ``out``; True when a count changed."""
        if self._size != size:
            self._compile(size)
        step = self._kernel.step if self._kernel is not None else self._step_numpy
        tracks, zones, dwell, counts = step(
            table, active, confirmed, self.inside, self._streak, self.entered_at, self.visited, ts
        )
        if counts is None:
            return False
        self.counts = counts  # a new array: readers in other threads never see it half counted
        ids = table[ID].take(tracks).astype(np.int64).tolist()
        class_ids = table[CLS].take(tracks).astype(np.int64).tolist()
        for t, c, z, d in zip(ids, class_ids, zones.tolist(), dwell.tolist(), strict=True):
            if d != d:  # NaN: an enter
                out.append(Transition("zone_enter", z, t, c))
            else:
                out.append(Transition("zone_leave", z, t, c, d))
        return True

    def _step_numpy(
        self,
        table: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        inside: np.ndarray,
        streak: np.ndarray,
        entered_at: np.ndarray,
        visited: np.ndarray,
        ts: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The compiled ``ZonesKernel.step`` in numpy (its reference): the same arguments, updates and
        result (flipped tracks and zones in row-major order, dwell NaN for an enter, new counts or None)."""
        cls = classes(table, self.n_classes)
        assert self._size is not None
        raw = self.test(table, cls, self._size)
        np.copyto(raw, inside, where=~active[:, None])
        differs = raw != inside
        streak += 1
        streak *= differs
        flip = streak >= self._inertia
        if confirmed.size:
            flip[confirmed] = differs[confirmed]  # a new track starts in or out at once
        if not np.count_nonzero(flip):
            return _NO_ROWS, _NO_ROWS, _NO_DWELL, None
        streak[flip] = 0
        inside ^= flip
        tracks, zones = flip.nonzero()
        entered = inside[tracks, zones]
        dwell = np.where(entered, np.nan, ts - entered_at[tracks, zones])
        entered_at[tracks[entered], zones[entered]] = ts
        visited[tracks[entered], zones[entered]] = True
        return tracks, zones, dwell, self._counts(cls)

    def follow(self, row_map: np.ndarray) -> None:
        """Re-align the per-track state with the tracker's tracks after a step that added or dropped some."""
        if self._module is not None:
            follow = self._module.follow_rows
            for name in ("inside", "entered_at", "visited", "_streak"):
                setattr(self, name, follow(row_map, getattr(self, name)))
            return
        moved = moved_rows(row_map)
        for name in ("inside", "entered_at", "visited", "_streak"):
            setattr(self, name, follow_rows(getattr(self, name), row_map, moved))

    def end(self, ended: Ended, ts: float, out: list[Transition]) -> bool:
        """Ended tracks (rows of the state before ``follow``) leave their zones; True if a count changed."""
        inside = self.inside.take(ended.rows, axis=0)
        if not np.count_nonzero(inside):
            return False
        for k, z in zip(*inside.nonzero(), strict=True):
            row = ended.rows[k]
            dwell = ts - self.entered_at[row, z]
            tid, cls = int(ended.table[ID, k]), int(ended.table[CLS, k])
            out.append(Transition("zone_leave", int(z), tid, cls, dwell, reason=ended.reason))
            self.inside[row, z] = False
        return True

    def visited_by(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), Z) bool: zones each of these tracks has been in."""
        return self.visited.take(rows, axis=0)

    def _counts(self, cls: np.ndarray) -> np.ndarray:
        """(Z, classes + 1) tracks inside each zone by class (``cls``: from ``classes``)."""
        tracks, zones = self.inside.nonzero()
        width = self.n_classes + 1
        counts = np.bincount(zones * width + cls.take(tracks), minlength=len(self.specs) * width)
        return counts.reshape(len(self.specs), width)

    def recount(self, table: np.ndarray) -> None:
        """Counts from ``inside`` again (tracks of ``table``, after ``follow``)."""
        self.counts = self._counts(classes(table, self.n_classes))

    def clear(self) -> None:
        """Every track out of every zone, counts zero (a reset: the caller reports the leaves first)."""
        z = len(self.specs)
        self.inside = np.zeros((0, z), bool)
        self.entered_at = np.zeros((0, z))
        self.visited = np.zeros((0, z), bool)
        self._streak = np.zeros((0, z), np.int16)
        self.counts = np.zeros((z, self.n_classes + 1), np.int64)
