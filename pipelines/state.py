"""Per-(track, region) state of a camera's zones or lines: one table of named columns (``StateTable``).

Each column is a C-ordered (tracks, regions) array of its own type, its rows aligned with the tracker's
tracks. The table is the one place that knows them all: every column follows the tracker's rows
(``follow``: old rows moved, new tracks zero), is carried over a change of the regions (``carry``: a kept
region keeps its column, a new or changed one starts zero) and empties with the others (``clear``). Rules
add their own columns (pipelines.rules). The compiled steps (pipelines/kernels/regions.pyx) are handed the
columns themselves and update them in place, as the numpy reference does: both paths share the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from numpy.typing import DTypeLike

# The compiled row follower (pipelines/kernels/regions.pyx follow_rows): (row_map, column) -> new column.
Follower = Callable[[np.ndarray, np.ndarray], np.ndarray]


def follow_rows(state: np.ndarray, row_map: np.ndarray, moved: np.ndarray | None = None) -> np.ndarray:
    """``state`` rows in the tracker's new track order: old rows moved, new tracks zero. ``moved``: the
    tracks that existed before (``moved_rows(row_map)``), None when all did."""
    if moved is None:
        return state.take(row_map, axis=0)
    out = np.zeros((row_map.shape[0], *state.shape[1:]), state.dtype)
    out[moved] = state.take(row_map[moved], axis=0)
    return out


def moved_rows(row_map: np.ndarray) -> np.ndarray | None:
    """For ``follow_rows``: which tracks existed before the step (None: all of them)."""
    moved = row_map >= 0
    return None if moved.all() else moved.nonzero()[0]


class StateTable:
    """Named (tracks, regions) columns that move, carry over and empty together."""

    def __init__(self, regions: int, columns: Mapping[str, DTypeLike] | None = None) -> None:
        self.regions = regions
        self._cols: dict[str, np.ndarray] = {}
        self.add(columns or {})

    def add(self, columns: Mapping[str, DTypeLike]) -> None:
        """New columns, zero for every track there is now (a name already there is refused: two owners)."""
        for name, dtype in columns.items():
            if name in self._cols:
                raise ValueError(f"state column {name!r} declared twice")
            self._cols[name] = np.zeros((self.tracks, self.regions), dtype)

    @property
    def tracks(self) -> int:
        return next(iter(self._cols.values())).shape[0] if self._cols else 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self._cols[name]

    def __contains__(self, name: object) -> bool:
        return name in self._cols

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    def follow(self, row_map: np.ndarray, follower: Follower | None = None) -> None:
        """Every column in the tracker's new track order (``follower``: the compiled one, where built)."""
        if follower is not None:
            for name, col in self._cols.items():
                self._cols[name] = follower(row_map, col)
            return
        moved = moved_rows(row_map)
        for name, col in self._cols.items():
            self._cols[name] = follow_rows(col, row_map, moved)

    def carry(self, old: StateTable, before: Sequence[int | None], tracks: int) -> None:
        """Columns for ``tracks`` tracks where region j is ``old``'s region ``before[j]`` (None: new, zero).
        Columns ``old`` does not have start zero."""
        for name, col in self._cols.items():
            new = np.zeros((tracks, self.regions), col.dtype)
            if name in old:
                src = old[name]
                for j, k in enumerate(before):
                    if k is not None:
                        new[:, j] = src[:, k]
            self._cols[name] = new

    def clear(self) -> None:
        """No tracks (a reset)."""
        for name, col in self._cols.items():
            self._cols[name] = np.zeros((0, self.regions), col.dtype)
