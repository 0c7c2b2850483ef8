"""`cameras.<name>`: its source, model, decoder and analytics, and the checks of its analytics against each
other."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.analytics import (
    EventsConfig,
    FrameSize,
    LineConfig,
    PublishConfig,
    TrackingConfig,
    ZoneConfig,
    normalised_problem,
)
from agent.config.errors import show
from agent.config.impact import Impact
from agent.config.names import display_name_problem, level_problem
from agent.config.sources import camera_url_problem
from agent.config.strict import StrictModel, raise_problem
from pipelines.urls import mask_url


class SnapshotConfig(StrictModel):
    # Besides on request (cmd/snapshot): an annotated JPEG when the camera has detections, at most this often.
    on_detection: bool = False
    min_interval_s: float = Field(30.0, ge=1.0, le=86400)
    quality: int = Field(80, ge=10, le=100)


class CameraConfig(StrictModel):
    # repr=False: the URL may hold a password; use `display` for logs.
    # Each key says what a reload that changes it needs (agent.config.impact).
    url: Annotated[str | None, Impact.CAMERA] = Field(None, repr=False)
    pipeline: Annotated[str | None, Impact.CAMERA] = Field(
        None, repr=False, description="GStreamer pipeline ending in appsink"
    )
    model: Annotated[str, Impact.CAMERA]
    # Shown in Home Assistant (any text); the camera's key stays its id in topics. Discovery is published
    # again after every reload.
    name: Annotated[str | None, Impact.LIVE] = None
    fps: Annotated[float | None, Impact.CAMERA] = Field(None, gt=0, le=1000)
    classes: Annotated[list[str] | None, Impact.ROUTE] = None
    min_score: Annotated[float, Impact.ROUTE] = Field(0.4, ge=0.0, le=1.0)
    loop: Annotated[bool, Impact.CAMERA] = True
    enabled: Annotated[bool, Impact.CAMERA] = True  # the camera starts or stops
    # Bounded: the reader hands them to FFmpeg in microseconds and waits on them (1e308 would overflow).
    open_timeout_s: Annotated[float, Impact.CAMERA] = Field(5.0, gt=0, le=3600)
    read_timeout_s: Annotated[float, Impact.CAMERA] = Field(2.0, gt=0, le=3600)
    snapshot: Annotated[SnapshotConfig, Impact.LIVE] = SnapshotConfig()  # read at each snapshot
    # auto: NVDEC where the host, the stream's codec and its size allow it, else the CPU (reason logged).
    decoder: Annotated[Literal["auto", "cpu", "nvdec"], Impact.CAMERA] = "auto"
    # NVDEC output: low hands out each picture with its packet; native lets the decoder hold up to 4 back
    # (more decode throughput per GPU, up to 4 frames more latency; capture times stay those of the packets).
    decoder_latency: Annotated[Literal["low", "native"], Impact.CAMERA] = "low"
    tracking: Annotated[TrackingConfig, Impact.ANALYTICS] = TrackingConfig()
    zones: Annotated[dict[str, ZoneConfig], Impact.ANALYTICS] = Field(default_factory=dict, max_length=32)
    lines: Annotated[dict[str, LineConfig], Impact.ANALYTICS] = Field(default_factory=dict, max_length=32)
    events: Annotated[EventsConfig, Impact.ANALYTICS] = EventsConfig()
    publish: Annotated[PublishConfig, Impact.ANALYTICS] = PublishConfig()
    # The picture size that zone and line points in pixels refer to (scaled if the stream's differs).
    frame_size: Annotated[FrameSize | None, Impact.ANALYTICS] = None
    # pipeline.shards > 1: the shard that runs this camera (None: placed by load, and kept across reloads).
    shard: Annotated[int | None, Impact.PLACEMENT] = Field(None, ge=0, le=63)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        raise_problem(None if v is None else display_name_problem(v))
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        raise_problem(None if v is None else camera_url_problem(v))
        return v

    @field_validator("pipeline")
    @classmethod
    def _pipeline(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        if v is not None and "appsink" not in v:
            raise ValueError("must end in an appsink element (OpenCV takes the frames from it)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> CameraConfig:
        if (self.url is None) == (self.pipeline is None):
            raise ValueError("give exactly one of 'url' or 'pipeline'")
        if self.decoder == "nvdec" and self.pipeline is not None:
            # A GStreamer pipeline decodes itself (Jetson: nvv4l2decoder); NVDEC here needs FFmpeg packets.
            raise ValueError("decoder 'nvdec' needs 'url' (a GStreamer 'pipeline' does its own decoding)")
        return self

    @property
    def display(self) -> str:
        return mask_url(self.url) if self.url is not None else "gstreamer pipeline"


def analytics_problems(name: str, cam: CameraConfig) -> list[str]:
    """Zones, lines, tracking and events of one camera against each other (each line names the key)."""
    key = f"cameras.{name}"
    problems: list[str] = []
    regions = {"zones": cam.zones, "lines": cam.lines}
    if not cam.tracking.enabled:
        for what in ("zones", "lines"):
            if regions[what]:
                problems.append(f"{key}.{what}: need tracking (cameras.{name}.tracking.enabled is false)")
    new_score = cam.tracking.new_track_score
    if new_score is not None and new_score < cam.min_score:
        problems.append(
            f"{key}.tracking.new_track_score: {new_score:g} is below min_score {cam.min_score:g} (tracks"
            " start from reported detections only)"
        )
    if cam.events.objects == "in_zones" and not cam.zones:
        problems.append(f"{key}.events.objects: in_zones needs zones ({key}.zones is empty)")
    # Written above min_score it contradicts it; the default (0.25) just yields to a lower min_score.
    if "low_score" in cam.tracking.model_fields_set and cam.tracking.low_score > cam.min_score:
        problems.append(
            f"{key}.tracking.low_score: {cam.tracking.low_score:g} is above min_score {cam.min_score:g} "
            "(it is the floor below min_score where detections only keep tracks alive)"
        )
    for what, items in regions.items():
        for region, rc in items.items():
            rkey = f"{key}.{what}.{show(region)}"
            problem = level_problem(region)
            if problem is not None:
                problems.append(
                    f"{rkey}: name {problem} (the name is a topic level; any other text goes in its display"
                    " `name:`)"
                )
            pts = rc.polygon if isinstance(rc, ZoneConfig) else rc.points
            field = "polygon" if isinstance(rc, ZoneConfig) else "points"
            if rc.units == "normalized":
                problem = normalised_problem(pts)
                if problem is not None:
                    problems.append(f"{rkey}.{field}: {problem}")
            elif cam.frame_size is None:
                problems.append(
                    f"{rkey}.units: pixels needs {key}.frame_size {{w, h}}: the picture size the points"
                    " refer to"
                )
            else:
                w, h = cam.frame_size.w, cam.frame_size.h
                outside = [(i, x, y) for i, (x, y) in enumerate(pts) if not (0.0 <= x <= w and 0.0 <= y <= h)]
                if outside:
                    i, x, y = outside[0]
                    problems.append(
                        f"{rkey}.{field}: point {i + 1} [{x:g}, {y:g}] is outside the {w}x{h} picture "
                        f"({key}.frame_size)"
                    )
            if rc.labels and cam.classes:
                missing = [label for label in rc.labels if label not in cam.classes]
                if missing:
                    problems.append(
                        f"{rkey}.labels: {missing[0]!r} is not in {key}.classes (the camera never reports it)"
                    )
    return problems
