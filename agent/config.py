"""YAML configuration: schema, ${VAR} expansion, errors that name the file and the key path.

Secrets (camera URLs with passwords, MQTT passwords) are kept out of every repr: camera URLs are
excluded from the model repr and shown through `mask_url`, the MQTT password is a SecretStr.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.tls import TlsFileError, TlsOptions, client_context
from engines.plan import Precision
from pipelines.urls import mask_url
from pipelines.zones import polygon_problem, segment_problem

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # safe inside an MQTT topic level


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a device id or a fleet group (one topic level), or None. A leading '_' is
    reserved for the fleet's shared topics ({prefix}/_all, {prefix}/_group)."""
    if not _NAME.match(name):
        return "may only hold letters, digits, '_', '-' and '.'"
    if name.startswith("_"):
        return "must not start with '_' (reserved for the fleet topics _all and _group)"
    return None


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    min: int = Field(1, ge=1, le=256)
    opt: int = Field(1, ge=1, le=256)
    max: int = Field(1, ge=1, le=256)

    @model_validator(mode="after")
    def _ordered(self) -> BatchConfig:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"must satisfy min <= opt <= max (got {self.min}, {self.opt}, {self.max})")
        return self


class CalibrationConfig(_Strict):
    source: Literal["cameras", "folder"] = "cameras"
    folder: Path | None = None
    samples: int = Field(500, gt=0, le=100_000)
    # minmax by default: measured best on the bundled detector (README precision table).
    method: Literal["entropy", "minmax", "percentile"] = "minmax"
    # At most one frame per camera per interval, so the frames span minutes of scene change.
    interval_s: float = Field(1.0, gt=0, le=86400)


class AccuracyGateConfig(_Strict):
    min_agreement: float = Field(0.9, ge=0.0, le=1.0)


class ThreadsConfig(_Strict):
    intra: int = Field(0, ge=0, le=256, description="ONNX Runtime intra-op threads (0 = its default)")
    inter: int = Field(0, ge=0, le=256)


class EngineConfig(_Strict):
    workspace_mb: int = Field(1024, gt=0, le=1 << 20, description="TensorRT builder workspace limit")
    optimization_level: int = Field(3, ge=0, le=5)
    dla_core: int | None = Field(None, ge=0, description="Jetson DLA core (GPU fallback on)")
    target_compute_capability: str | None = Field(
        None, pattern=r"^\d+\.\d+$", description="TensorRT-RTX ahead-of-time target where no GPU is visible"
    )


