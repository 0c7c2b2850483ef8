"""YAML configuration: schema, ${VAR} expansion, errors that name the file and the key path.

Secrets (camera URLs with passwords, MQTT passwords) are kept out of every repr: camera URLs are
excluded from the model repr and shown through `mask_url`, the MQTT password is a SecretStr.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import stat
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.mqtt.tls import TlsFileError, TlsOptions, client_context
from engines.plan import Precision
from pipelines.urls import mask_url
from pipelines.zones import polygon_problem, segment_problem

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # safe inside an MQTT topic level (fullmatch: '$' lets a '\n' by)
MAX_NAME = 128  # device ids, groups, model, camera, zone and line names: topic levels (MQTT topics <= 64 KiB)


def _level_problem(name: str) -> str | None:
    if not _NAME.fullmatch(name):
        return "may only hold letters, digits, '_', '-' and '.'"
    if len(name) > MAX_NAME:
        return f"at most {MAX_NAME} characters"
    return None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a device id or a fleet group (one topic level), or None. A leading '_' is
    reserved for the fleet's shared topics ({prefix}/_all, {prefix}/_group)."""
    problem = _level_problem(name)
    if problem is not None:
        return problem
    if name.startswith("_"):
        return "must not start with '_' (reserved for the fleet topics _all and _group)"
    return None


MAX_PREFIX_BYTES = 512


def topic_prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot start this agent's topics (mqtt.prefix, homeassistant.discovery_prefix), or None.
    It may have several levels (site/edge-agent), none of them empty, without wildcards; topics that start
    with '$' ($SYS/...) are the broker's (MQTT 3.1.1 and 5, 4.7.2)."""
    if not prefix:
        return "must be a topic prefix, not empty"
    if prefix.startswith("/") or prefix.endswith("/"):
        return "must be a topic prefix without a leading or trailing '/'"
    if "//" in prefix:
        return "must be a topic prefix without an empty level ('//')"
    if "+" in prefix or "#" in prefix:
        return "must be a topic prefix without the wildcards '+' or '#'"
    if prefix.startswith("$"):
        return "must be a topic prefix not starting with '$' (such topics are the broker's, e.g. $SYS)"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in prefix):
        return "must be a topic prefix without control characters"
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        return f"must be a topic prefix of at most {MAX_PREFIX_BYTES} bytes"
    return None


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


# ---- strict values ---------------------------------------------------------------------------------
# The schema is strict: a string is not a number ("5"), nor a boolean ("yes", "true"), and a number is not a
# string. Two things still take a field's type (_Strict._take_field_types): a value that a ${VAR}
# substitution made (the environment only has strings) and a whole float for an integer field (1e5, which
# YAML reads as a float). Paths and secrets are written as strings (ConfigPath, Secret).


class _EnvText(str):
    """A string that a ${VAR} substitution produced (see _Strict._take_field_types)."""


_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
_INT_TEXT = re.compile(r"[-+]?[0-9]{1,30}")


def _scalar_kinds(ann: Any) -> set[type]:
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _scalar_kinds(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_kinds(a) for a in typing.get_args(ann)))
    return {ann} if ann in (bool, int, float) else set()


def _list_item(ann: Any) -> Any:
    """The item type of a list field (list[int], list[int] | None), else None."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _list_item(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        items = [i for i in (_list_item(a) for a in typing.get_args(ann)) if i is not None]
        return items[0] if len(items) == 1 else None
    return typing.get_args(ann)[0] if origin is list else None


def _only_int(ann: Any) -> bool:
    """An integer field (int, int | None): not one that also takes a word (pipeline.shards: int | 'auto')."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _only_int(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or _only_int(a) for a in typing.get_args(ann))
    return ann is int


