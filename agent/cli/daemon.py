"""The daemon that `run` and `demo` serve: a device (agent.device: the MQTT identity, main loop, reloads)
over its runtime, the pipeline in this process (agent.runtime.local) or pipeline shards
(agent.shards.sharded) when the placement has more than one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import AgentConfig
from agent.device import Device
from agent.memtrace import install_from_env
from agent.runtime.local import LocalRuntime
from agent.service.notify import Notifier
from agent.shards.placement import ShardPlan

if TYPE_CHECKING:
    from agent.shards.sharded import ShardedRuntime


def local_device(
    cfg: AgentConfig,
    *,
    console: bool | None = None,
    quiet_mqtt: bool = False,
    config_path: str | Path | None = None,
    notifier: Notifier | None = None,
) -> Device[LocalRuntime]:
    """A device running its pipeline in this process (`console`: the config's when None)."""
    install_from_env()  # EDGE_AGENT_TRACEMALLOC (tools/memtrace.py); nothing when unset
    notifier = notifier or Notifier()
    runtime = LocalRuntime(cfg, console=console, notifier=notifier)
    return Device(cfg, runtime, config_path=config_path, notifier=notifier, quiet_mqtt=quiet_mqtt)


def sharded_device(
    cfg: AgentConfig,
    plan: ShardPlan,
    *,
    level: str = "info",
    config_path: str | Path | None = None,
    notifier: Notifier | None = None,
) -> Device[ShardedRuntime]:
    """A device supervising pipeline shards placed by `plan`."""
    install_from_env()
    from agent.shards.sharded import ShardedRuntime

    notifier = notifier or Notifier()
    runtime = ShardedRuntime(cfg, level=level, plan=plan, notifier=notifier)
    return Device(cfg, runtime, config_path=config_path, notifier=notifier)
