"""YAML configuration: schema, ${VAR} expansion, errors that name the file and the key path.

Secrets (camera URLs with passwords, MQTT passwords) are kept out of every repr: camera URLs are
excluded from the model repr and shown through `mask_url`, the MQTT password is a SecretStr.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from engines.plan import Precision
from pipelines.urls import mask_url

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # safe inside an MQTT topic level


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    min: int = Field(1, ge=1)
    opt: int = Field(1, ge=1)
    max: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> BatchConfig:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"must satisfy min <= opt <= max (got {self.min}, {self.opt}, {self.max})")
        return self


class CalibrationConfig(_Strict):
    source: Literal["cameras", "folder"] = "cameras"
    folder: Path | None = None
    samples: int = Field(500, gt=0)
    # minmax by default: measured best on the bundled detector (README precision table).
    method: Literal["entropy", "minmax", "percentile"] = "minmax"
    # At most one frame per camera per interval, so the frames span minutes of scene change.
    interval_s: float = Field(1.0, gt=0)


class AccuracyGateConfig(_Strict):
    min_agreement: float = Field(0.9, ge=0.0, le=1.0)


class ThreadsConfig(_Strict):
    intra: int = Field(0, ge=0, description="ONNX Runtime intra-op threads (0 = its default)")
    inter: int = Field(0, ge=0)


class EngineConfig(_Strict):
    workspace_mb: int = Field(1024, gt=0, description="TensorRT builder workspace limit")
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
    format: Literal["nanodet", "yolov8", "yolo11", "yolov5", "efficient_nms"] = "yolov8"
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


class CameraConfig(_Strict):
    # repr=False: the URL may hold a password; use `display` for logs.
    url: str | None = Field(None, repr=False)
    pipeline: str | None = Field(None, repr=False, description="GStreamer pipeline ending in appsink")
    model: str
    fps: float | None = Field(None, gt=0)
    classes: list[str] | None = None
    min_score: float = Field(0.4, ge=0.0, le=1.0)
    loop: bool = True
    enabled: bool = True
    open_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> CameraConfig:
        if (self.url is None) == (self.pipeline is None):
            raise ValueError("give exactly one of 'url' or 'pipeline'")
        return self

    @property
    def display(self) -> str:
        return mask_url(self.url) if self.url is not None else "gstreamer pipeline"


class MqttConfig(_Strict):
    enabled: bool = True
    host: str = "localhost"
    port: int = Field(1883, ge=1, le=65535)
    tls: bool = False
    username: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    qos: int = Field(0, ge=0, le=2)
    prefix: str = "edge-agent"
    keepalive: int = Field(30, ge=5)
    offline_queue: int = Field(1000, ge=1)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or any(c in v for c in "+#") or v.startswith("/") or v.endswith("/"):
            raise ValueError("must be a topic prefix without '+', '#' or leading/trailing '/'")
        return v

    def read_password(self) -> str | None:
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is None:
            return None
        try:
            return self.password_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"mqtt.password_file: cannot read {self.password_file}: {exc.strerror}"
            ) from None


class TelemetryConfig(_Strict):
    interval_s: float = Field(10.0, gt=0)
    prometheus_port: int | None = Field(None, ge=1, le=65535)


class AgentConfig(_Strict):
    device_id: str = Field(default_factory=socket.gethostname)
    engine_dir: Path = Path("/var/lib/edge-agent/engines")
    models: dict[str, ModelConfig]
    cameras: dict[str, CameraConfig]
    mqtt: MqttConfig = MqttConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    console: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("device_id")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("may only hold letters, digits, '_', '-' and '.'")
        return v

    @model_validator(mode="after")
    def _cross(self) -> AgentConfig:
        if not self.models:
            raise ValueError("models: at least one model is required")
        for kind, names in (("models", self.models), ("cameras", self.cameras)):
            for name in names:
                if not _NAME.match(name):
                    raise ValueError(f"{kind}.{name}: name may only hold letters, digits, '_', '-' and '.'")
        for cam_name, cam in self.cameras.items():
            if cam.model not in self.models:
                known = ", ".join(sorted(self.models))
                raise ValueError(f"cameras.{cam_name}.model: unknown model '{cam.model}' (known: {known})")
        return self


# ---- loading -------------------------------------------------------------------------------


def _expand_env(node: Any, path: str, source: str, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _expand_env(v, f"{path}.{k}" if path else str(k), source, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v, f"{path}[{i}]", source, env) for i, v in enumerate(node)]
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
    "bool_parsing": lambda e: "must be true or false",
    "bool_type": lambda e: "must be true or false",
    "string_type": lambda e: "must be a string",
    "dict_type": lambda e: "must be a mapping",
    "model_type": lambda e: "must be a mapping",
    "list_type": lambda e: "must be a list",
    "string_pattern_mismatch": lambda e: f"must match {e['ctx']['pattern']}",
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
    return _resolve_paths(cfg, base_dir) if base_dir is not None else cfg


def _resolve_paths(cfg: AgentConfig, base: Path) -> AgentConfig:
    def rel(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p)

    models = {
        name: m.model_copy(update={"onnx": rel(m.onnx), "labels": rel(m.labels)})
        for name, m in cfg.models.items()
    }
    update: dict[str, Any] = {"models": models, "engine_dir": rel(cfg.engine_dir)}
    if cfg.mqtt.password_file is not None:
        update["mqtt"] = cfg.mqtt.model_copy(update={"password_file": rel(cfg.mqtt.password_file)})
    return cfg.model_copy(update=update)


def load_config(path: str | Path, env: dict[str, str] | None = None) -> AgentConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, str(path), path.resolve().parent, env)
