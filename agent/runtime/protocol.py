"""What a device (agent.device.Device: the MQTT identity) and its runtime (the pipeline in this process,
agent.runtime.local, or pipeline shards, agent.shards.sharded) say to each other.

The device gives its runtime an `Outlet` (itself, or in a shard process the pipe to the supervisor); the
runtime reads the outlet's MQTT client at each publish, never keeping it (a reload may replace it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from agent.config import AgentConfig
from agent.config.reload import ReloadPlan
from agent.deploy.host import DeployHost
from agent.mqtt import MqttClient
from agent.mqtt.topics import Topics
from agent.runtime.reports import CameraState
from agent.service.supervisor import Progress
from engines.precision import Precision

Mirror = Callable[[str, bytes, bool], None]  # (topic, body, retained): a copy of a published event


def device_topics(cfg: AgentConfig) -> Topics:
    """The device's topics under `cfg` (the one place they are made: device, shard processes)."""
    return Topics(cfg.mqtt.prefix, cfg.device_id)


class Outlet(Protocol):
    """Where a runtime's news go: the MQTT client in use now, camera and engine states."""

    @property
    def mqtt(self) -> MqttClient | None: ...

    @property
    def topics(self) -> Topics: ...

    @property
    def mirror(self) -> Mirror | None:
        """A copy of every camera event and zone/line state published (a shard's: to its supervisor)."""
        ...

    def camera_changed(self, camera: str, state: CameraState) -> None:
        """A camera's state was published (a shard's: its supervisor keeps it)."""

    def status_changed(self) -> None:
        """The device status is due again (a camera came up or went down)."""

    def engine_state(self, model: str, fields: dict[str, Any]) -> None: ...


class Prepared(Protocol):
    """A reload the runtime checked and prepared (nothing in effect yet): commit it or roll it back."""

    def commit(self, switch: Callable[[], None]) -> str:
        """Apply it; `switch()` (the device's new MQTT client and config) runs once the leaving parts
        are closed and before the new ones start. What changed (a summary line); raises RuntimeError when
        it applied only in part."""
        ...

    def rollback(self) -> None: ...


class Runtime(Protocol):
    """The pipelines a device runs (see the module docstring)."""

    def attach(self, outlet: Outlet) -> None: ...

    def open(self) -> None:
        """Load (or check) models and open cameras: a failure is a start-up error."""

    def start(self) -> None:
        """Start what open() made (after the device's MQTT client started)."""

    def stop(self) -> None: ...

    def camera_states(self) -> list[str]: ...

    def cameras_total(self) -> int: ...

    def status_fields(self) -> dict[str, Any]:
        """The runtime's own fields of the status payload (a sharded one: `shards`)."""
        ...

    def status_note(self) -> str:
        """What STATUS= says of the runtime (empty: nothing to say)."""
        ...

    def progress(self) -> Progress: ...

    def telemetry_fields(self, mqtt: Mapping[str, Any] | None) -> dict[str, Any]: ...

    def after_telemetry(self) -> None:
        """Once per telemetry interval, after the payload: the retained camera states again."""

    def republish(self) -> None:
        """After a new MQTT client started: the retained states it must carry again."""

    def stale_region(self, topic: str, topics: Topics) -> bool:
        """A retained zone or line state topic of this device that no camera publishes now (a zone removed
        while the agent was stopped); the runtime logs that it goes."""
        ...

    def snapshot(self, camera: str) -> dict[str, Any]: ...

    def rebuild_targets(self) -> list[str]: ...

    def rebuild(self, model: str, force: bool, precision: Precision | None) -> bool: ...

    def prepare(self, new: AgentConfig, plan: ReloadPlan) -> Prepared:
        """Everything of a reload that can fail, while nothing has changed; raises when it cannot be."""
        ...

    def deploy_host(
        self,
        own: Callable[[], AgentConfig],
        publish: Callable[[str, bytes], None],
        lock: AbstractContextManager[Any],
    ) -> DeployHost | None:
        """Where deployments run on this runtime (agent.device_deploy), or None where it takes none."""
        ...