class ProfileShapes(_Strict):
    min: list[int]
    opt: list[int]
    max: list[int]

    @model_validator(mode="after")
    def _ordered(self) -> ProfileShapes:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError("min, opt and max must have the same rank")
        if any(not 1 <= a <= b <= c for a, b, c in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError("each dimension must satisfy 1 <= min <= opt <= max")
        return self


class ModelConfig(_Strict):
    onnx: Path
    format: Literal["nanodet", "yolov8", "yolo11", "yolov5"] = "yolov8"
    labels: Path | None = None
    backend: Literal["auto", "tensorrt", "tensorrt_rtx", "onnxruntime"] = "auto"
    precision: Precision = "fp16"
    batch: BatchConfig = BatchConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    accuracy_gate: AccuracyGateConfig = AccuracyGateConfig()
    iou_threshold: float = Field(0.5, gt=0.0, le=1.0)
    threads: ThreadsConfig = ThreadsConfig()
    # TensorRT execution contexts, each with its own CUDA stream, optimisation profile and buffers.
    streams: int = Field(2, ge=1, le=16)
    engine: EngineConfig = EngineConfig()
    # Explicit TensorRT optimisation profiles, one mapping {input name: {min, opt, max}} each; without
    # them one profile is derived from the ONNX shapes and `batch`.
    profiles: list[dict[str, ProfileShapes]] | None = None
    # Frames older than this when the scheduler takes them are dropped unprocessed and counted per camera
    # (telemetry `dropped_stale`); 0 never drops. A frame waiting in a camera's slot is its newest, so
    # this catches stalls (a camera or the pipeline), not steady overload.
    max_age_ms: float = Field(500.0, ge=0)
    # gpu: letterbox + normalise with a CUDA kernel straight into the engine's input (needs cuda-python
    # and a backend that takes device input: TensorRT; while ONNX Runtime serves, the CPU does it).
    preprocess: Literal["cpu", "gpu"] = "cpu"
    # graph: decode + score threshold + NMS grafted onto the ONNX before anything is built or served
    # (pipelines.models.graft), so the engine returns detections (a few KB per frame) instead of raw heads;
    # the grafted part stays FP32 whatever the precision (engines.islands).
    postprocess: Literal["host", "graph"] = "host"
    # The grafted graph's score threshold: a constant of the graph (changing it rebuilds the engine); the
    # model's cameras need min_score >= it.
    graph_score_threshold: float = Field(0.25, gt=0.0, lt=1.0)


class SnapshotConfig(_Strict):
    # Besides on request (cmd/snapshot): an annotated JPEG when the camera has detections, at most this often.
    on_detection: bool = False
    min_interval_s: float = Field(30.0, ge=1.0, le=86400)
    quality: int = Field(80, ge=10, le=100)


# ---- tracking, zones, lines, events (pipelines.analytics; agent.events) ----
Anchor = Literal["bottom_center", "center", "top_center", "left_center", "right_center"]
Point = tuple[Annotated[float, Field(allow_inf_nan=False)], Annotated[float, Field(allow_inf_nan=False)]]


class TrackingConfig(_Strict):
    """Per camera; defaults as ByteTrack's (pipelines.tracking)."""

    enabled: bool = True
    # Detections from here up to min_score are not reported but keep tracks alive (ByteTrack's second stage).
    # ByteTrack uses 0.1; 0.25 here: the camera's route keeps every detection down to it, and on the
    # bundled NanoDet scores from 0.1 made the host's decode + NMS 3x dearer (+0.6-0.9 ms a frame) for the
    # same identities on the clip (README "Tracking, zones and events").
    low_score: float = Field(0.25, ge=0.01, le=1.0)
    # New tracks start from detections at or above this (default min_score + 0.1, as ByteTrack's): a
    # detection that barely passes min_score is reported but does not start a track on its own.
    new_track_score: float | None = Field(None, ge=0.01, le=1.0)
    match_iou: float = Field(0.2, gt=0.0, lt=1.0)  # least IoU between a predicted track and a detection
    min_hits: int = Field(2, ge=1, le=30)  # frames in a row before a track is confirmed and gets an id
    max_lost_s: float = Field(1.5, gt=0, le=60)  # how long an unseen track is kept (occlusions, misses)
    reset_gap_s: float = Field(2.0, gt=0, le=600)  # a longer gap between frames ends every track


class FrameSize(_Strict):
    w: int = Field(ge=1, le=16384)
    h: int = Field(ge=1, le=16384)


def _closed(points: list[Point]) -> list[Point]:
    # Drawing tools often close a polygon by repeating its first point; that point adds nothing.
    return points[:-1] if len(points) > 3 and points[0] == points[-1] else points


def _normalised_problem(points: list[Point]) -> str | None:
    for i, (x, y) in enumerate(points):
        if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
            return (
                f"point {i + 1} [{x:g}, {y:g}] is outside the picture (normalized coordinates are 0..1; "
                "for source pixels set units: pixels and the camera's frame_size)"
            )
    return None


class ZoneConfig(_Strict):
    polygon: list[Point]
    units: Literal["normalized", "pixels"] = "normalized"
    labels: list[str] | None = None  # counted labels (default: every class the camera reports)
    anchor: Anchor = "bottom_center"  # the point of a box that must be inside
    inertia: int = Field(2, ge=1, le=100)  # frames in a row inside (outside) before an enter (leave)

    @field_validator("polygon")
    @classmethod
    def _polygon(cls, v: list[Point]) -> list[Point]:
        v = _closed(v)
        problem = polygon_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str] | None) -> list[str] | None:
        return _label_list(v)


class LineConfig(_Strict):
    # A -> B; crossing from its left to its right (as seen on the picture) counts as "in".
    points: list[Point]
    units: Literal["normalized", "pixels"] = "normalized"
    labels: list[str] | None = None
    anchor: Anchor = "bottom_center"

    @field_validator("points")
    @classmethod
    def _points(cls, v: list[Point]) -> list[Point]:
        problem = segment_problem(v)
        if problem is not None:
            raise ValueError(problem)
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


