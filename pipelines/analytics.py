"""Per-camera analytics: the tracker, the zones and the lines of one camera, one call per frame.

``CameraAnalytics.process`` takes a frame's detections (the camera's class filter applied, scores down to
the tracker's ``low_score``) and returns an ``Analysis``: the detections the camera reports (score >= its
``min_score``) with their track ids, and what happened in the frame (tracks confirmed and ended, zone
enters and leaves, line crossings, counts changed). The agent turns that into MQTT events
(agent.events); nothing here publishes or formats.

Resets (every track ends, every zone empties): a frame more than ``reset_gap_s`` after the previous one (a
stalled or reconnected camera: no prediction across the gap, no ghost ids), ``reset()`` (the agent calls it
when the camera reconnects or stops), and a change of the tracker's settings. Zones and lines change in
place (``reconfigure``): unchanged ones keep their state and counts, changed or new ones start empty;
the tracks inside a changed or removed zone leave it first (``leave_zones``: every enter has its leave).

Not thread-safe: the caller serialises ``process``, ``reset`` and ``reconfigure`` (agent.events holds a
lock per camera around them and the publishing of their results, so events keep their order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipelines.frames import Detections
from pipelines.lines import Lines
from pipelines.regions import RegionSpec, Transition
from pipelines.tracking import SCORE, Ended, Step, Tracker, TrackerParams
from pipelines.zones import Zones


@dataclass(frozen=True)
class AnalyticsSettings:
    """Everything a camera's analytics needs (made from agent.config by agent.events)."""

    tracker: TrackerParams
    min_score: float  # what the camera reports; detections between low_score and this only help tracking
    reset_gap_s: float = 2.0
    zones: tuple[RegionSpec, ...] = ()
    lines: tuple[RegionSpec, ...] = ()


@dataclass(slots=True)
class Analysis:
    """One frame's analytics (or a reset's). Arrays refer to the tracker's state after the frame and are
    valid until the next call."""

    detections: Detections  # reported: score >= min_score
    track_ids: np.ndarray  # (len(detections),) int64 id of each detection's track, 0 for none yet
    ts: float  # wall clock of the frame (of the reset)
    frame_id: int  # -1 for a reset
    size: tuple[int, int]  # (w, h) of the picture; (0, 0) for a reset
    table: np.ndarray  # the tracker's table after the step (pipelines.tracking rows x tracks)
    step: Step
    active: np.ndarray  # (tracks,) bool: confirmed and seen in this frame
    transitions: list[Transition] = field(default_factory=list)  # every rule's (pipelines.rules)
    zones_changed: bool = False  # some zone's counts changed
    lines_changed: bool = False  # some line's counts changed
    reset: str | None = None  # why every track ended (gap, reconnect, stopped, ...), else None
    inside: np.ndarray | None = None  # (tracks, Z) bool: the zones each track is in now (None: no zones)
    ended_zones: np.ndarray | None = None  # (len(step.ended), Z) bool: zones the ended tracks had visited


