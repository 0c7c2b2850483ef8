"""Zones (polygons) and lines (directed segments) of a camera, and which tracks are in or crossed them.

Geometry (checked when the config loads; errors say which points): a zone is a simple polygon (3 to 64
points, no two edges crossing or touching except neighbours at their shared corner, a non-zero area); a
line is two distinct points A -> B. Coordinates are normalised (0..1 of the picture's width and height)
or source pixels of a declared picture size (scaled when the stream's size differs).

Each track is placed by one point of its box, the zone's or line's ``anchor`` (default the bottom centre:
where a person stands or a car touches the ground), taken from the tracker's filtered box.

Zones: a track is *in* a zone once its anchor has been inside the polygon for ``inertia`` consecutive
frames in which it was detected (and out again after as many frames outside); a track confirmed this frame
starts in or out at once. Tracks not detected in a frame (lost for a moment) keep their state, so a short
occlusion is neither a leave nor an enter; a track that ends leaves its zones. Only tracks of the zone's
labels count. Point in polygon is the crossing-number test over every edge of every zone at once.

Lines: each track has a side per line, set when its anchor is more than 5 % of its box height away from
the line (hysteresis: jitter on the line counts nothing). A change of side, with the anchor's projection
within the segment at that moment, is a crossing: ``in`` from the left of A -> B to its right as seen on
the picture (y down: for a line drawn left to right, ``in`` is downwards), ``out`` the other way.

State per (track, zone) and (track, line) lives in arrays aligned with the tracker's tracks and follows
its ``Step.row_map``; everything per frame is vectorised over tracks x zones (x edges) and tracks x lines.
Where the package was built with them, the per-frame steps (test, inertia, crossings, counts, following
the tracker's rows) run compiled (pipelines/kernels/regions.pyx); the numpy code here is their reference
and fallback (tests/test_kernels.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from pipelines import kernels
from pipelines.tracking import CLS, ID, POS, Ended

# Anchor -> offset from the box centre in box widths (x) and heights (y).
ANCHORS: dict[str, tuple[float, float]] = {
    "bottom_center": (0.0, 0.5),
    "center": (0.0, 0.0),
    "top_center": (0.0, -0.5),
    "left_center": (-0.5, 0.0),
    "right_center": (0.5, 0.0),
}
MAX_POINTS = 64
LINE_HYSTERESIS = 0.05  # of the box height
Point = tuple[float, float]


# ---- geometry checks (config time) ----
def _orient(a: Point, b: Point, c: Point) -> float:
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def _on_segment(a: Point, b: Point, p: Point) -> bool:
    return min(a[0], b[0]) <= p[0] <= max(a[0], b[0]) and min(a[1], b[1]) <= p[1] <= max(a[1], b[1])


def segments_touch(a: Point, b: Point, c: Point, d: Point) -> bool:
    """Whether segments a-b and c-d share any point (crossing, touching or overlapping)."""
    o1, o2, o3, o4 = _orient(a, b, c), _orient(a, b, d), _orient(c, d, a), _orient(c, d, b)
    if ((o1 > 0 > o2) or (o1 < 0 < o2)) and ((o3 > 0 > o4) or (o3 < 0 < o4)):
        return True
    return (
        (o1 == 0 and _on_segment(a, b, c))
        or (o2 == 0 and _on_segment(a, b, d))
        or (o3 == 0 and _on_segment(c, d, a))
        or (o4 == 0 and _on_segment(c, d, b))
    )


def polygon_area(points: Sequence[Point]) -> float:
    """Signed area (shoelace)."""
    n = len(points)
    return 0.5 * sum(
        points[i][0] * points[(i + 1) % n][1] - points[(i + 1) % n][0] * points[i][1] for i in range(n)
    )


def polygon_problem(points: Sequence[Point]) -> str | None:
    """Why ``points`` (a closing repeat of the first point already removed) is not a usable zone, or None."""
    n = len(points)
    if n < 3:
        return f"a zone needs at least 3 points, got {n}"
    if n > MAX_POINTS:
        return f"at most {MAX_POINTS} points, got {n}"
    for i in range(n):
        if points[i] == points[(i + 1) % n]:
            return f"points {i + 1} and {(i + 1) % n + 1} are the same"
    for i in range(n):
        a, b = points[i], points[(i + 1) % n]
        for j in range(i + 2, n):
            if i == 0 and j == n - 1:
                continue  # neighbours; a fold-back of neighbours touches another edge, found there
            c, d = points[j], points[(j + 1) % n]
            if segments_touch(a, b, c, d):
                return (
                    f"edges {i + 1} ({_fmt(a)}-{_fmt(b)}) and {j + 1} ({_fmt(c)}-{_fmt(d)}) cross or touch:"
                    " a zone must be a simple polygon (not self-intersecting)"
                )
    if polygon_area(points) == 0.0:
        return "the polygon has no area (its points are on one line)"
    return None


def segment_problem(points: Sequence[Point]) -> str | None:
    """Why ``points`` is not a usable line, or None."""
    if len(points) != 2:
        return f"a line is exactly 2 points [A, B], got {len(points)}"
    if points[0] == points[1]:
        return "degenerate: A and B are the same point"
    return None


def _fmt(p: Point) -> str:
    return f"[{p[0]:g}, {p[1]:g}]"


# ---- specs (what the agent's config turns into) ------------------------------------------------------------
@dataclass(frozen=True)
class RegionSpec:
    """A zone (``kind`` "zone", 3+ points) or a line ("line", A and B), validated by the caller."""

    kind: str
    name: str
    points: tuple[Point, ...]
    labels: tuple[int, ...] | None = None  # class ids counted; None: every class
    anchor: str = "bottom_center"
    inertia: int = 2  # zones: frames in a row before in/out changes
    frame_size: tuple[int, int] | None = None  # None: normalised points; else the pixel size they refer to

    def pixels(self, size: tuple[int, int]) -> np.ndarray:
        """(K, 2) points in pixels of a ``size`` (w, h) picture."""
        pts = np.asarray(self.points, np.float64)
        ref = self.frame_size or (1, 1)
        return pts * (np.asarray(size, np.float64) / np.asarray(ref, np.float64))


def _regions_module() -> ModuleType | None:
    """The compiled steps (pipelines.kernels), if built and reading the tracker's class row."""
    mod = kernels.load("regions")
    if mod is not None and mod.LAYOUT != {"CLS": CLS}:
        raise ImportError(f"pipelines.kernels.regions: table layout {mod.LAYOUT} != CLS {CLS}: rebuild it")
    return mod


