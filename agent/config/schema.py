"""AgentConfig, the whole file: its small sections and the checks across them (each line names its key)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.camera import CameraConfig, analytics_problems
from agent.config.defaults import CameraDefaults
from agent.config.deploy import DeployConfig
from agent.config.engines import EnginesConfig
from agent.config.errors import show
from agent.config.impact import Impact
from agent.config.model import ModelConfig, dla_problems
from agent.config.mqtt import MqttConfig
from agent.config.names import level_problem, name_problem, topic_prefix_problem
from agent.config.pipeline import PipelineConfig
from agent.config.strict import ConfigPath, StrictModel, raise_problem


class TelemetryConfig(StrictModel):
    interval_s: Annotated[float, Impact.LIVE] = Field(10.0, ge=0.1, le=86400)
    prometheus_port: Annotated[int | None, Impact.AGENT] = Field(None, ge=1, le=65535)


class HomeAssistantConfig(StrictModel):
    """Home Assistant MQTT discovery (agent.homeassistant): retained entity configs under its prefix."""

    enabled: bool = False
    discovery_prefix: str = "homeassistant"  # HA's default; must match HA's MQTT discovery prefix
    # Object-count sensors for cameras without `classes` (a camera's own `classes` are counted instead).
    # (noqa: pydantic copies a field's default; ruff cannot tell StrictModel is pydantic across modules.)
    count_labels: list[str] = ["person", "car"]  # noqa: RUF012

    @field_validator("discovery_prefix")
    @classmethod
    def _discovery_prefix(cls, v: str) -> str:
        raise_problem(topic_prefix_problem(v))
        return v

    @field_validator("count_labels")
    @classmethod
    def _count_labels(cls, v: list[str]) -> list[str]:
        if any(not label for label in v):
            raise ValueError("labels must be non-empty")
        return v


class AgentConfig(StrictModel):
    # Each key says what a reload that changes it needs (agent.config.impact); a section's keys inherit it.
    device_id: Annotated[str, Impact.CONNECTION] = Field(default_factory=socket.gethostname)  # in the topics
    engine_dir: Annotated[ConfigPath, Impact.AGENT] = Path("/var/lib/edge-agent/engines")
    models: Annotated[dict[str, ModelConfig], Impact.MODEL]
    cameras: dict[str, CameraConfig]  # added and removed by agent.config.reload; each key declares its own
    # Merged into every camera at load (agent.config.defaults); kept here as written, checked key by key
    # (its keys declare the camera's classes); agent.config.reload plans the merged cameras, not this.
    camera_defaults: CameraDefaults = CameraDefaults()  # type: ignore[valid-type]
    mqtt: Annotated[MqttConfig, Impact.CONNECTION] = MqttConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    # Discovery is published again after every reload (entities of what went are deleted).
    homeassistant: Annotated[HomeAssistantConfig, Impact.LIVE] = HomeAssistantConfig()
    console: Annotated[bool, Impact.LIVE] = False
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Impact.LIVE] = "info"
    # The number of processes and their GPUs: fixed while running.
    pipeline: Annotated[PipelineConfig, Impact.AGENT] = PipelineConfig()
    # Model deployments (agent.deploy); each key declares its own class (agent.config.deploy).
    deploy: DeployConfig = DeployConfig()
    # The fleet's shared engine cache (agent.config.engines); each key declares its own class.
    engines: EnginesConfig = EnginesConfig()

    @field_validator("device_id")
    @classmethod
    def _device(cls, v: str) -> str:
        raise_problem(name_problem(v))
        return v

    @model_validator(mode="after")
    def _cross(self) -> AgentConfig:
        # Every problem, one line each (they carry their own key path; format_errors splits them).
        problems: list[str] = []
        if not self.models:
            problems.append("models: at least one model is required")
        for kind, names in (("models", self.models), ("cameras", self.cameras)):
            for name in names:
                problem = level_problem(name)
                if problem is not None:
                    hint = "; any other text goes in its display `name:`" if kind == "cameras" else ""
                    problems.append(f"{kind}.{show(name)}: name {problem} (the name is a topic level{hint})")
        for model_name, model in self.models.items():
            problems += dla_problems(model_name, model)
        for cam_name, cam in self.cameras.items():
            if cam.model not in self.models:
                known = ", ".join(sorted(self.models))
                problems.append(
                    f"cameras.{cam_name}.model: unknown model '{show(cam.model)}' (known: {known})"
                )
            problems += analytics_problems(cam_name, cam)
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