def _settle(ann: Any, v: Any) -> Any:
    kinds = _scalar_kinds(ann)
    if isinstance(v, _EnvText) and kinds:
        text = v.strip()
        if bool in kinds and text.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[text.lower()]
        if int in kinds and _INT_TEXT.fullmatch(text):
            return int(text)
        if float in kinds and len(text) <= 64:
            try:
                return float(text)
            except ValueError:
                pass
        return str(v)
    if type(v) is float and _only_int(ann) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        item = _list_item(ann)
        if item is not None and _scalar_kinds(item):
            return [_settle(item, x) for x in v]
    return v


def _path_text(v: Any) -> Any:
    if isinstance(v, str) and not v.strip():
        raise ValueError("must not be empty")
    return v


# A path is written as a string (strict mode would only take a Path object); "" would be the current folder.
ConfigPath = Annotated[Path, Strict(False), BeforeValidator(_path_text)]
Secret = Annotated[SecretStr, Strict(False)]


class _Strict(BaseModel):
    # allow_inf_nan=False: .nan and .inf are refused as "must be a finite number" before any range check
    # (NaN compares false with everything: it failed as "must be <= 1" on fields that take 0.5).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _take_field_types(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: _settle(fields[k].annotation, v) if k in fields else v for k, v in data.items()}


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
    folder: ConfigPath | None = None
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
    dla_core: int | None = Field(None, ge=0, le=15, description="Jetson DLA core (GPU fallback on)")
    target_compute_capability: str | None = Field(
        None, pattern=r"^\d+\.\d+$", description="TensorRT-RTX ahead-of-time target where no GPU is visible"
    )


MAX_DIM = 1 << 16  # one dimension of a profile shape (TensorRT's are int32; a frame side is <= 16384)