class EventSnapshotConfig(_Strict):
    # A JPEG of the object's best detection (its box with a margin) after its `end` event.
    enabled: bool = False
    min_interval_s: float = Field(10.0, ge=0.5, le=86400)  # per camera
    quality: int = Field(80, ge=10, le=100)


class EventsConfig(_Strict):
    enabled: bool = True
    # Object events (new, update, end): for every track (all), only for tracks that entered one of the
    # camera's zones (in_zones: `new` comes with the first zone entry), or none (zone and line events only).
    objects: Literal["all", "in_zones", "none"] = "all"
    # `update` events: when the object's zones changed or it moved update_move x the picture's diagonal
    # since its last event, at most one per update_interval_s per object.
    update_interval_s: float = Field(5.0, ge=0.1, le=3600)
    update_move: float = Field(0.2, gt=0.0, le=2.0)
    snapshot: EventSnapshotConfig = EventSnapshotConfig()


class PublishConfig(_Strict):
    # every_frame: as before; on_change: when the labels or track ids in the picture change (and at least
    # every 10 s); off: no detections messages (events, zones and lines still are).
    detections: Literal["every_frame", "on_change", "off"] = "every_frame"

    @field_validator("detections", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if v is False else v


class CameraConfig(_Strict):
    # repr=False: the URL may hold a password; use `display` for logs.
    url: str | None = Field(None, repr=False)
    pipeline: str | None = Field(None, repr=False, description="GStreamer pipeline ending in appsink")
    model: str
    fps: float | None = Field(None, gt=0, le=1000)
    classes: list[str] | None = None
    min_score: float = Field(0.4, ge=0.0, le=1.0)
    loop: bool = True
    enabled: bool = True
    # Bounded: the reader hands them to FFmpeg in microseconds and waits on them (1e308 would overflow).
    open_timeout_s: float = Field(5.0, gt=0, le=3600)
    read_timeout_s: float = Field(2.0, gt=0, le=3600)
    snapshot: SnapshotConfig = SnapshotConfig()
    # auto: NVDEC where the host, the stream's codec and its size allow it, else the CPU (reason logged).
    decoder: Literal["auto", "cpu", "nvdec"] = "auto"
    # NVDEC output: low hands out each picture with its packet; native lets the decoder hold up to 4 back
    # (more decode throughput per GPU, up to 4 frames more latency; capture times stay those of the packets).
    decoder_latency: Literal["low", "native"] = "low"
    tracking: TrackingConfig = TrackingConfig()
    zones: dict[str, ZoneConfig] = Field(default_factory=dict, max_length=32)
    lines: dict[str, LineConfig] = Field(default_factory=dict, max_length=32)
    events: EventsConfig = EventsConfig()
    publish: PublishConfig = PublishConfig()
    # The picture size that zone and line points in pixels refer to (scaled if the stream's differs).
    frame_size: FrameSize | None = None
    # pipeline.shards > 1: the shard that runs this camera (None: placed by load, and kept across reloads).
    shard: int | None = Field(None, ge=0, le=63)

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


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def _host_problem(host: str) -> str | None:
    """Why ``host`` cannot name a broker, or None. paho only fails on these once connecting: an empty
    host ended start-up with a traceback, and some (e.g. 'a..b') end its network thread for good."""
    if not host:
        return "must not be empty"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host.removesuffix(".")
    if len(name) <= 253 and all(_HOST_LABEL.match(label) for label in name.split(".")):
        return None
    # The value is not echoed: 'user:password@host' is a plausible mistake.
    return "must be a host name or an IP address, without scheme, port, path or credentials"


class MqttTlsConfig(_Strict):
    """`mqtt.tls` as a mapping (`tls: true` is `tls: {}`); paths resolve against the config's folder."""

    ca_file: Path | None = Field(None, description="PEM CA certificate(s) trusted, not the system store")
    cert_file: Path | None = Field(None, description="PEM client certificate (require_certificate brokers)")
    key_file: Path | None = Field(None, description="the client certificate's unencrypted PEM key")
    # DANGEROUS: no certificate and no host name verification (see agent.tls.TlsOptions). Only ever on
    # when this key is written; nothing falls back to it.
    insecure: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> MqttTlsConfig:
        self.options()  # the rules live in TlsOptions, shared with the client
        return self

    def options(self) -> TlsOptions:
        return TlsOptions(self.ca_file, self.cert_file, self.key_file, self.insecure)


class MqttConfig(_Strict):
    enabled: bool = True
    host: str = "localhost"
    port: int = Field(1883, ge=1, le=65535)
    tls: MqttTlsConfig | None = None
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    qos: int = Field(0, ge=0, le=2)
    prefix: str = "edge-agent"
    # 65535: the MQTT keep-alive field is 16 bits (paho's thread died packing a larger one).
    keepalive: int = Field(30, ge=5, le=65535)
    offline_queue: int = Field(1000, ge=1)
    # Retry waits double from reconnect_min_s up to reconnect_max_s, each cut at random by up to half
    # (jitter: agents that lost the same broker do not come back in lock-step). A broker that is back
    # is found within reconnect_max_s plus the connect itself: the default keeps that within 5 s.
    reconnect_min_s: float = Field(1.0, gt=0, le=60)
    reconnect_max_s: float = Field(4.0, gt=0, le=300)
    # MQTT commands this agent accepts (cmd/<action>); others are answered "disabled".
    commands: list[Literal["rebuild", "reload", "snapshot"]] = ["rebuild", "reload", "snapshot"]
    # Fleet groups: the agent also takes commands on {prefix}/_group/<name>/cmd/+ (and always {prefix}/_all).
    groups: list[str] = Field(default_factory=list, max_length=32)
    # Also take {prefix}/_any/cmd/+ and {prefix}/_group/<g>/any/cmd/+ through MQTT shared subscriptions
    # ($share/...): each such command goes to one agent of the fleet / group. Off: not every broker has them.
    shared_subscriptions: bool = False
    # MQTT 5 (default) lets the broker say why it refuses a publish (an ACL); 3.1.1 for brokers without it.
    protocol: Literal["5", "3.1.1"] = "5"

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol(cls, v: object) -> object:
        # YAML reads `protocol: 5` as an integer and `protocol: 3.1.1` as a string.
        return "5" if v == 5 and not isinstance(v, bool) else v

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"entry {i + 1}: {problem}")
        if len(set(v)) != len(v):
            raise ValueError("names must be unique")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or any(c in v for c in "+#") or v.startswith("/") or v.endswith("/"):
            raise ValueError("must be a topic prefix without '+', '#' or leading/trailing '/'")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        problem = _host_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_forms(cls, v: Any) -> Any:
        # `tls: true` (system CA store, verified) and `tls: false` keep working next to the mapping.
        if v is None or isinstance(v, (dict, MqttTlsConfig)):
            return v
        try:
            return {} if _BOOL.validate_python(v) else None
        except ValidationError:
            msg = "must be true, false or a mapping of ca_file, cert_file, key_file, insecure"
            raise ValueError(msg) from None

    @model_validator(mode="after")
    def _credentials(self) -> MqttConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give password or password_file, not both")
        if self.username is None and (self.password is not None or self.password_file is not None):
            raise ValueError("a password needs a username (MQTT sends no password without one)")
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("reconnect_min_s must be <= reconnect_max_s")
        return self

    def read_password(self) -> str | None:
        """The password from `password` or `password_file`; ConfigError naming mqtt.password_file."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is None:
            return None
        path = self.password_file
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"mqtt.password_file: cannot read {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:  # its message would quote bytes of the password
            raise ConfigError(f"mqtt.password_file: {path}: not UTF-8 text") from None
        password = text.strip()
        if not password:
            raise ConfigError(f"mqtt.password_file: {path}: the file is empty")
        return password


class TelemetryConfig(_Strict):
    interval_s: float = Field(10.0, ge=0.1, le=86400)
    prometheus_port: int | None = Field(None, ge=1, le=65535)


class HomeAssistantConfig(_Strict):
    """Home Assistant MQTT discovery (agent.discovery): retained entity configs under discovery_prefix."""

    enabled: bool = False
    discovery_prefix: str = "homeassistant"  # HA's default; must match HA's MQTT discovery prefix
    # Object-count sensors for cameras without `classes` (a camera's own `classes` are counted instead).
    count_labels: list[str] = ["person", "car"]

    @field_validator("discovery_prefix")
    @classmethod
    def _discovery_prefix(cls, v: str) -> str:
        if not v or any(c in v for c in "+#") or v.startswith("/") or v.endswith("/"):
            raise ValueError("must be a topic prefix without '+', '#' or leading/trailing '/'")
        return v

    @field_validator("count_labels")
    @classmethod
    def _count_labels(cls, v: list[str]) -> list[str]:
        if any(not label for label in v):
            raise ValueError("labels must be non-empty")
        return v


class RestartConfig(_Strict):
    min_s: float = Field(1.0, gt=0, le=60)
    max_s: float = Field(30.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _order(self) -> RestartConfig:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s {self.min_s:g} is above max_s {self.max_s:g}")
        return self


class PipelineConfig(_Strict):
    """Pipeline shards (agent.shards): 1 is one process; N > 1 a supervisor over N worker processes, each a
    whole pipeline for some of the cameras; auto sizes from the cameras' frame rates, GPUs and cores."""

    shards: int | Literal["auto"] = 1
    gpus: list[int] | None = Field(None, max_length=64)  # shard k on GPU gpus[k % len]; None: as CUDA sees it
    restart: RestartConfig = RestartConfig()  # backoff between restarts of a shard that died

    @field_validator("shards", mode="before")
    @classmethod
    def _shards(cls, v: Any) -> Any:
        if isinstance(v, bool) or not (v == "auto" or (isinstance(v, int) and 1 <= v <= 64)):
            raise ValueError(f"must be 'auto' or an integer 1..64, got {v!r}")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("must list at least one GPU index (or be left out)")
            if min(v) < 0 or len(set(v)) != len(v):
                raise ValueError(f"GPU indices must be >= 0 and distinct, got {v}")
        return v


