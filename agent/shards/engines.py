"""The engine lifecycle of a sharded device, run by the supervisor: checks, builds and the accuracy gate,
one EngineManager per GPU model the shards run on (one plan each, built on one GPU of that model, one
build at a time). The supervisor serves nothing: each shard's watcher loads the plan and swaps it in
between two batches. A model's engine state topic holds the supervisor's own state with what each shard
serves; frames for a build (gate, INT8) come from a running shard over its pipe (RemoteTap).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from agent import __version__
from agent.config import AgentConfig
from agent.config.reload import ReloadPlan
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.roles import SupervisorRole
from agent.mqtt import MqttClient
from agent.mqtt.topics import Topics, payload
from agent.shards.host import ShardHost
from agent.shards.placement import ShardPlan
from engines.cuda.gpu_probe import NVML, GpuInfo
from engines.precision import Precision


def _no_swap(_model: str, _backend: Any) -> None:
    """The supervisor serves nothing: each shard's watcher swaps the new plan in."""


def gpu_models(plan: ShardPlan, info: Callable[[int], GpuInfo | None] = NVML.info) -> dict[int, str | None]:
    """Shard -> the model of its GPU ("NVIDIA H100 80GB HBM3, sm 9.0"), None where the shard is not pinned
    to a GPU or NVML cannot say."""
    out: dict[int, str | None] = {}
    for k, gpu in enumerate(plan.gpus):
        gi = info(gpu) if gpu is not None else None
        out[k] = f"{gi.name}, sm {gi.compute_capability}" if gi is not None and gi.name else None
    return out


class ShardOwner(Protocol):
    """What the engine lifecycle reads of the supervisor, as it is now (a reload changes it)."""

    cfg: AgentConfig
    plan: ShardPlan
    hosts: list[ShardHost]

    @property
    def mqtt(self) -> MqttClient | None: ...

    @property
    def topics(self) -> Topics: ...