class ProfileShapes(_Strict):
    min: list[int] = Field(max_length=8)
    opt: list[int] = Field(max_length=8)
    max: list[int] = Field(max_length=8, description=f"each dimension 1..{MAX_DIM}, at most 8 of them")

    @model_validator(mode="after")
    def _ordered(self) -> ProfileShapes:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError("min, opt and max must have the same rank")
        if any(d > MAX_DIM for d in self.max):
            raise ValueError(f"each dimension must be <= {MAX_DIM}")
        if any(not 1 <= a <= b <= c for a, b, c in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError("each dimension must satisfy 1 <= min <= opt <= max")
        return self


class ModelConfig(_Strict):
    onnx: ConfigPath
    format: Literal["nanodet", "yolov8", "yolo11", "yolov5"] = "yolov8"
    labels: ConfigPath | None = None
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
    profiles: list[dict[str, ProfileShapes]] | None = Field(None, max_length=32)
    # Frames older than this when the scheduler takes them are dropped unprocessed and counted per camera
    # (telemetry `dropped_stale`); 0 never drops. A frame waiting in a camera's slot is its newest, so
    # this catches stalls (a camera or the pipeline), not steady overload.
    max_age_ms: float = Field(500.0, ge=0, le=3_600_000, description="at most an hour")
    # gpu: letterbox + normalise with a CUDA kernel straight into the engine's input (needs cuda-python
    # and a backend that takes device input: TensorRT; while ONNX Runtime serves, the CPU does it).
    preprocess: Literal["cpu", "gpu"] = "cpu"
    # graph: decode + score threshold + NMS grafted onto the ONNX before anything is built or served
    # (pipelines.models.graft), so the engine returns detections (a few KB per frame) instead of raw heads;
    # the grafted part stays FP32 whatever the precision (engines.islands).
    # A prebuilt engine: the manifest `<key>.json` of a store (e.g. `edge-agent build --out DIR`: DIR/<model>/
    # <key>.json, its plan beside it). Imported into engine_dir at start, then checked as any engine is: a
    # plan that does not fit this device or these settings is refused with the reasons and rebuilt.
    engine_file: ConfigPath | None = None
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
# [x, y]: YAML gives a list, strict mode would only take a tuple; the numbers stay strict (not "0.5").
Point = Annotated[tuple[float, float], Strict(False)]


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


# ---- camera sources ----
# Schemes a camera `url` may have besides file://: the FFmpeg network protocols that carry video.
STREAM_SCHEMES = ("rtsp", "rtsps", "http", "https", "rtmp", "rtmps", "srt", "udp", "rtp", "tcp")
_HOSTLESS = ("udp", "rtp", "srt", "tcp")  # udp://@:5000, srt://:9000?mode=listener: a port, maybe no host
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# A known scheme with its '://' mistyped: 'rtsp//10.0.0.5/s', 'rtsp:/10.0.0.5/s', 'http:cam/x'.
_SCHEME_TYPO = re.compile(r"(rtsps?|https?|rtmps?|srt|udp|rtp|tcp|file)(?::(?!//)|//)", re.IGNORECASE)
MAX_DEVICE_INDEX = 1023


def _is_device(url: str) -> bool:
    return (url.isascii() and url.isdigit()) or url.startswith("/dev/video")


def camera_file(url: str) -> str | None:
    """The local file that a camera `url` names (a file path or a file:// URL), else None (a network stream
    or a V4L2 device), as pipelines.sources.resolve tells them apart."""
    if not url or _is_device(url):
        return None
    head, sep, _ = url.partition("://")
    if sep:
        return unquote(urlsplit(url).path) if head.lower() == "file" else None
    return url


def camera_url_problem(url: str) -> str | None:
    """Why `url` cannot be a camera source, or None. The message never quotes the URL (credentials)."""
    if not url.strip():
        return "must not be empty"
    if url != url.strip():
        return "must not start or end with spaces"
    if _is_device(url):
        if url.isdigit() and (len(url) > 4 or int(url) > MAX_DEVICE_INDEX):
            return f"a V4L2 device index is 0..{MAX_DEVICE_INDEX}"
        return None
    head, sep, _ = url.partition("://")
    if not sep:
        typo = _SCHEME_TYPO.match(url)
        if typo is not None:
            scheme = typo.group(1).lower()
            if scheme == "file":
                return "looks like a URL without '://' (write file:///absolute/path, or the path itself)"
            return f"looks like a URL without '://' (write {scheme}://host/path)"
        return None  # a file path: the preflight checks that it exists
    if not _SCHEME.fullmatch(head):
        return "is neither a file path nor a URL that starts with a scheme (rtsp://host/path)"
    scheme = head.lower()
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            return "a file URL must be file:///absolute/path (or give the path itself)"
        return None
    if scheme not in STREAM_SCHEMES:
        return f"unknown scheme '{scheme}' (known: {', '.join(STREAM_SCHEMES)}, file; or a file path)"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "must not contain spaces or control characters (percent-encode them, e.g. %20)"
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a bad port or IPv6 literal; not quoted (the text may hold the password)
        return (
            "has an invalid host or port (1..65535); a user name or password with '/', '?', '#' or '@'"
            " must be percent-encoded"
        )
    if port is not None and not 1 <= port <= 65535:
        return "port must be 1..65535"
    if host:
        problem = _host_problem(host)
        if problem is not None:
            return f"host {problem}"
    elif scheme not in _HOSTLESS:
        return f"has no host (write {scheme}://host[:port]/path)"
    elif port is None:
        return f"needs a port ({scheme}://[host]:port)"
    return None


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

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        problem = None if v is None else camera_url_problem(v)
        if problem is not None:
            raise ValueError(problem)
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


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


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
    if len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    # The value is not echoed: 'user:password@host' is a plausible mistake.
    return "must be a host name or an IP address, without scheme, port, path or credentials"


class MqttTlsConfig(_Strict):
    """`mqtt.tls` as a mapping (`tls: true` is `tls: {}`); paths resolve against the config's folder."""

    ca_file: ConfigPath | None = Field(
        None, description="PEM CA certificate(s) trusted, not the system store"
    )
    cert_file: ConfigPath | None = Field(
        None, description="PEM client certificate (require_certificate brokers)"
    )
    key_file: ConfigPath | None = Field(None, description="the client certificate's unencrypted PEM key")
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
    password: Secret | None = None
    password_file: ConfigPath | None = None
    qos: int = Field(0, ge=0, le=2)
    prefix: str = "edge-agent"
    # 65535: the MQTT keep-alive field is 16 bits (paho's thread died packing a larger one).
    keepalive: int = Field(30, ge=5, le=65535)
    # Messages kept while the broker is away (the oldest go first). At most a million: each is a topic and a
    # JSON body in this process's memory (a few hundred bytes to a few KB; snapshots are never queued).
    offline_queue: int = Field(1000, ge=1, le=1_000_000, description="1..1000000 messages kept offline")
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
        problem = topic_prefix_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("username")
    @classmethod
    def _username(cls, v: str | None) -> str | None:
        if v is not None and len(v.encode("utf-8", "surrogatepass")) > 65535:
            raise ValueError("at most 65535 bytes (an MQTT string)")
        return v

    @field_validator("password")
    @classmethod
    def _password(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value().encode("utf-8", "surrogatepass")) > 65535:
            raise ValueError("at most 65535 bytes (an MQTT string)")
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
        if isinstance(v, _EnvText) and v.strip().lower() in _BOOL_WORDS:  # tls: ${MQTT_TLS}
            v = _BOOL_WORDS[v.strip().lower()]
        if isinstance(v, bool):
            return {} if v else None
        raise ValueError("must be true, false or a mapping of ca_file, cert_file, key_file, insecure")

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
        problem = file_problem(path)
        if problem is not None and problem.startswith(("is ", "not ")):  # a directory, a FIFO (would block)
            raise ConfigError(f"mqtt.password_file: {path}: {problem}")
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
        problem = topic_prefix_problem(v)
        if problem is not None:
            raise ValueError(problem)
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
    engine_dir: ConfigPath = Path("/var/lib/edge-agent/engines")
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
        # Every problem, one line each (they carry their own key path; _format_errors splits them).
        problems: list[str] = []
        if not self.models:
            problems.append("models: at least one model is required")
        for kind, names in (("models", self.models), ("cameras", self.cameras)):
            for name in names:
                problem = _level_problem(name)
                if problem is not None:
                    problems.append(f"{kind}.{_show(name)}: name {problem}")
        for model_name, model in self.models.items():
            problems += _dla_problems(model_name, model)
        for cam_name, cam in self.cameras.items():
            if cam.model not in self.models:
                known = ", ".join(sorted(self.models))
                problems.append(
                    f"cameras.{cam_name}.model: unknown model '{_show(cam.model)}' (known: {known})"
                )
            problems += _analytics_problems(cam_name, cam)
            shards = self.pipeline.shards
            if cam.shard is not None and isinstance(shards, int) and cam.shard >= shards:
                problems.append(
                    f"cameras.{cam_name}.shard: {cam.shard} is not a shard (pipeline.shards is {shards}:"
                    f" 0..{shards - 1})"
                )
            m = self.models.get(cam.model)
            if m is not None and m.postprocess == "graph" and cam.min_score < m.graph_score_threshold:
                problems.append(
                    f"cameras.{cam_name}.min_score: {cam.min_score:g} is below models.{cam.model}."
                    f"graph_score_threshold {m.graph_score_threshold:g} (postprocess: graph drops lower"
                    " scores inside the model)"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _analytics_problems(name: str, cam: CameraConfig) -> list[str]:
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
            rkey = f"{key}.{what}.{_show(region)}"
            problem = _level_problem(region)
            if problem is not None:
                problems.append(f"{rkey}: name {problem}")
            pts = rc.polygon if isinstance(rc, ZoneConfig) else rc.points
            field = "polygon" if isinstance(rc, ZoneConfig) else "points"
            if rc.units == "normalized":
                problem = _normalised_problem(pts)
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


def _dla_problems(name: str, m: ModelConfig) -> list[str]:
    """What a DLA cannot run, refused at load naming the key (NVIDIA's DLA docs: FP16 and INT8 only,
    static shapes only, TensorRT on Jetson/Drive only); the builder refuses the same for other callers."""
    core = m.engine.dla_core
    if core is None:
        return []
    key = f"models.{name}.engine.dla_core"
    problems: list[str] = []
    if m.backend in ("onnxruntime", "tensorrt_rtx"):
        problems.append(f"{key}: DLA needs backend tensorrt or auto (TensorRT on a Jetson), not {m.backend}")
    if m.precision == "fp32":
        problems.append(
            f"{key}: DLA runs FP16 and INT8 only; precision fp32 cannot use it (fp16, int8 or best)"
        )
    if not m.batch.min == m.batch.opt == m.batch.max:
        problems.append(
            f"{key}: DLA needs static shapes, but models.{name}.batch ranges {m.batch.min}..{m.batch.max} "
            "(set min = opt = max)"
        )
    for i, profile in enumerate(m.profiles or []):
        for tensor, shapes in profile.items():
            if not shapes.min == shapes.opt == shapes.max:
                problems.append(
                    f"{key}: DLA needs static shapes, but models.{name}.profiles[{i}].{tensor} has "
                    "min/opt/max that differ"
                )
    return problems


# ---- loading -------------------------------------------------------------------------------


MAX_CONFIG_BYTES = 1 << 20
MAX_NODES = 100_000  # YAML aliases can make a small file expand exponentially ("billion laughs")
MAX_DEPTH = 32
MAX_LINES = 50  # problems shown of one file; then "... and N more"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _show(text: str, limit: int = 200) -> str:
    """Text as it may be printed: control characters escaped (a key can hold anything), cut short."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "must not contain a NUL character"
    if _SURROGATE.search(text):
        return "is not valid Unicode text (a lone surrogate)"
    return None


def _expand_env(
    data: Any, source: str, env: dict[str, str], problems: list[str], failed: list[tuple[Any, ...]]
) -> Any:
    """`data` with ${VAR} and ${VAR:-default} replaced in every string. A problem (an unset variable, a
    string no program can take) is added to `problems` and its key path to `failed`; the file as a whole
    (too many values, nested too deeply) raises."""
    budget = [MAX_NODES]

    def walk(node: Any, loc: tuple[Any, ...], path: str) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(f"{source}: too many values (over {MAX_NODES}; YAML aliases expanding?)")
        if len(loc) > MAX_DEPTH:
            raise ConfigError(f"{source}: {_show(path, 80)}: nested too deeply")
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                key_path = f"{path}.{k}" if path else str(k)
                problem = _text_problem(k) if isinstance(k, str) else None
                if problem is not None:
                    problems.append(f"{source}: {_show(key_path)}: the key {problem}")
                    failed.append((*loc, k))
                out[k] = walk(v, (*loc, k), key_path)
            return out
        if isinstance(node, list):
            return [walk(v, (*loc, i), f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, str):
            return node
        text: str = node
        if "${" in node:
            missing: list[str] = []

            def sub(m: re.Match[str]) -> str:
                name, default = m.group(1), m.group(2)
                if name in env:
                    return env[name]
                if default is not None:
                    return default
                missing.append(name)
                return m.group(0)

            text = _ENV.sub(sub, node)
            for name in dict.fromkeys(missing):
                problems.append(f"{source}: {_show(path)}: environment variable {name} is not set")
            if missing:
                failed.append(loc)
                return node
            if text != node:
                text = _EnvText(text)
        problem = _text_problem(text)
        if problem is not None:
            problems.append(f"{source}: {_show(path)}: {problem}")
            failed.append(loc)
        return text

    return walk(data, (), "")


def _num(v: Any) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:g}"
    return str(v)


def _kind(v: Any) -> str:
    """What a wrong value is, in YAML's words; never the value itself (it may be a secret)."""
    if v is None:
        return "empty (null)"
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return "a list"
    return type(v).__name__


def _number_text(v: str) -> bool:
    try:
        return len(v) <= 64 and math.isfinite(float(v))
    except ValueError:
        return False


def _wrong(what: str, e: Any) -> str:
    """'must be <what>', and what the value is where that helps: a quoted number or boolean is a string
    (strict types), a list is not a number. Numbers may be shown, strings never are."""
    v = e.get("input")
    if isinstance(v, str):
        text = v.strip()
        quoted = (what in ("a number", "an integer") and _number_text(text)) or (
            what == "true or false" and text.lower() in (*_BOOL_WORDS, "y", "n", "1", "0")
        )
        if quoted:
            return f"must be {what}, not a string (write it without quotes)"
        return (
            f"must be {what}"
            if what in ("a number", "an integer", "true or false")
            else f"must be {what}, not a string"
        )
    if what == "an integer" and isinstance(v, float):
        return f"must be an integer, got {v:g}"
    kind = _kind(v)
    if kind == "a number" and what in ("a number", "an integer"):
        return f"must be {what}"
    return f"must be {what}, not {kind}"


def _finite(e: Any) -> str:
    v = e.get("input")
    if isinstance(v, float) and math.isnan(v):
        return "must be a finite number, not NaN"
    return "must be a finite number, not infinity"


_MESSAGES = {
    "extra_forbidden": lambda e: "unknown key",
    "missing": lambda e: "required key is missing",
    "greater_than": lambda e: f"must be > {_num(e['ctx']['gt'])}",
    "greater_than_equal": lambda e: f"must be >= {_num(e['ctx']['ge'])}",
    "less_than": lambda e: f"must be < {_num(e['ctx']['lt'])}",
    "less_than_equal": lambda e: f"must be <= {_num(e['ctx']['le'])}",
    "literal_error": lambda e: f"must be one of {e['ctx']['expected']}",
    "int_parsing": lambda e: "must be an integer",
    "int_type": lambda e: _wrong("an integer", e),
    "int_from_float": lambda e: "must be an integer",
    "float_parsing": lambda e: "must be a number",
    "float_type": lambda e: _wrong("a number", e),
    "finite_number": _finite,
    "bool_parsing": lambda e: "must be true or false",
    "bool_type": lambda e: _wrong("true or false", e),
    "string_type": lambda e: _wrong("a string", e),
    "path_type": lambda e: _wrong("a path (a string)", e),
    "dict_type": lambda e: _wrong("a mapping", e),
    "model_type": lambda e: _wrong("a mapping", e),
    "model_attributes_type": lambda e: _wrong("a mapping", e),
    "list_type": lambda e: _wrong("a list", e),
    "tuple_type": lambda e: _wrong("a list", e),
    "string_pattern_mismatch": lambda e: f"must match {e['ctx']['pattern']}",
    "too_long": lambda e: f"at most {e['ctx']['max_length']} entries",
    "too_short": lambda e: f"at least {e['ctx']['min_length']} entries",
}
# Lines of AgentConfig._cross carry their own key path.
_OWN_KEY = re.compile(r"(models|cameras)[.:]")


def _joined(lines: list[str], source: str) -> str:
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"{source}: ... and {len(lines) - MAX_LINES} more"]
    return "\n".join(_show(line, 1000) for line in lines)


def _format_errors(
    exc: ValidationError, source: str, failed: list[tuple[Any, ...]] | None = None
) -> list[str]:
    """One line per problem, `FILE: key.path: message`. Errors under a key in `failed` are left out: that
    value already has its line (an unset ${VAR}) and the schema only saw its text."""
    lines = []
    for err in exc.errors(include_url=False, include_input=True):
        loc = tuple(err["loc"])
        if any(loc[: len(f)] == f for f in failed or ()):
            continue
        where = _show(".".join(str(p) for p in loc))
        fmt = _MESSAGES.get(err["type"])
        msg = fmt(err) if fmt is not None else str(err["msg"]).removeprefix("Value error, ")
        for line in msg.splitlines():
            if not where and _OWN_KEY.match(line):
                lines.append(f"{source}: {line}")
            elif line.startswith(("models.", "cameras.")) and ":" in line:
                lines.append(f"{source}: {line}")  # cross-field errors carry their own key path
            else:
                lines.append(f"{source}: {where}: {line}" if where else f"{source}: {line}")
    return lines


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None, env: dict[str, str] | None = None
) -> AgentConfig:
    """Validate a mapping (as loaded from YAML). Relative paths resolve against base_dir."""
    return _parse(data, source, base_dir, dict(os.environ) if env is None else env, [])