class AgentConfig(_Strict):
    device_id: str = Field(default_factory=socket.gethostname)
    engine_dir: Path = Path("/var/lib/edge-agent/engines")
    models: dict[str, ModelConfig]
    cameras: dict[str, CameraConfig]
    mqtt: MqttConfig = MqttConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    homeassistant: HomeAssistantConfig = HomeAssistantConfig()
    console: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    pipeline: PipelineConfig = PipelineConfig()

    @field_validator("device_id")
    @classmethod
    def _device(cls, v: str) -> str:
        problem = name_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _cross(self) -> AgentConfig:
        if not self.models:
            raise ValueError("models: at least one model is required")
        for kind, names in (("models", self.models), ("cameras", self.cameras)):
            for name in names:
                if not _NAME.match(name):
                    raise ValueError(f"{kind}.{name}: name may only hold letters, digits, '_', '-' and '.'")
        for model_name, model in self.models.items():
            _check_dla(model_name, model)
        for cam_name, cam in self.cameras.items():
            if cam.model not in self.models:
                known = ", ".join(sorted(self.models))
                raise ValueError(f"cameras.{cam_name}.model: unknown model '{cam.model}' (known: {known})")
            _check_analytics(cam_name, cam)
            shards = self.pipeline.shards
            if cam.shard is not None and isinstance(shards, int) and cam.shard >= shards:
                raise ValueError(
                    f"cameras.{cam_name}.shard: {cam.shard} is not a shard (pipeline.shards is {shards}:"
                    f" 0..{shards - 1})"
                )
            m = self.models[cam.model]
            if m.postprocess == "graph" and cam.min_score < m.graph_score_threshold:
                raise ValueError(
                    f"cameras.{cam_name}.min_score: {cam.min_score:g} is below models.{cam.model}."
                    f"graph_score_threshold {m.graph_score_threshold:g} (postprocess: graph drops lower"
                    " scores inside the model)"
                )
        return self