def _label_mask(specs: Sequence[RegionSpec], n_classes: int) -> np.ndarray:
    """(classes, regions) bool: which classes each region counts; class ids beyond n_classes never."""
    mask = np.zeros((n_classes + 1, len(specs)), bool)  # the last row: unknown class ids
    for j, s in enumerate(specs):
        if s.labels is None:
            mask[:n_classes, j] = True
        else:
            mask[[c for c in s.labels if 0 <= c < n_classes], j] = True
    return mask


def _anchor_offsets(specs: Sequence[RegionSpec]) -> np.ndarray:
    return np.array([ANCHORS[s.anchor] for s in specs], np.float64).reshape(len(specs), 2).T


def classes(table: np.ndarray, n_classes: int) -> np.ndarray:
    """(tracks,) class index of each track for the label masks: ids beyond the labels map to n_classes."""
    cls = table[CLS].astype(np.intp)
    cls[(cls < 0) | (cls > n_classes)] = n_classes  # unknown: beyond the labels, or negative (a bad model)
    return cls


def _follow(state: np.ndarray, row_map: np.ndarray, moved: np.ndarray | None = None) -> np.ndarray:
    """``state`` rows in the tracker's new track order: old rows moved, new tracks zero. ``moved``: the
    tracks that existed before (``_moved(row_map)``), None when all did."""
    if moved is None:
        return state.take(row_map, axis=0)
    out = np.zeros((row_map.shape[0], *state.shape[1:]), state.dtype)
    out[moved] = state.take(row_map[moved], axis=0)
    return out


def _moved(row_map: np.ndarray) -> np.ndarray | None:
    """For ``_follow``: which tracks existed before the step (None: all of them)."""
    moved = row_map >= 0
    return None if moved.all() else moved.nonzero()[0]


# ---- per-frame results ----
@dataclass(slots=True)
class Transition:
    """A track entering or leaving a zone, or crossing a line."""

    kind: str  # zone_enter | zone_leave | line_cross
    region: int  # index of the zone / line
    track_id: int
    class_id: int
    dwell_s: float | None = None  # zone_leave: time in the zone
    direction: str | None = None  # line_cross: in | out
    reason: str | None = None  # zone_leave because the track ended: lost, gap, reconnect, ...


class _Regions:
    """What zones and lines hold alike: their specs, which classes each counts, its anchor's offsets."""

    def __init__(self, specs: Sequence[RegionSpec], n_classes: int, compiled: bool = True) -> None:
        self.specs = tuple(specs)
        self.n_classes = n_classes
        self._mask = _label_mask(self.specs, n_classes)
        self._offsets = _anchor_offsets(self.specs)  # (2, regions)
        # The compiled per-frame steps (pipelines/kernels/regions.pyx) where built, with their arguments
        # laid out as they take them; None: the numpy code.
        self._module = _regions_module() if compiled and self.specs else None
        self._kernel: Any = None  # made by _compile for the picture size
        self._mask_u8 = np.ascontiguousarray(self._mask).view(np.uint8)
        self._offsets_c = np.ascontiguousarray(self._offsets)

    def __len__(self) -> int:
        return len(self.specs)