def _parse(
    data: Any, source: str, base_dir: Path | None, env: dict[str, str], problems: list[str]
) -> AgentConfig:
    """As parse_config; `problems`: lines found before (duplicate keys), reported with the schema's."""
    if not isinstance(data, dict):
        raise ConfigError(_joined([*problems, f"{source}: the top level must be a mapping"], source))
    failed: list[tuple[Any, ...]] = []
    try:
        data = _expand_env(data, source, env, problems, failed)
    except ConfigError as exc:
        raise ConfigError(_joined([*problems, str(exc)], source)) from None
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_joined([*problems, *_format_errors(exc, source, failed)], source)) from None
    if problems:
        raise ConfigError(_joined(problems, source))
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    problems = [f"{source}: {p}" for p in _mqtt_file_problems(cfg)]
    if problems:
        raise ConfigError(_joined(problems, source))
    return cfg


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file, or None: 'no such file', 'is a directory, not a file', ... (a
    FIFO or a device is refused before anything opens it: reading one could block or never end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except NotADirectoryError:
        return "no such file (a folder on its way is a file)"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    except ValueError:
        return "not a valid path"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    return None


def _mqtt_file_problems(cfg: AgentConfig) -> list[str]:
    """Password and TLS files must be usable at load: --check-config and a reload catch them, not the
    connection attempt later. Lines name the key and the path, never what a file holds."""
    mqtt = cfg.mqtt
    if not mqtt.enabled:
        return []
    problems = []
    try:
        mqtt.read_password()
    except ConfigError as exc:
        problems.append(str(exc))
    if mqtt.tls is not None:
        unusable = False
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(mqtt.tls, key)
            # A FIFO or a device would block the reading below; the rest is told by client_context.
            if path is not None and file_problem(path) == "is not a regular file":
                problems.append(f"mqtt.tls.{key}: {path}: is not a regular file")
                unusable = True
        if not unusable:
            try:
                client_context(mqtt.tls.options())
            except TlsFileError as exc:
                problems.append(f"mqtt.tls.{exc}")
    return problems


def _resolve_paths(cfg: AgentConfig, base: Path) -> AgentConfig:
    """Every relative path against the config file's folder (base), a camera's file `url` included."""

    def rel(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p)

    models = {
        name: m.model_copy(
            update={
                "onnx": rel(m.onnx),
                "labels": rel(m.labels),
                "calibration": m.calibration.model_copy(update={"folder": rel(m.calibration.folder)}),
                "engine_file": rel(m.engine_file),
            }
        )
        for name, m in cfg.models.items()
    }
    cameras = {}
    for name, cam in cfg.cameras.items():
        local = camera_file(cam.url) if cam.url is not None else None
        if local is not None and cam.url == local and not Path(local).is_absolute():
            cam = cam.model_copy(update={"url": str(base / local)})
        cameras[name] = cam
    update: dict[str, Any] = {"models": models, "cameras": cameras, "engine_dir": rel(cfg.engine_dir)}
    mqtt_update: dict[str, Any] = {"password_file": rel(cfg.mqtt.password_file)}
    if cfg.mqtt.tls is not None:
        tls = cfg.mqtt.tls
        files = {key: rel(getattr(tls, key)) for key in ("ca_file", "cert_file", "key_file")}
        mqtt_update["tls"] = tls.model_copy(update=files)
    update["mqtt"] = cfg.mqtt.model_copy(update=mqtt_update)
    return cfg.model_copy(update=update)


_MERGE = "tag:yaml.org,2002:merge"
# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: no dot or no exponent sign (1e5, 2.5e-3, 1.5E3).
# With strict types a string is not a number: `offline_queue: 1e5` would be refused as text.
_FLOAT_12 = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+")


class _Loader(yaml.SafeLoader):
    """SafeLoader that finds duplicate keys (YAML forbids them; PyYAML silently keeps the last one) and
    reads YAML 1.2 exponent floats as numbers."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, str, list[int]]] = []  # (first line, key path, lines)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self._find_duplicates(node)
        return self.construct_document(node)

    def _key(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return None  # a list or a mapping as a key: the constructor refuses it
        try:
            key = self.construct_object(node)
            hash(key)
        except Exception:  # a value its tag's constructor refuses (!!int x): construct_document says so
            return ("unreadable", node.tag, node.value)
        return key

    def _find_duplicates(self, root: yaml.Node) -> None:
        # Iterative, and each node once: aliases may share one node many times (see MAX_NODES).
        seen: set[int] = set()
        todo: list[tuple[yaml.Node, str]] = [(root, "")]
        while todo:
            node, path = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                todo += [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
            elif isinstance(node, yaml.MappingNode):
                lines: dict[Any, list[int]] = {}
                names: dict[Any, str] = {}
                for key_node, value_node in node.value:
                    if key_node.tag == _MERGE:  # '<<: *base': keys written here override the merged ones
                        todo.append((value_node, path))
                        continue
                    key = self._key(key_node)
                    name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                    todo.append((value_node, f"{path}.{name}" if path else name))
                    if key is not None:
                        lines.setdefault(key, []).append(key_node.start_mark.line + 1)
                        names.setdefault(key, name)
                for key, where in lines.items():
                    if len(where) > 1:
                        name = names[key]
                        self.duplicates.append((where[0], f"{path}.{name}" if path else name, where))


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def _lines(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"


def load_config(path: str | Path, env: dict[str, str] | None = None) -> AgentConfig:
    path = Path(path)
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: cannot read config: is a directory, not a file")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: config larger than {MAX_CONFIG_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:  # a pipe (-c <(...)) has no size to stat
        raise ConfigError(f"{path}: config larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from None
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # the reader refuses control characters here
        data = loader.get_single_data()
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        why = (
            f"character #x{exc.character:04x} is not allowed"
            if isinstance(exc.character, int)
            else exc.reason
        )
        raise ConfigError(f"{path}: invalid YAML (line {line}): {why}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {_show(str(why))}") from None
    except (ValueError, OverflowError, TypeError, AttributeError, KeyError, IndexError) as exc:
        # A value PyYAML's constructors refuse without a YAMLError: 2024-13-45, 10**5000, !!timestamp x.
        digits = isinstance(exc, ValueError) and "digits" in str(exc)
        why = "an integer of more than 4300 digits" if digits else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, AttributeError):  # PyYAML's !!timestamp on a value that is not one
            why = "a value does not fit its !!tag"
        raise ConfigError(f"{path}: invalid YAML: a value cannot be read ({why})"[:300]) from None
    finally:
        if loader is not None:
            loader.dispose()
    duplicates = [
        f"{path}: {_show(key)}: duplicate key on lines {_lines(lines)} (YAML keeps only the last)"
        for _, key, lines in sorted(loader.duplicates)
    ]
    env = dict(os.environ) if env is None else env
    return _parse(data, str(path), path.resolve().parent, env, duplicates)