def _check_analytics(name: str, cam: CameraConfig) -> None:
    """Zones, lines, tracking and events of one camera against each other (errors name the key)."""
    key = f"cameras.{name}"
    regions = {"zones": cam.zones, "lines": cam.lines}
    if not cam.tracking.enabled:
        for what in ("zones", "lines"):
            if regions[what]:
                raise ValueError(f"{key}.{what}: need tracking (cameras.{name}.tracking.enabled is false)")
    new_score = cam.tracking.new_track_score
    if new_score is not None and new_score < cam.min_score:
        raise ValueError(
            f"{key}.tracking.new_track_score: {new_score:g} is below min_score {cam.min_score:g} (tracks"
            " start from reported detections only)"
        )
    if cam.events.objects == "in_zones" and not cam.zones:
        raise ValueError(f"{key}.events.objects: in_zones needs zones ({key}.zones is empty)")
    # Written above min_score it contradicts it; the default (0.25) just yields to a lower min_score.
    if "low_score" in cam.tracking.model_fields_set and cam.tracking.low_score > cam.min_score:
        raise ValueError(
            f"{key}.tracking.low_score: {cam.tracking.low_score:g} is above min_score {cam.min_score:g} "
            "(it is the floor below min_score where detections only keep tracks alive)"
        )
    for what, items in regions.items():
        for region, rc in items.items():
            rkey = f"{key}.{what}.{region}"
            if not _NAME.match(region):
                raise ValueError(f"{rkey}: name may only hold letters, digits, '_', '-' and '.'")
            pts = rc.polygon if isinstance(rc, ZoneConfig) else rc.points
            field = "polygon" if isinstance(rc, ZoneConfig) else "points"
            if rc.units == "normalized":
                problem = _normalised_problem(pts)
                if problem is not None:
                    raise ValueError(f"{rkey}.{field}: {problem}")
            else:
                if cam.frame_size is None:
                    raise ValueError(
                        f"{rkey}.units: pixels needs {key}.frame_size {{w, h}}: the picture size the points"
                        " refer to"
                    )
                w, h = cam.frame_size.w, cam.frame_size.h
                for i, (x, y) in enumerate(pts):
                    if not (0.0 <= x <= w and 0.0 <= y <= h):
                        raise ValueError(
                            f"{rkey}.{field}: point {i + 1} [{x:g}, {y:g}] is outside the {w}x{h} picture "
                            f"({key}.frame_size)"
                        )
            if rc.labels and cam.classes:
                missing = [label for label in rc.labels if label not in cam.classes]
                if missing:
                    raise ValueError(
                        f"{rkey}.labels: {missing[0]!r} is not in {key}.classes (the camera never reports it)"
                    )


