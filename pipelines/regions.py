"""Zones and lines alike: their geometry checks, specs, anchors and label filters, and what a frame's
analytics reports about them (pipelines.zones, pipelines.lines).

Geometry (checked when the config loads; errors say which points): a zone is a simple polygon (3 to 64
points, no two edges crossing or touching except neighbours at their shared corner, a non-zero area); a
line is two distinct points A -> B. Coordinates are normalised (0..1 of the picture's width and height)
or source pixels of a declared picture size (scaled when the stream's size differs).

Each track is placed by one point of its box, the zone's or line's ``anchor`` (default the bottom centre:
where a person stands or a car touches the ground), taken from the tracker's filtered box. State per
(track, zone) and (track, line) lives in one table of named columns aligned with the tracker's tracks
(pipelines.state), which the rules declare (pipelines.rules).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from pipelines import kernels
from pipelines.state import StateTable
from pipelines.tracking import CLS

# Anchor -> offset from the box centre in box widths (x) and heights (y).
ANCHORS: dict[str, tuple[float, float]] = {
    "bottom_center": (0.0, 0.5),
    "center": (0.0, 0.0),
    "top_center": (0.0, -0.5),
    "left_center": (-0.5, 0.0),
    "right_center": (0.5, 0.0),
}
MAX_POINTS = 64
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
    params: tuple[tuple[str, Any], ...] = ()  # zone rules' settings by config key (pipelines.rules)
    inertia_s: float = 0.0  # zones: ... and for at least this long (frame times: first to this frame)

    def param(self, key: str) -> Any:
        """A zone rule's setting (None: not set, the rule is off here)."""
        return next((v for k, v in self.params if k == key), None)

    def pixels(self, size: tuple[int, int]) -> np.ndarray:
        """(K, 2) points in pixels of a ``size`` (w, h) picture."""
        pts = np.asarray(self.points, np.float64)
        ref = self.frame_size or (1, 1)
        return pts * (np.asarray(size, np.float64) / np.asarray(ref, np.float64))


# What the compiled steps must agree on: the tracker's class row, and the revision of their arguments and
# arithmetic (STEP; 2: zones' inertia_s), so that a build older than this code falls back to numpy.
KERNEL_LAYOUT = {"CLS": CLS, "STEP": 2}


def _regions_module() -> ModuleType | None:
    """The compiled steps (pipelines.kernels), if built and reading the tracker's class row."""
    return kernels.load("regions", KERNEL_LAYOUT)


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


# ---- per-frame results ----
@dataclass(slots=True)
class Transition:
    """Something a track did in a region: its rule's event type (pipelines.rules), the region's index, the
    track, and the event's own fields (raw numbers: the events code rounds and formats)."""

    kind: str  # an event type: zone_enter | zone_leave | line_cross | a zone rule's
    region: int  # index of the zone / line
    track_id: int
    class_id: int
    fields: dict[str, Any] = field(default_factory=dict)  # e.g. dwell_s and reason of a zone_leave

    @property
    def reason(self) -> str | None:
        """Why its track ended (lost, gap, reconnect, ...) for a leave at the track's end, else None."""
        return self.fields.get("reason")

    @property
    def dwell_s(self) -> float | None:
        return self.fields.get("dwell_s")

    @property
    def direction(self) -> str | None:
        return self.fields.get("direction")


class Regions(ABC):
    """What zones and lines hold alike: their specs, which classes each counts, its anchor's offsets, the
    per-(track, region) state table (``columns``: its rules' declarations) and the counts per region."""

    counts: np.ndarray  # (regions, ...) per region: what it counted (the subclass's layout)

    def __init__(
        self,
        specs: Sequence[RegionSpec],
        n_classes: int,
        columns: Mapping[str, DTypeLike],
        compiled: bool = True,
    ) -> None:
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
        self.state = StateTable(len(self.specs), columns)

    def __len__(self) -> int:
        return len(self.specs)

    def follow(self, row_map: np.ndarray) -> None:
        """Re-align the per-track state with the tracker's tracks after a step that added or dropped some."""
        self.state.follow(row_map, self._module.follow_rows if self._module is not None else None)

    def carry(self, old: Regions, tracks: int) -> list[int | None]:
        """Take over ``old``'s state and counts for the regions whose spec did not change (the others start
        empty; ``tracks``: how many the tracker has). Returns each region's index in ``old`` (None: new)."""
        index = {s: k for k, s in enumerate(old.specs)}
        before = [index.get(s) for s in self.specs]
        self.state.carry(old.state, before, tracks)
        for j, k in enumerate(before):
            if k is not None:
                self.counts[j] = old.counts[k]
        return before

    @abstractmethod
    def after(self, kind: str, j: int) -> dict[str, Any]:
        """The fields an event of type ``kind`` in region j ends with: the region's counts after it."""
