"""Tracking, zones and lines of a camera turned into MQTT events and retained counts (docs/DESIGN.md).

One ``CameraEvents`` per camera with tracking on. The model's worker calls it for every frame (it is the
camera route's ``analytics``, pipelines.scheduler): it runs pipelines.analytics.CameraAnalytics and
publishes what happened, under a lock that ``reset`` (camera reconnect or stop) and ``reconfigure``
(SIGHUP) take too, so events of one camera keep their order (no ``end`` before its ``new``).

On ``{prefix}/{device}/cameras/{camera}/events`` (QoS 1, not retained; schema edge-agent/event/1), per
object: ``new`` (confirmed), ``update`` (its zones changed, or it moved ``events.update_move`` of the
picture's diagonal since its last event; at most one per ``events.update_interval_s``), ``end`` (lost,
or every track ended: gap, reconnect, stopped, removed, reconfigured); and what the zone and line rules
saw (pipelines.rules: ``zone_enter`` / ``zone_leave``, ``line_cross``, and the zone rules' own), all
through one path (``_event``). Retained, on change: ``cameras/{camera}/zones/{zone}`` (occupancy and
counts by label, and the fields of the zone rules on there; schema edge-agent/zone/1) and
``cameras/{camera}/lines/{line}`` (counts by direction and label; edge-agent/line/1). With
``events.snapshot.enabled``, a JPEG of the object's best detection follows its ``end`` on
``cameras/{camera}/tracks/{track_id}/snapshot`` (at most one per ``min_interval_s`` per camera, only
while connected). Payloads never hold the camera's URL.

The per-frame work here is vectorised over tracks; Python per object runs only for objects that have an
event in the frame.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from agent.config import CameraConfig, EventsConfig
from agent.events.publisher import EVENT_TYPES, Publisher
from agent.events.regions import RegionStates
from agent.events.settings import analytics_settings
from agent.events.snapshots import TrackSnapshots
from agent.mqtt.topics import Topics, payload
from pipelines.analytics import Analysis, CameraAnalytics
from pipelines.frames import Detections, Frame
from pipelines.regions import Transition
from pipelines.rules import rule_of
from pipelines.tracking import (
    BEST_BOX,
    BEST_FRAME,
    BEST_SCORE,
    BEST_TS,
    BOX,
    CLS,
    FIRST_SEEN,
    ID,
    LAST_FRAME,
    LAST_SEEN,
    POS,
    SCORE,
)

log = logging.getLogger("agent.events")  # its lines keep the name they had (journald, greps)

_NO_ROWS = np.zeros(0, np.intp)  # no `new` due (read only)


class CameraEvents:
    """Analytics and events of one camera (see the module docstring)."""

    def __init__(
        self,
        camera: str,
        cam: CameraConfig,
        labels: list[str],
        labels_src: str,
        out: Publisher,
        first_id: int = 1,  # the first track id (a restarted shard's: agent.shards.tracks)
    ) -> None:
        self.camera = camera
        self.labels = labels
        self._out = out
        self._lock = threading.Lock()
        self._cfg: EventsConfig = cam.events
        self._settings = analytics_settings(camera, cam, labels, labels_src)
        self.analytics = CameraAnalytics(self._settings, len(labels), first_id)
        self._regions = RegionStates(camera, out, self._label)
        self._regions.configure(cam)
        # Per track (aligned with the tracker's tracks): wall clock and centre at its last event, and
        # whether its zones changed since.
        self._last_ts = np.zeros(0)
        self._last_xy = np.zeros((2, 0))
        self._pending = np.zeros(0, bool)
        self._announced = np.zeros(0, bool)  # had its `new` event (events.objects decides when)
        self._snap = TrackSnapshots()
        self.counts: Counter[str] = Counter()  # events published, by type; also "snapshots", "errors"
        self.tracks_started = 0
        self._error_logged = -math.inf

    # ---- the route hook (the model's delivery thread) ----
    def __call__(self, frame: Frame, dets: Detections) -> Analysis:
        h, w = frame.image.shape[:2]
        t = frame.stamps.get("captured", frame.ts_capture)
        with self._lock:
            try:
                analysis = self.analytics.process(dets, t, frame.ts_capture, frame.frame_id, (int(w), int(h)))
            except Exception:
                return self._failed(frame, dets)
            self._emit(analysis, frame)
        return analysis

    def _failed(self, frame: Frame, dets: Detections) -> Analysis:
        """A bug in the analytics must not stop detections: report this frame untracked, start afresh."""
        self.counts["errors"] += 1
        now = time.monotonic()
        if now - self._error_logged > 60.0:
            self._error_logged = now
            log.exception(
                "camera %s: tracking failed; tracks reset, detections go out untracked", self.camera
            )
        try:  # end the tracks it had, so every `new` still gets its `end`
            self._emit(self.analytics.reset("error", frame.ts_capture), None)
        except Exception:
            log.debug("camera %s: the reset after the failure failed too", self.camera, exc_info=True)
        self.analytics = CameraAnalytics(self._settings, len(self.labels), self.analytics.tracker.next_id)
        self._follow(None, 0)
        reported = dets.select(dets.scores >= self._settings.min_score)
        tracker = self.analytics.tracker
        return Analysis(
            reported,
            np.zeros(len(reported), np.int64),
            frame.ts_capture,
            frame.frame_id,
            (0, 0),
            tracker.table,
            tracker.reset("error"),
            np.zeros(0, bool),
        )

    # ---- from other threads ----
    def reset(self, reason: str) -> None:
        """End every track now (camera reconnecting, stopped, removed): end events, zone leaves, counts."""
        with self._lock:
            self._emit(self.analytics.reset(reason, time.time()), None)

    def reconfigure(self, cam: CameraConfig, labels: list[str], labels_src: str) -> None:
        """New zones, lines, tracking or events settings in place (SIGHUP). Retained states of zones and
        lines that are gone are deleted; the others are published again."""
        settings = analytics_settings(self.camera, cam, labels, labels_src)  # raises before any change
        with self._lock:
            now = time.time()
            leaves = self.analytics.leave_zones(settings.zones, now)  # while the old zones are in place
            if leaves is not None:
                self._emit(leaves, None)
            gone_zones, gone_lines = self._regions.gone(cam)
            self._cfg = cam.events
            self.labels = labels
            self._regions.configure(cam)
            self._settings = settings
            result = self.analytics.reconfigure(settings, now)
            if result is not None:
                self._emit(result, None)
            self._regions.delete(gone_zones, gone_lines)
            self._regions.publish(self.analytics, force=True)

    def publish_states(self) -> None:
        """Every zone's and line's retained state (at start: zeros, replacing a previous run's)."""
        with self._lock:
            self._regions.publish(self.analytics, force=True)

    def close(self, reason: str, clear: bool) -> None:
        """The camera stops (``reason`` stopped / removed): its tracks end; with ``clear`` its retained zone
        and line states are deleted."""
        self.reset(reason)
        if clear:
            with self._lock:
                self._regions.delete_all()

    def region_topics(self, topics: Topics) -> set[str]:
        """The retained zone and line topics this camera publishes now."""
        s = self._settings
        return {topics.zone(self.camera, z.name) for z in s.zones} | {
            topics.line(self.camera, ln.name) for ln in s.lines
        }

    def stats(self) -> dict[str, Any]:
        """For telemetry: active tracks, tracks started, events by type, zone and line counts."""
        with self._lock:
            an = self.analytics
            return {
                "tracks_active": int(np.count_nonzero(an.tracker.table[ID] > 0)),
                "tracks_started": self.tracks_started,
                "events": {k: self.counts.get(k, 0) for k in (*EVENT_TYPES, "snapshots", "errors")},
                "zones": {z.name: self._regions.zone_counts(an, j) for j, z in enumerate(an.zones.specs)},
                "lines": {
                    ln.name: self._regions.line_counts(an, j)[0] for j, ln in enumerate(an.lines.specs)
                },
            }

    # ---- emitting (under the lock) ----
    def _emit(self, a: Analysis, frame: Frame | None) -> None:
        step = a.step
        enabled = self._cfg.enabled
        # Tracks that ended: zone leaves, then their ends (their crops still at their old rows).
        if enabled:
            for tr in a.transitions:
                if tr.reason is not None:
                    self._event(tr, a)
        if step.ended is not None and len(step.ended):
            if enabled:
                self._ends(a, self._announced.take(step.ended.rows))
            self._snap.drop(step.ended.rows)
        n = a.table.shape[1]
        if a.reset is not None:
            self._follow(np.full(n, -1, np.intp), n)  # every track after a reset is new
        elif step.row_map is not None:
            self._follow(step.row_map, n)
        if frame is not None and self._cfg.snapshot.enabled and step.improved.size:
            self._snap.crop(a, frame)
        self.tracks_started += int(step.confirmed.size)
        if enabled:
            objects = self._cfg.objects
            if objects != "none":
                for row in self._due_new(a).tolist():
                    self._object_event("new", a, row)
            for tr in a.transitions:
                if tr.reason is not None:
                    continue
                if objects == "in_zones" and tr.kind == rule_of(tr.kind).enters:
                    row = self._row_of(a, tr.track_id)
                    if row is not None and not self._announced[row] and self._old_enough(a, row):
                        self._object_event("new", a, row)  # its first zone: the object becomes an event
                self._event(tr, a)
            if objects != "none":
                self._updates(a)
        if a.zones_changed or a.lines_changed:
            self._regions.publish(self.analytics, force=False)

    def _due_new(self, a: Analysis) -> np.ndarray:
        """Rows whose ``new`` is due before this frame's transitions. Without ``events.min_duration_s``:
        every track confirmed in the frame (objects all; in_zones announces at the zone entry). With it,
        a track is announced once it has been followed that long (Frigate's idea: a flicker of a few
        frames is no event), and for in_zones only after it entered a zone; one that ends sooner has
        neither ``new`` nor ``end`` (its zone events still go out)."""
        if self._cfg.min_duration_s <= 0:
            return a.step.confirmed if self._cfg.objects == "all" else _NO_ROWS
        due = a.active & ~self._announced
        due &= a.ts - a.table[FIRST_SEEN] >= self._cfg.min_duration_s
        if self._cfg.objects == "in_zones":
            visited = self.analytics.zones.visited
            due &= visited.any(axis=1) if visited.shape[1] else False
        return due.nonzero()[0]

    def _old_enough(self, a: Analysis, row: int) -> bool:
        return bool(a.ts - a.table[FIRST_SEEN, row] >= self._cfg.min_duration_s)

    def _follow(self, row_map: np.ndarray | None, n: int) -> None:
        if row_map is None:  # start afresh
            row_map = np.zeros(0, np.intp)
        kept = row_map >= 0
        src = row_map[kept]
        last_ts = np.zeros(n)
        last_ts[kept] = self._last_ts.take(src)
        last_xy = np.zeros((2, n))
        last_xy[:, kept] = self._last_xy.take(src, axis=1)
        pending = np.zeros(n, bool)
        pending[kept] = self._pending.take(src)
        announced = np.zeros(n, bool)
        announced[kept] = self._announced.take(src)
        self._last_ts, self._last_xy, self._pending, self._announced = last_ts, last_xy, pending, announced
        self._snap.follow(kept, src, n, self._cfg.snapshot.enabled)

    def _updates(self, a: Analysis) -> None:
        """``update`` events: zones changed or moved far since the object's last event, rate-limited."""
        n = a.table.shape[1]
        if not n:
            return
        xy = a.table[POS][0:2]
        moved = np.hypot(xy[0] - self._last_xy[0], xy[1] - self._last_xy[1])
        w, h = a.size
        due = moved >= self._cfg.update_move * math.hypot(w, h)
        due |= self._pending
        due &= self._announced
        due &= a.active
        due &= (a.ts - self._last_ts) >= self._cfg.update_interval_s
        if a.step.confirmed.size:
            due[a.step.confirmed] = False
        if np.count_nonzero(due):
            for row in due.nonzero()[0].tolist():
                self._object_event("update", a, row)

    def _object_event(self, kind: str, a: Analysis, row: int) -> None:
        col = a.table[:, row]
        body = self._object_fields(kind, col)
        body["frame_id"] = a.frame_id
        inside = a.inside
        body["zones"] = self._zone_names(inside[row]) if inside is not None else []
        body["entered_zones"] = (
            self._zone_names(self.analytics.zones.visited[row]) if inside is not None else []
        )
        self._send(body, a.ts)
        self._last_ts[row] = a.ts
        self._last_xy[:, row] = col[POS][0:2]
        self._pending[row] = False
        self._announced[row] = True

    def _object_fields(self, kind: str, col: np.ndarray) -> dict[str, Any]:
        cls = int(col[CLS])
        return {
            "type": kind,
            "track_id": int(col[ID]),
            "label": self._label(cls),
            "class_id": cls,
            "first_seen": round(float(col[FIRST_SEEN]), 3),
            "last_seen": round(float(col[LAST_SEEN]), 3),
            "score": round(float(col[SCORE]), 3),
            "box": [round(float(v), 1) for v in col[BOX]],
            "best": {
                "score": round(float(col[BEST_SCORE]), 3),
                "box": [round(float(v), 1) for v in col[BEST_BOX]],
                "frame_id": int(col[BEST_FRAME]),
                "ts": round(float(col[BEST_TS]), 3),
            },
        }

    def _ends(self, a: Analysis, announced: np.ndarray) -> None:
        ended = a.step.ended
        assert ended is not None
        visited = a.ended_zones
        for k in announced.nonzero()[0].tolist():
            col = ended.table[:, k]
            body = self._object_fields("end", col)
            body["frame_id"] = int(col[LAST_FRAME])  # its last detection's
            body["reason"] = ended.reason
            body["duration_s"] = round(float(col[LAST_SEEN] - col[FIRST_SEEN]), 3)
            body["zones"] = []
            body["entered_zones"] = self._zone_names(visited[k]) if visited is not None else []
            body["snapshot"] = self._snap.due(ended.rows[k], self._cfg, self._out.connected)
            self._send(body, a.ts)
            if body["snapshot"]:
                self._send_snapshot(int(col[ID]), ended.rows[k])
        self._snap.drop(ended.rows)

    def _event(self, tr: Transition, a: Analysis) -> None:
        """A rule's transition (pipelines.rules) as an event: its type, the region's name, the rule's lead
        fields, the track, the rule's other fields, then the region's counts after it."""
        rule = rule_of(tr.kind)
        regions = self.analytics.regions(rule.region)
        fields = {k: round(float(v), 3) if isinstance(v, float) else v for k, v in tr.fields.items()}
        body: dict[str, Any] = {"type": tr.kind, rule.region: regions.specs[tr.region].name}
        body.update((k, fields.pop(k)) for k in rule.lead)
        body.update(
            track_id=tr.track_id, label=self._label(tr.class_id), class_id=tr.class_id, frame_id=a.frame_id
        )
        body.update(fields)
        body.update(regions.after(tr.kind, tr.region))
        self._send(body, a.ts)
        if rule.moves and tr.reason is None:
            row = self._row_of(a, tr.track_id)
            if row is not None:
                self._pending[row] = True  # the object's zones changed: an update is due

    @staticmethod
    def _row_of(a: Analysis, track_id: int) -> int | None:
        rows = (a.table[ID] == track_id).nonzero()[0]
        return int(rows[0]) if rows.size else None

    def _send(self, body: dict[str, Any], ts: float) -> None:
        self.counts[body["type"]] += 1
        topics = self._out.topics
        self._out.publish(
            topics.events(self.camera),
            payload("event", ts=ts, camera=self.camera, **body),
            state=False,
            qos=1,
        )

    def _send_snapshot(self, track_id: int, row: int) -> None:
        data = self._snap.jpeg(row, self._cfg.snapshot.quality)
        self.counts["snapshots"] += 1
        self._out.publish(self._out.topics.track_snapshot(self.camera, track_id), data, state=False, qos=0)

    # ---- names ----
    def _label(self, cls: int) -> str:
        return self.labels[cls] if 0 <= cls < len(self.labels) else str(cls)

    def _zone_names(self, mask: np.ndarray) -> list[str]:
        specs = self.analytics.zones.specs
        return [specs[j].name for j in mask.nonzero()[0].tolist()]
