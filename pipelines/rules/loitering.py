"""Zone loitering (``cameras.C.zones.Z.loiter_s``): a ``zone_loiter`` event once per stay, when a track has
been in the zone ``loiter_s`` seconds.

A stay is occupancy's: from the track's ``zone_enter`` (the table's ``entered_at``, the frame time of the
enter) to its ``zone_leave``. Times are the frames' (their capture), never the clock at hand, so a frame
that arrives late is judged as it was captured. The event goes out in the first frame in which the track
is seen at or past ``loiter_s`` inside; a track that leaves and comes back starts a new stay. The rule's
column ``loitered`` marks the stays that had their event. Per zone it counts the tracks loitering now (in
the zone, event sent) and the events since the agent started or the zone last changed: ``loitering``
{count, total} in the zone's retained state and after each ``zone_loiter``; Home Assistant shows the count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import DTypeLike

from pipelines.regions import RegionSpec, Transition
from pipelines.rules import StateEntity, ZoneRule
from pipelines.state import StateTable
from pipelines.tracking import CLS, ID


class Loitering(ZoneRule):
    name = "loitering"
    key = "loiter_s"
    events = ("zone_loiter",)
    columns: ClassVar[Mapping[str, DTypeLike]] = {"loitered": np.bool_}  # this stay had its event
    entities = (StateEntity("loitering", "loitering", ("loitering", "count"), "objects", "measurement"),)

    def __init__(self, specs: Sequence[RegionSpec]) -> None:
        super().__init__(specs)
        self._after_s = np.array([np.inf if v is None else float(v) for v in self.values])
        self.now = np.zeros(len(self.specs), np.int64)  # per zone: tracks loitering in it now
        self.total = np.zeros(len(self.specs), np.int64)  # per zone: zone_loiter events
        self._n = 0  # marks in the table after the last step

    def step(
        self, state: StateTable, table: np.ndarray, active: np.ndarray, ts: float, out: list[Transition]
    ) -> bool:
        inside, loitered, entered_at = state["inside"], state["loitered"], state["entered_at"]
        loitered &= inside  # a stay that ended is over
        due = (ts - entered_at) >= self._after_s
        due &= inside
        due &= active[:, None]
        due &= ~loitered
        fired = bool(np.count_nonzero(due))
        if fired:
            loitered |= due
            tracks, zones = due.nonzero()
            ids = table[ID].take(tracks).astype(np.int64).tolist()
            classes = table[CLS].take(tracks).astype(np.int64).tolist()
            dwell = (ts - entered_at[tracks, zones]).tolist()
            for t, c, z, d in zip(ids, classes, zones.tolist(), dwell, strict=True):
                out.append(Transition("zone_loiter", z, t, c, {"dwell_s": d}))
            np.add.at(self.total, zones, 1)
        # Without an event the marks only go (stays ended, tracks dropped): the same number, the same marks.
        n = int(np.count_nonzero(loitered))
        if not fired and n == self._n:
            return False
        self._n = n
        self.now = np.count_nonzero(loitered, axis=0).astype(np.int64)
        return True

    def carry(self, old: ZoneRule, before: Sequence[int | None]) -> None:
        assert isinstance(old, Loitering)
        for j, k in enumerate(before):
            if k is not None:
                self.now[j], self.total[j] = old.now[k], old.total[k]
        self._n = int(self.now.sum())

    def clear(self) -> None:
        self.now = np.zeros(len(self.specs), np.int64)
        self._n = 0

    def fields(self, j: int) -> dict[str, Any]:
        if self.values[j] is None:
            return {}
        return {"loitering": {"count": int(self.now[j]), "total": int(self.total[j])}}