def _check_dla(name: str, m: ModelConfig) -> None:
    """What a DLA cannot run, refused at load naming the key (NVIDIA's DLA docs: FP16 and INT8 only,
    static shapes only, TensorRT on Jetson/Drive only); the builder refuses the same for other callers."""
    core = m.engine.dla_core
    if core is None:
        return
    key = f"models.{name}.engine.dla_core"
    if m.backend in ("onnxruntime", "tensorrt_rtx"):
        raise ValueError(f"{key}: DLA needs backend tensorrt or auto (TensorRT on a Jetson), not {m.backend}")
    if m.precision == "fp32":
        raise ValueError(
            f"{key}: DLA runs FP16 and INT8 only; precision fp32 cannot use it (fp16, int8 or best)"
        )
    if not m.batch.min == m.batch.opt == m.batch.max:
        raise ValueError(
            f"{key}: DLA needs static shapes, but models.{name}.batch ranges {m.batch.min}..{m.batch.max} "
            "(set min = opt = max)"
        )
    for i, profile in enumerate(m.profiles or []):
        for tensor, shapes in profile.items():
            if not shapes.min == shapes.opt == shapes.max:
                raise ValueError(
                    f"{key}: DLA needs static shapes, but models.{name}.profiles[{i}].{tensor} has "
                    "min/opt/max that differ"
                )


# ---- loading -------------------------------------------------------------------------------


MAX_CONFIG_BYTES = 1 << 20
MAX_NODES = 100_000  # YAML aliases can make a small file expand exponentially ("billion laughs")


