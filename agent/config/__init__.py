"""YAML configuration: schema, ${VAR} expansion, errors that name the file and the key path.

Secrets (camera URLs with passwords, MQTT passwords) are kept out of every repr: camera URLs are
excluded from the model repr and shown through `mask_url`, the MQTT password is a SecretStr.

load (entry points) -> yaml_loader (strict YAML), env (${VAR}), schema (AgentConfig) -> model, camera
(sources, analytics), mqtt, pipeline; messages turns schema errors into `FILE: key.path: message` lines.
"""

from agent.config.analytics import (
    Anchor,
    EventsConfig,
    EventSnapshotConfig,
    FrameSize,
    LineConfig,
    Point,
    PublishConfig,
    TrackingConfig,
    ZoneConfig,
)
from agent.config.camera import CameraConfig, SnapshotConfig
from agent.config.deploy import DeployConfig
from agent.config.env import MAX_DEPTH, MAX_NODES
from agent.config.errors import ConfigError
from agent.config.files import file_problem
from agent.config.load import MAX_CONFIG_BYTES, load_config, parse_config
from agent.config.messages import MAX_LINES
from agent.config.model import (
    MAX_DIM,
    AccuracyGateConfig,
    BatchConfig,
    CalibrationConfig,
    EngineConfig,
    ModelConfig,
    ProfileShapes,
    ThreadsConfig,
)
from agent.config.mqtt import MqttConfig, MqttTlsConfig
from agent.config.names import MAX_NAME, MAX_PREFIX_BYTES, name_problem, topic_prefix_problem
from agent.config.pipeline import PipelineConfig, RestartConfig
from agent.config.schema import AgentConfig, HomeAssistantConfig, TelemetryConfig
from agent.config.sources import MAX_DEVICE_INDEX, STREAM_SCHEMES, camera_file, camera_url_problem
from agent.config.strict import ConfigPath, Secret

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_DEVICE_INDEX",
    "MAX_DIM",
    "MAX_LINES",
    "MAX_NAME",
    "MAX_NODES",
    "MAX_PREFIX_BYTES",
    "STREAM_SCHEMES",
    "AccuracyGateConfig",
    "AgentConfig",
    "Anchor",
    "BatchConfig",
    "CalibrationConfig",
    "CameraConfig",
    "ConfigError",
    "ConfigPath",
    "DeployConfig",
    "EngineConfig",
    "EventSnapshotConfig",
    "EventsConfig",
    "FrameSize",
    "HomeAssistantConfig",
    "LineConfig",
    "ModelConfig",
    "MqttConfig",
    "MqttTlsConfig",
    "PipelineConfig",
    "Point",
    "ProfileShapes",
    "PublishConfig",
    "RestartConfig",
    "Secret",
    "SnapshotConfig",
    "TelemetryConfig",
    "ThreadsConfig",
    "TrackingConfig",
    "ZoneConfig",
    "camera_file",
    "camera_url_problem",
    "file_problem",
    "load_config",
    "name_problem",
    "parse_config",
    "topic_prefix_problem",
]