class CameraAnalytics:
    """Tracker + zones + lines of one camera."""

    def __init__(
        self, settings: AnalyticsSettings, n_classes: int, first_id: int = 1, compiled: bool = True
    ) -> None:
        self.n_classes = n_classes
        self.settings = settings
        self.compiled = compiled  # False: the numpy code even where the kernels are built (comparisons)
        self.tracker = Tracker(settings.tracker, first_id, compiled)
        self.zones = Zones(settings.zones, n_classes, compiled)
        self.lines = Lines(settings.lines, n_classes, compiled)
        self._t: float | None = None  # monotonic time of the last frame

    # ---- per frame ------------------------------------------------------------------------------------
    def process(
        self, dets: Detections, t: float, ts: float, frame_id: int, size: tuple[int, int]
    ) -> Analysis:
        """One frame: detections with scores >= the tracker's low_score, ``t`` monotonic and ``ts`` wall
        clock of its capture, ``size`` (w, h) of the picture."""
        times = self.tracker.admit(t, ts)  # NaN / infinite times repaired (pipelines.tracking: why)
        if times is not None:
            t, ts = times
        reset = None
        ended_first: list[Transition] = []
        ended_visits = None
        first_ended: Ended | None = None
        if self._t is not None and t - self._t > self.settings.reset_gap_s:
            # A gap: every track ends before this frame is looked at (it starts new ones).
            gap = self.reset("gap", ts)
            reset, ended_first, first_ended, ended_visits = (
                "gap",
                gap.transitions,
                gap.step.ended,
                gap.ended_zones,
            )
        self._t = t
        step = self.tracker.update(dets, t, ts, frame_id)
        table = self.tracker.table
        active = step.active
        out = ended_first
        zones, lines = self.zones, self.lines
        has_zones, has_lines = bool(zones.specs), bool(lines.specs)
        zones_changed = reset is not None and has_zones
        lines_changed = False
        visits = None
        if has_zones:
            if step.ended is not None:
                visits = zones.visited_by(step.ended.rows)
                zones_changed |= zones.end(step.ended, ts, out)
            if step.row_map is not None:
                zones.follow(step.row_map)
            zones_changed |= zones.update(table, active, step.confirmed, ts, size, out, stale=zones_changed)
        if has_lines:
            if step.row_map is not None:
                lines.follow(step.row_map)
            lines_changed = lines.update(table, active, step.confirmed, size, out)
        # What the camera reports, with ids of confirmed tracks.
        min_score = self.settings.min_score
        if min_score > self.settings.tracker.low_score:
            report = (dets.scores >= min_score).nonzero()[0]
            reported = Detections(
                dets.boxes.take(report, axis=0), dets.scores.take(report), dets.class_ids.take(report)
            )
            ids = step.ids.take(report)
        else:
            reported, ids = dets, step.ids
        if first_ended is not None:
            step.ended = _merge_ended(first_ended, step.ended)
            visits = _merge_visits(ended_visits, visits)
        return Analysis(
            detections=reported,
            track_ids=ids,
            ts=ts,
            frame_id=frame_id,
            size=size,
            table=table,
            step=step,
            active=active,
            transitions=out,
            zones_changed=zones_changed,
            lines_changed=lines_changed,
            reset=reset,
            inside=zones.inside if has_zones else None,
            ended_zones=visits,
        )

    def reset(self, reason: str, ts: float) -> Analysis:
        """End every track now (``reason``: gap, reconnect, stopped, removed, reconfigured)."""
        rows = np.arange(len(self.tracker))
        visits = self.zones.visited_by(rows) if len(self.zones) else None
        out: list[Transition] = []
        step = self.tracker.reset(reason)
        if step.ended is not None and len(self.zones):
            self.zones.end(step.ended, ts, out)
            visits = visits[step.ended.rows] if visits is not None else None
        self.zones.clear()
        self.lines.clear_sides()
        self._t = None
        return Analysis(
            detections=Detections.empty(),
            track_ids=np.zeros(0, np.int64),
            ts=ts,
            frame_id=-1,
            size=(0, 0),
            table=self.tracker.table,
            step=step,
            active=np.zeros(0, bool),
            transitions=out,
            zones_changed=len(self.zones) > 0,
            reset=reason,
            ended_zones=visits,
        )

    # ---- configuration --------------------------------------------------------------------------------
    def reconfigure(self, settings: AnalyticsSettings, ts: float) -> Analysis | None:
        """New settings in place. A changed tracker resets every track (the Analysis of that reset is
        returned); zones and lines that did not change keep their state and counts."""
        old = self.settings
        self.settings = settings
        result = None
        if settings.tracker != old.tracker:
            result = self.reset("reconfigured", ts)
            self.tracker.configure(settings.tracker)
        if settings.zones != old.zones:
            zones = Zones(settings.zones, self.n_classes, self.compiled)
            zones.carry(self.zones, len(self.tracker))
            self.zones = zones
        if settings.lines != old.lines:
            lines = Lines(settings.lines, self.n_classes, self.compiled)
            lines.carry(self.lines, len(self.tracker))
            self.lines = lines
        return result

    def leave_zones(self, zones: tuple[RegionSpec, ...], ts: float) -> Analysis | None:
        """Before ``reconfigure`` to these zones: the tracks inside a zone that changed or is gone leave it
        (reason ``zone_changed`` / ``zone_removed``; pipelines.zones ``leave_changed``). The Analysis of
        those leaves (None: nobody left), to publish while these zones are still in place; the tracks go on
        and re-enter a changed zone by the normal rule."""
        out: list[Transition] = []
        table = self.tracker.table
        if zones == self.settings.zones or not self.zones.leave_changed(zones, table, ts, out):
            return None
        step = Step(np.zeros(0, np.intp))
        return Analysis(
            detections=Detections.empty(),
            track_ids=np.zeros(0, np.int64),
            ts=ts,
            frame_id=-1,
            size=(0, 0),
            table=table,
            step=step,
            active=np.zeros(table.shape[1], bool),
            transitions=out,
            zones_changed=True,
            inside=self.zones.inside,
        )

    def regions(self, kind: str) -> Zones | Lines:
        """The zones ("zone") or the lines ("line"): where the rules of that region kind work
        (pipelines.rules)."""
        return self.zones if kind == "zone" else self.lines

    def best(self, rows: np.ndarray) -> np.ndarray:
        """Best scores of tracks ``rows`` (for callers that keep crops of the best detection)."""
        return self.tracker.table[SCORE].take(rows)


def _merge_ended(a: Ended, b: Ended | None) -> Ended:
    if b is None or not len(b):
        return a
    return Ended(np.concatenate((a.table, b.table), axis=1), np.concatenate((a.rows, b.rows)), a.reason)


def _merge_visits(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    if b is None:
        return a
    return np.concatenate((a, b))