class ShardEngines:
    """The supervisor's EngineManagers by GPU model (``managers``; None: every shard's GPU is the same
    model) and the engine state each model's topic carries."""

    def __init__(self, owner: ShardOwner, cfg: AgentConfig) -> None:
        self._owner = owner
        self._own: dict[str, dict[str | None, dict[str, Any]]] = {}  # model -> GPU model -> state
        self._shards: dict[str, dict[int, dict[str, Any]]] = {}  # model -> shard -> what it serves
        self.gpu_model = gpu_models(owner.plan)
        self.managers = self._managers(cfg)
        self.primary = self.managers[self.group(0)]  # the first shard's GPU model: the state's own fields

    def _managers(self, cfg: AgentConfig) -> dict[str | None, EngineManager]:
        """One engine lifecycle per GPU model the shards run on; a single one where every shard's GPU is
        the same model."""
        first: dict[str, int] = {}
        for k, label in self.gpu_model.items():
            gpu = self._owner.plan.gpus[k]
            if label is not None and gpu is not None:
                first.setdefault(label, gpu)
        if len(first) < 2:
            return {
                None: EngineManager(
                    cfg, self.own_state, _no_swap, __version__, frames_for=self.tap, role=SupervisorRole()
                )
            }
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # probes count GPUs as NVML does
        gate = threading.Lock()
        return {
            label: EngineManager(
                cfg,
                functools.partial(self.own_state, group=label),
                _no_swap,
                __version__,
                frames_for=functools.partial(self.tap, group=label),
                role=SupervisorRole(gpu, gate),
            )
            for label, gpu in first.items()
        }

    def group(self, k: int) -> str | None:
        """The manager key of shard k: its GPU model where there are several, else None."""
        return self.gpu_model.get(k) if len(self.managers) > 1 else None

    def manager_of(self, k: int) -> EngineManager:
        return self.managers[self.group(k)]

    # ---- state ------------------------------------------------------------------------------------------
    def own_state(self, model: str, fields: dict[str, Any], group: str | None = None) -> None:
        """A manager's state of `model` (checks, builds), published with what each shard serves."""
        self._own.setdefault(model, {})[group] = dict(fields)
        self.publish(model)

    def shard_state(self, k: int, model: str, fields: dict[str, Any]) -> None:
        """What shard k serves for `model`, as it reported."""
        self._shards.setdefault(model, {})[k] = fields
        self.publish(model)

    def publish(self, model: str) -> None:
        """The supervisor's state of the model (checks, builds), with what each shard serves."""
        groups = self._own.get(model, {})
        own = groups.get(self.group(0))
        client = self._owner.mqtt
        if own is None or client is None:
            return
        shards = {
            str(k): {
                **{f: s.get(f) for f in ("state", "backend", "precision", "key", "loaded") if f in s},
                **self._origin(groups.get(self.group(k)), s),
            }
            for k, s in sorted(self._shards.get(model, {}).items())
        }
        extra: dict[str, Any] = {"shards": shards}
        if len(self.managers) > 1:  # GPUs of different models: each model's own plan and state
            keep = ("state", "backend", "precision", "key", "error", "progress")
            extra["gpu_models"] = {g: {f: v.get(f) for f in keep if f in v} for g, v in groups.items()}
        body = payload("engine", model=model, **{**own, **extra})
        client.publish(self._owner.topics.engine(model), body, qos=1, retain=True, kind="state")

    @staticmethod
    def _origin(own: dict[str, Any] | None, shard: dict[str, Any]) -> dict[str, Any]:
        """Where shard's engine came from: the supervisor's job said it (built | cache | store) for the key
        the shard serves; the shard itself only found that plan in the store the supervisor shares."""
        if own is not None and own.get("origin") and shard.get("key") == own.get("key"):
            return {"origin": own["origin"]}
        return {"origin": shard["origin"]} if shard.get("origin") else {}

    # ---- builds -----------------------------------------------------------------------------------------
    def rebuild(self, model: str, force: bool, precision: Precision | None) -> bool:
        # Every GPU model's lifecycle (evaluated for each: no short cut).
        return any([m.rebuild(model, force=force, precision=precision) for m in self.managers.values()])

    def tap(self, model: str, group: str | None = None) -> RemoteTap | None:
        """Frames for a build of `model` (gate, INT8): from the running shard with most of its cameras
        (of the GPU model the build is for, where there are several)."""
        owner = self._owner
        counts: dict[int, int] = {}
        for cam, k in owner.plan.cameras.items():
            if group is not None and self.gpu_model.get(k) != group:
                continue
            if owner.cfg.cameras[cam].model == model and owner.hosts[k].state == "running":
                counts[k] = counts.get(k, 0) + 1
        if not counts:
            return None
        k = max(counts, key=lambda i: (counts[i], -i))
        total = sum(1 for c in owner.plan.cameras if owner.cfg.cameras[c].model == model)
        return RemoteTap(owner.hosts[k], model, total / counts[k])

    # ---- reload and stop --------------------------------------------------------------------------------
    def apply(self, new: AgentConfig, plan: ReloadPlan) -> None:
        """A reload's models: retire the removed and changed ones, open the added and changed ones."""
        for manager in self.managers.values():
            for name in plan.models_removed + plan.models_changed:
                manager.retire(manager.detach(name))
            manager.reconfigure(new)
            for name in plan.models_added + plan.models_changed:
                manager.check(name, new)
            manager.start_pending()

    def republish(self) -> None:
        for manager in self.managers.values():
            manager.republish()


class RemoteTap:
    """FrameTap's frames() over a shard's pipe (agent.lifecycle.manager asks the supervisor's tap)."""

    def __init__(self, host: ShardHost, model: str, slower: float) -> None:
        self._host, self._model = host, model
        self._slower = max(1.0, slower)  # the manager's timeout counts every camera; the shard has fewer

    def frames(
        self, total: int, interval_s: float, timeout_s: float, stop: threading.Event | None = None
    ) -> Iterator[tuple[np.ndarray, str]]:
        yield from self._host.tap(self._model, total, interval_s, timeout_s * self._slower, stop)
