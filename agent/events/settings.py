"""A camera's tracking, zones and lines config -> pipelines.analytics settings, checked against the
model's labels (ConfigError naming the key)."""

from __future__ import annotations

from agent.config import CameraConfig, ConfigError
from pipelines.analytics import AnalyticsSettings
from pipelines.regions import RegionSpec
from pipelines.rules import zone_params
from pipelines.tracking import TrackerParams


def _class_ids(
    key: str, names: list[str] | None, index: dict[str, int], source: str
) -> tuple[int, ...] | None:
    if names is None:
        return None
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ConfigError(f"{key}: unknown label {unknown[0]!r} (labels: {source})")
    return tuple(index[n] for n in names)


def analytics_settings(
    camera: str, cam: CameraConfig, labels: list[str], labels_src: str
) -> AnalyticsSettings:
    """The camera's analytics settings; ConfigError (naming the key) for a label not in the model's labels."""
    index = {name: i for i, name in enumerate(labels)}
    size = (cam.frame_size.w, cam.frame_size.h) if cam.frame_size is not None else None
    zones = tuple(
        RegionSpec(
            "zone",
            name,
            tuple(z.polygon),
            _class_ids(f"cameras.{camera}.zones.{name}.labels", z.labels, index, labels_src),
            z.anchor,
            z.inertia,
            size if z.units == "pixels" else None,
            zone_params(z),
            inertia_s=z.inertia_s,
        )
        for name, z in cam.zones.items()
    )
    lines = tuple(
        RegionSpec(
            "line",
            name,
            tuple(ln.points),
            _class_ids(f"cameras.{camera}.lines.{name}.labels", ln.labels, index, labels_src),
            ln.anchor,
            1,
            size if ln.units == "pixels" else None,
        )
        for name, ln in cam.lines.items()
    )
    tr = cam.tracking
    new_score = tr.new_track_score if tr.new_track_score is not None else min(1.0, cam.min_score + 0.1)
    # A camera limited to a low fps: a track survives at least two missed frames, and only a gap of more
    # than three frame periods ends every track (else a 0.5 fps camera would reset at every frame).
    period = 1.0 / cam.fps if cam.fps else 0.0
    max_lost_s, reset_gap_s = max(tr.max_lost_s, 2.5 * period), max(tr.reset_gap_s, 3.5 * period)
    params = TrackerParams(
        high_score=cam.min_score,
        new_score=new_score,
        low_score=min(tr.low_score, cam.min_score),
        match_iou=tr.match_iou,
        min_hits=tr.min_hits,
        max_lost_s=max_lost_s,
    )
    return AnalyticsSettings(params, cam.min_score, reset_gap_s, zones, lines)


def track_floor(cam: CameraConfig) -> float:
    """The score a camera's route keeps: down to tracking.low_score while tracking is on."""
    return min(cam.min_score, cam.tracking.low_score) if cam.tracking.enabled else cam.min_score