def _expand_env(
    node: Any, path: str, source: str, env: dict[str, str], budget: list[int] | None = None
) -> Any:
    budget = budget if budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"{source}: too many values (over {MAX_NODES}; YAML aliases expanding?)")
    if path.count(".") + path.count("[") > 32:
        raise ConfigError(f"{source}: {path[:80]}...: nested too deeply")
    if isinstance(node, dict):
        return {
            k: _expand_env(v, f"{path}.{k}" if path else str(k), source, env, budget) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_expand_env(v, f"{path}[{i}]", source, env, budget) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            raise ConfigError(f"{source}: {path}: environment variable {name} is not set")

        return _ENV.sub(sub, node)
    return node


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


_MESSAGES = {
    "extra_forbidden": lambda e: "unknown key",
    "missing": lambda e: "required key is missing",
    "greater_than": lambda e: f"must be > {_num(e['ctx']['gt'])}",
    "greater_than_equal": lambda e: f"must be >= {_num(e['ctx']['ge'])}",
    "less_than": lambda e: f"must be < {_num(e['ctx']['lt'])}",
    "less_than_equal": lambda e: f"must be <= {_num(e['ctx']['le'])}",
    "literal_error": lambda e: f"must be one of {e['ctx']['expected']}",
    "int_parsing": lambda e: "must be an integer",
    "int_type": lambda e: "must be an integer",
    "int_from_float": lambda e: "must be an integer",
    "float_parsing": lambda e: "must be a number",
    "float_type": lambda e: "must be a number",
    "finite_number": lambda e: "must be a finite number",
    "bool_parsing": lambda e: "must be true or false",
    "bool_type": lambda e: "must be true or false",
    "string_type": lambda e: "must be a string",
    "dict_type": lambda e: "must be a mapping",
    "model_type": lambda e: "must be a mapping",
    "list_type": lambda e: "must be a list",
    "string_pattern_mismatch": lambda e: f"must match {e['ctx']['pattern']}",
    "too_long": lambda e: f"at most {e['ctx']['max_length']} entries",
}


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(p) for p in err["loc"])
        fmt = _MESSAGES.get(err["type"])
        msg = fmt(err) if fmt is not None else str(err["msg"]).removeprefix("Value error, ")
        if msg.startswith(("models.", "cameras.")) and ":" in msg:
            lines.append(f"{source}: {msg}")  # cross-field errors carry their own key path
        else:
            lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    if len(lines) > 20:
        lines = [*lines[:20], f"{source}: ... and {len(lines) - 20} more"]
    return "\n".join(lines)


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None, env: dict[str, str] | None = None
) -> AgentConfig:
    """Validate a mapping (as loaded from YAML). Relative paths resolve against base_dir."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    data = _expand_env(data, "", source, dict(os.environ) if env is None else env)
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    _check_mqtt_files(cfg, source)
    return cfg


def _check_mqtt_files(cfg: AgentConfig, source: str) -> None:
    """Password and TLS files must be usable at load: --check-config and a reload catch them, not the
    connection attempt later. Errors name the key and the path, never what a file holds."""
    mqtt = cfg.mqtt
    if not mqtt.enabled:
        return
    try:
        mqtt.read_password()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if mqtt.tls is not None:
        try:
            client_context(mqtt.tls.options())
        except TlsFileError as exc:
            raise ConfigError(f"{source}: mqtt.tls.{exc}") from None


def _resolve_paths(cfg: AgentConfig, base: Path) -> AgentConfig:
    def rel(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p)

    models = {
        name: m.model_copy(update={"onnx": rel(m.onnx), "labels": rel(m.labels)})
        for name, m in cfg.models.items()
    }
    update: dict[str, Any] = {"models": models, "engine_dir": rel(cfg.engine_dir)}
    mqtt_update: dict[str, Any] = {"password_file": rel(cfg.mqtt.password_file)}
    if cfg.mqtt.tls is not None:
        tls = cfg.mqtt.tls
        files = {key: rel(getattr(tls, key)) for key in ("ca_file", "cert_file", "key_file")}
        mqtt_update["tls"] = tls.model_copy(update=files)
    update["mqtt"] = cfg.mqtt.model_copy(update=mqtt_update)
    return cfg.model_copy(update=update)


def load_config(path: str | Path, env: dict[str, str] | None = None) -> AgentConfig:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: config larger than {MAX_CONFIG_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from None
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, str(path), path.resolve().parent, env)
