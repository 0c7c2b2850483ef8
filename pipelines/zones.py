"""Zones (polygons) of a camera, and which tracks are in them.

A track is *in* a zone once its anchor has been inside the polygon for ``inertia`` consecutive frames in
which it was detected and for ``inertia_s`` seconds (frame times, from the first of those frames to this
one), and out again after as long outside; a track confirmed this frame starts in or out at once. The time
is what filters flicker at a zone's edge: a box wobbling across it for 0.1-0.4 s is as many frames as the
camera's rate makes it, the same time at any rate (issue 36: on the MOT15 trajectories, 2 frames counted
11-13 entries where 7 happened; tools/track_eval.py). Tracks not detected in a frame (lost for a moment)
keep their state, so a short occlusion is neither a leave nor an enter; a track that ends leaves its zones.
Only tracks of the zone's labels count. Point in polygon is the crossing-number test over every edge of
every zone at once.

Everything per frame is vectorised over tracks x zones x edges. Where the package was built with them, the
per-frame steps (test, inertia, enters and leaves, counts, following the tracker's rows) run compiled
(pipelines/kernels/regions.pyx); the numpy code here is their reference and fallback
(tests/test_kernels.py). Both update the same state table (pipelines.state: occupancy's columns, declared
by pipelines.rules.Occupancy). The zone rules turned on by the zones' config (pipelines.rules.ZoneRule,
e.g. loitering) run after that step, on the same table, in numpy on both paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines.regions import ANCHORS, Regions, RegionSpec, Transition, classes
from pipelines.rules import Occupancy, ZoneRule, zone_rules
from pipelines.tracking import CLS, ID, POS, Ended

_NO_ROWS = np.zeros(0, np.intp)  # a frame in which no track entered or left
_NO_DWELL = np.zeros(0)
_MAX_STREAK = np.iinfo(np.int16).max  # streaks stop counting there (an inertia_s can outlast them)


class Zones(Regions):
    """The zones of one camera and which tracks are in them (arrays aligned with the tracker's tracks)."""

    def __init__(self, specs: Sequence[RegionSpec], n_classes: int, compiled: bool = True) -> None:
        super().__init__(specs, n_classes, Occupancy.columns, compiled)
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
        self._inertia_s = np.array([s.inertia_s for s in self.specs], np.float64)
        self._timed = bool(np.any(self._inertia_s > 0.0))  # else the time test passes every flip: skipped
        self._size: tuple[int, int] | None = None
        self.counts = np.zeros((z, n_classes + 1), np.int64)  # per zone, per class: tracks inside
        # The zone rules some zone turns on, each with its own columns in the table.
        self.rules: tuple[ZoneRule, ...] = tuple(r(self.specs) for r in zone_rules() if r.wanted(self.specs))
        for rule in self.rules:
            self.state.add(rule.columns)

    @property
    def inside(self) -> np.ndarray:
        """(tracks, Z) bool: in the zone (after inertia)."""
        return self.state["inside"]

    @property
    def visited(self) -> np.ndarray:
        """(tracks, Z) bool: ever in it (the object's "entered_zones")."""
        return self.state["visited"]

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
                self._inertia_s,
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
        stale: bool = False,
    ) -> bool:
        """One frame, after the tracker's step (and ``follow``): ``active`` (tracks,) bool, tracks both
        confirmed and seen in this frame (the others keep their state), ``confirmed`` indices of tracks
        confirmed in it. Appends enters, leaves and the zone rules' transitions to ``out``; True when a
        count changed. ``stale``: tracks left before the step (``end``), count again in any case."""
        if self._size != size:
            self._compile(size)
        step = self._kernel.step if self._kernel is not None else self._step_numpy
        st = self.state
        tracks, zones, dwell, counts = step(
            table,
            active,
            confirmed,
            st["inside"],
            st["streak"],
            st["since"],
            st["entered_at"],
            st["visited"],
            ts,
        )
        changed = counts is not None
        if changed:
            self.counts = counts  # a new array: readers in other threads never see it half counted
            ids = table[ID].take(tracks).astype(np.int64).tolist()
            class_ids = table[CLS].take(tracks).astype(np.int64).tolist()
            for t, c, z, d in zip(ids, class_ids, zones.tolist(), dwell.tolist(), strict=True):
                if d != d:  # NaN: an enter
                    out.append(Transition("zone_enter", z, t, c))
                else:
                    out.append(Transition("zone_leave", z, t, c, {"dwell_s": d, "reason": None}))
        elif stale:
            self.counts = self._counts(classes(table, self.n_classes))
            changed = True
        for rule in self.rules:
            changed |= rule.step(st, table, active, ts, out)
        return changed

    def _step_numpy(
        self,
        table: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        inside: np.ndarray,
        streak: np.ndarray,
        since: np.ndarray,
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
        np.copyto(since, ts, where=differs & (streak == 0))  # a streak's first frame
        streak += streak < _MAX_STREAK
        streak *= differs
        flip = streak >= self._inertia
        if self._timed:
            flip &= (ts - since) >= self._inertia_s
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

    def end(self, ended: Ended, ts: float, out: list[Transition]) -> bool:
        """Ended tracks (rows of the state before ``follow``) leave their zones; True if a count changed."""
        inside = self.inside.take(ended.rows, axis=0)
        if not np.count_nonzero(inside):
            return False
        entered_at = self.state["entered_at"]
        for k, z in zip(*inside.nonzero(), strict=True):
            row = ended.rows[k]
            dwell = ts - entered_at[row, z]
            tid, cls = int(ended.table[ID, k]), int(ended.table[CLS, k])
            fields = {"dwell_s": float(dwell), "reason": ended.reason}
            out.append(Transition("zone_leave", int(z), tid, cls, fields))
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

    def clear(self) -> None:
        """Every track out of every zone, counts zero (a reset: the caller reports the leaves first)."""
        self.state.clear()
        self.counts = np.zeros((len(self.specs), self.n_classes + 1), np.int64)
        for rule in self.rules:
            rule.clear()

    def leave_changed(
        self, specs: Sequence[RegionSpec], table: np.ndarray, ts: float, out: list[Transition]
    ) -> bool:
        """Before these zones give way to ``specs``: the tracks inside a zone whose definition changed or
        that is gone leave it (reason ``zone_changed`` / ``zone_removed``), so every enter has its leave
        across a reload; zones kept as they are keep their state. True if a count changed."""
        kept, names = set(specs), {s.name for s in specs}
        inside = self.inside
        left = False
        for z, spec in enumerate(self.specs):
            if spec in kept or not inside.shape[0]:
                continue
            rows = inside[:, z].nonzero()[0]
            reason = "zone_changed" if spec.name in names else "zone_removed"
            for row in rows.tolist():
                dwell = ts - float(self.state["entered_at"][row, z])
                tid, cls = int(table[ID, row]), int(table[CLS, row])
                out.append(Transition("zone_leave", z, tid, cls, {"dwell_s": dwell, "reason": reason}))
            if rows.size:
                inside[rows, z] = False
                left = True
        if left:
            self.counts = self._counts(classes(table, self.n_classes))
        return left

    def carry(self, old: Regions, tracks: int) -> list[int | None]:
        before = super().carry(old, tracks)
        if isinstance(old, Zones):
            # A changed zone of the same name: what the tracks visited stays (the object's entered_zones).
            by_name = {s.name: k for k, s in enumerate(old.specs)}
            for j, k in enumerate(before):
                if k is None and (k := by_name.get(self.specs[j].name)) is not None:
                    self.visited[:, j] = old.visited[:tracks, k]
        olds = {type(r): r for r in old.rules} if isinstance(old, Zones) else {}
        for rule in self.rules:
            if type(rule) in olds:
                rule.carry(olds[type(rule)], before)
        return before

    def after(self, kind: str, j: int) -> dict[str, Any]:
        """``count``: tracks in the zone; then what the rule that made a ``kind`` event adds."""
        out: dict[str, Any] = {"count": int(self.counts[j].sum())}
        for rule in self.rules:
            if kind in rule.events:
                out.update(rule.fields(j))
        return out

    def state_fields(self, j: int) -> dict[str, Any]:
        """What the zone rules on for zone j add to its retained state."""
        out: dict[str, Any] = {}
        for rule in self.rules:
            out.update(rule.fields(j))
        return out
