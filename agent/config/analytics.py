"""A camera's tracking, zones, lines, events and publish sections (pipelines.analytics; agent.events)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict, field_validator

from agent.config.impact import Impact
from agent.config.names import display_name_problem
from agent.config.strict import StrictModel, raise_problem
from pipelines.regions import polygon_problem, segment_problem

Anchor = Literal["bottom_center", "center", "top_center", "left_center", "right_center"]
# [x, y]: YAML gives a list, strict mode would only take a tuple; the numbers stay strict (not "0.5").
Point = Annotated[tuple[float, float], Strict(False)]


class TrackingConfig(StrictModel):
    """Per camera; defaults as ByteTrack's (pipelines.tracking)."""

    enabled: bool = True
    # Detections from here up to min_score are not reported but keep tracks alive (ByteTrack's second stage).
    # ByteTrack uses 0.1. 0.15 here, from tools/track_eval.py on the MOT15 trajectories (README "Tracking,
    # zones and events"): MOTA 0.721 / IDF1 0.804 / 1.3 ID switches against 0.741 / 0.800 / 1.8 at 0.1 and
    # 0.672 / 0.770 / 2.5 at 0.25; the camera's route decodes every detection down to it, and the host's
    # decode + NMS of the bundled NanoDet costs 0.39 ms a frame at 0.15 (0.53 at 0.1, 0.25 at 0.25).
    low_score: float = Field(0.15, ge=0.01, le=1.0)
    # New tracks start from detections at or above this (default min_score + 0.1, as ByteTrack's): a
    # detection that barely passes min_score is reported but does not start a track on its own.
    new_track_score: float | None = Field(None, ge=0.01, le=1.0)
    match_iou: float = Field(0.2, gt=0.0, lt=1.0)  # least IoU between a predicted track and a detection
    min_hits: int = Field(2, ge=1, le=30)  # frames in a row before a track is confirmed and gets an id
    max_lost_s: float = Field(1.5, gt=0, le=60)  # how long an unseen track is kept (occlusions, misses)
    reset_gap_s: float = Field(2.0, gt=0, le=600)  # a longer gap between frames ends every track


class FrameSize(StrictModel):
    w: int = Field(ge=1, le=16384)
    h: int = Field(ge=1, le=16384)


def _closed(points: list[Point]) -> list[Point]:
    # Drawing tools often close a polygon by repeating its first point; that point adds nothing.
    return points[:-1] if len(points) > 3 and points[0] == points[-1] else points


def normalised_problem(points: list[Point]) -> str | None:
    for i, (x, y) in enumerate(points):
        if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
            return (
                f"point {i + 1} [{x:g}, {y:g}] is outside the picture (normalized coordinates are 0..1; "
                "for source pixels set units: pixels and the camera's frame_size)"
            )
    return None


class ZoneConfig(StrictModel):
    polygon: list[Point]
    # Shown in Home Assistant (any text); the key stays the id in topics. A change renames the entities
    # (discovery is published again after a reload) and leaves the counts alone.
    name: Annotated[str | None, Impact.LIVE] = None
    units: Literal["normalized", "pixels"] = "normalized"
    labels: list[str] | None = None  # counted labels (default: every class the camera reports)
    anchor: Anchor = "bottom_center"  # the point of a box that must be inside
    # Frames in a row inside (outside) before an enter (leave), and at least this long from the first of
    # them (frame times): both must hold. Time is what filters a box flickering across the edge at any
    # frame rate; 0.1 s counted the MOT15 entries as well as 2 frames at 25 fps, longer lost real ones
    # (tools/track_eval.py). `inertia_s: 0` and `inertia: 2` is the old frames-only default.
    inertia: int = Field(1, ge=1, le=100)
    inertia_s: float = Field(0.1, ge=0.0, le=60.0)
    # A zone_loiter event once per stay this long inside (pipelines/rules/loitering.py); None: off.
    loiter_s: float | None = Field(None, gt=0, le=86400)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        raise_problem(None if v is None else display_name_problem(v))
        return v

    @field_validator("polygon")
    @classmethod
    def _polygon(cls, v: list[Point]) -> list[Point]:
        v = _closed(v)
        raise_problem(polygon_problem(v))
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str] | None) -> list[str] | None:
        return _label_list(v)


class LineConfig(StrictModel):
    # A -> B; crossing from its left to its right (as seen on the picture) counts as "in".
    points: list[Point]
    # Shown in Home Assistant (any text); the key stays the id in topics. A change renames the entities
    # (discovery is published again after a reload) and leaves the counts alone.
    name: Annotated[str | None, Impact.LIVE] = None
    units: Literal["normalized", "pixels"] = "normalized"
    labels: list[str] | None = None
    anchor: Anchor = "bottom_center"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        raise_problem(None if v is None else display_name_problem(v))
        return v

    @field_validator("points")
    @classmethod
    def _points(cls, v: list[Point]) -> list[Point]:
        raise_problem(segment_problem(v))
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str] | None) -> list[str] | None:
        return _label_list(v)


def _label_list(v: list[str] | None) -> list[str] | None:
    if v is None:
        return v
    if not v or any(not label for label in v):
        raise ValueError("labels must be a non-empty list of non-empty names (leave it out for every label)")
    if len(set(v)) != len(v):
        raise ValueError("labels must be unique")
    return v


class EventSnapshotConfig(StrictModel):
    # A JPEG of the object's best detection (its box with a margin) after its `end` event.
    enabled: bool = False
    min_interval_s: float = Field(10.0, ge=0.5, le=86400)  # per camera
    quality: int = Field(80, ge=10, le=100)


class EventsConfig(StrictModel):
    enabled: bool = True
    # Object events (new, update, end): for every track (all), only for tracks that entered one of the
    # camera's zones (in_zones: `new` comes with the first zone entry), or none (zone and line events only).
    objects: Literal["all", "in_zones", "none"] = "all"
    # `update` events: when the object's zones changed or it moved update_move x the picture's diagonal
    # since its last event, at most one per update_interval_s per object.
    update_interval_s: float = Field(5.0, ge=0.1, le=3600)
    update_move: float = Field(0.2, gt=0.0, le=2.0)
    # An object's `new` waits until its track has lived this long (0: at confirmation); tracks that end
    # sooner get no `new` and no `end` (their zone and line events still go out).
    min_duration_s: float = Field(0.0, ge=0.0, le=3600)
    snapshot: EventSnapshotConfig = EventSnapshotConfig()


class PublishConfig(StrictModel):
    # every_frame: as before; on_change: when the labels or track ids in the picture change (and at least
    # every 10 s); off: no detections messages (events, zones and lines still are).
    detections: Literal["every_frame", "on_change", "off"] = "every_frame"

    @field_validator("detections", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if v is False else v