# ---- zones ----
class Zones(_Regions):
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
        if self._kernel is None:
            return self._update_numpy(table, active, confirmed, ts, size, out)
        tracks, zones, dwell, counts = self._kernel.step(
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

    def _update_numpy(
        self,
        table: np.ndarray,
        active: np.ndarray,
        confirmed: np.ndarray,
        ts: float,
        size: tuple[int, int],
        out: list[Transition],
    ) -> bool:
        cls = classes(table, self.n_classes)
        raw = self.test(table, cls, size)
        np.copyto(raw, self.inside, where=~active[:, None])
        differs = raw != self.inside
        streak = self._streak
        streak += 1
        streak *= differs
        flip = streak >= self._inertia
        if confirmed.size:
            flip[confirmed] = differs[confirmed]  # a new track starts in or out at once
        if not np.count_nonzero(flip):
            return False
        streak[flip] = 0
        self.inside ^= flip
        tracks, zones = flip.nonzero()
        ids = table[ID].take(tracks).astype(np.int64)
        class_ids = table[CLS].take(tracks).astype(np.int64)
        for k, (t, z) in enumerate(zip(tracks.tolist(), zones.tolist(), strict=True)):
            if self.inside[t, z]:
                self.entered_at[t, z] = ts
                self.visited[t, z] = True
                out.append(Transition("zone_enter", z, int(ids[k]), int(class_ids[k])))
            else:
                dwell = ts - self.entered_at[t, z]
                out.append(Transition("zone_leave", z, int(ids[k]), int(class_ids[k]), dwell))
        self._count(cls)
        return True

    def follow(self, row_map: np.ndarray) -> None:
        """Re-align the per-track state with the tracker's tracks after a step that added or dropped some."""
        if self._module is not None:
            self.inside, self._streak, self.entered_at, self.visited = self._module.zones_follow(
                row_map, self.inside, self._streak, self.entered_at, self.visited
            )
            return
        moved = _moved(row_map)
        for name in ("inside", "entered_at", "visited", "_streak"):
            setattr(self, name, _follow(getattr(self, name), row_map, moved))

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

    def _count(self, cls: np.ndarray) -> None:
        tracks, zones = self.inside.nonzero()
        width = self.n_classes + 1
        counts = np.bincount(zones * width + cls.take(tracks), minlength=len(self.specs) * width)
        self.counts = counts.reshape(len(self.specs), width)

    def recount(self, table: np.ndarray) -> None:
        """Counts from ``inside`` again (tracks of ``table``, after ``follow``)."""
        self._count(classes(table, self.n_classes))

    def clear(self) -> None:
        """Every track out of every zone, counts zero (a reset: the caller reports the leaves first)."""
        z = len(self.specs)
        self.inside = np.zeros((0, z), bool)
        self.entered_at = np.zeros((0, z))
        self.visited = np.zeros((0, z), bool)
        self._streak = np.zeros((0, z), np.int16)
        self.counts = np.zeros((z, self.n_classes + 1), np.int64)


# ---- lines ----
class Lines(_Regions):
    """The lines of one camera, each track's side of each, and the crossings counted."""

    def __init__(self, specs: Sequence[RegionSpec], n_classes: int, compiled: bool = True) -> None:
        super().__init__(specs, n_classes, compiled)
        n = len(self.specs)
        # One anchor for every line (the usual case): (N, 1) anchors instead of (N, lines).
        self._anchor = ANCHORS[self.specs[0].anchor] if len({s.anchor for s in self.specs}) == 1 else None
        self._size: tuple[int, int] | None = None
        self.side = np.zeros((0, n), np.int8)  # per (track, line): -1 left, +1 right, 0 not yet known
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
            out.append(
                Transition("line_cross", j, int(table[ID, t]), int(table[CLS, t]), direction=("in", "out")[d])
            )
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
            out.append(
                Transition(
                    "line_cross", j, int(table[ID, t]), int(table[CLS, t]), direction=("in", "out")[direction]
                )
            )
            changed = True
        return changed

    def follow(self, row_map: np.ndarray) -> None:
        if self._module is not None:
            self.side = self._module.lines_follow(row_map, self.side)
        else:
            self.side = _follow(self.side, row_map, _moved(row_map))

    def clear_sides(self) -> None:
        self.side = np.zeros((0, len(self.specs)), np.int8)
