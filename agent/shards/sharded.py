"""The runtime of a device with pipeline shards (`pipeline.shards` > 1): ShardedRuntime.

It runs, under the device (agent.device: the MQTT status, LWT, command intake, Home Assistant discovery,
READY/STATUS/WATCHDOG, telemetry and Prometheus), what the shards share: the engine lifecycle (checks,
builds, the accuracy gate: one build, every shard's watcher loads the same plan and swaps between two
batches) and the shard processes. Each shard (agent.shards.child) runs a LocalRuntime over its cameras and
publishes their topics with its own MQTT client (client id `<id>-shard<k>`, no will), so a camera's
messages keep their order and the topic contract is the one of a single process.

Faults stay in their shard: a shard that dies is restarted with backoff (agent.shards.host) while its
cameras show `reconnecting`; the supervisor closes what it left open (agent.shards.tracks: `zone_leave`
and `end` for its tracks, its zone and line states at zero), and its restart numbers tracks afresh; a
shard that stops reporting for HUNG_S is killed and restarted; WATCHDOG=1 goes out only while every
running shard makes progress (a shard waiting for its restart is a camera problem, not a reason for
systemd to restart the service). Its lines keep the logger name `agent.shards.sharded`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from agent import __version__
from agent.config import AgentConfig
from agent.config.reload import ReloadPlan
from agent.lifecycle.manager import EngineManager
from agent.mqtt import MqttClient
from agent.mqtt.commands import CommandError
from agent.mqtt.topics import Topics
from agent.runtime.protocol import Outlet
from agent.runtime.reports import CameraState, camera_state_payload
from agent.service.notify import Notifier, extending
from agent.service.supervisor import Progress
from agent.shards import status
from agent.shards.engines import ShardEngines
from agent.shards.host import ShardHost
from agent.shards.placement import ShardPlan, place
from agent.shards.protocol import (
    CameraChanged,
    EngineState,
    ProgressReport,
    RebuildAsked,
    RegionState,
    TelemetryReport,
    TrackEvent,
    Up,
)
from agent.shards.tracks import OpenTracks, TrackEpochs
from agent.telemetry import StageWindow
from engines.precision import Precision

log = logging.getLogger("agent.shards.sharded")  # its lines keep the name they had (journald, greps)

START_S = 300.0  # every shard started (models loaded, cameras tried) or failed, at start-up
HUNG_S = 30.0  # a running shard silent this long (no progress report) is killed and restarted
REQUEST_S = 15.0  # snapshot from a shard
RELOAD_S = 300.0  # a shard applying its part of a reload (it may open a model)


def part_of(cfg: AgentConfig, plan: ShardPlan, k: int) -> AgentConfig:
    """Shard k's config: its cameras, the models they use; no Prometheus port, no discovery."""
    cams = {n: c for n, c in cfg.cameras.items() if plan.cameras.get(n) == k}
    used = {c.model for c in cams.values()}
    return cfg.model_copy(
        update={
            "cameras": cams,
            "models": {n: m for n, m in cfg.models.items() if n in used},
            "telemetry": cfg.telemetry.model_copy(update={"prometheus_port": None}),
        }
    )


class ShardedRuntime:
    """See the module docstring. `level`: the shards' log level; `plan`: the placement (default: the
    config's); `notifier`: STATUS= while the shards start."""

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        level: str = "info",
        plan: ShardPlan | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg = cfg
        self.level = level
        self.plan = plan or place(cfg)
        self._notifier = notifier or Notifier()
        self._outlet: Outlet | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.stages = StageWindow(capacity=2048 * self.plan.count)
        self.cameras: dict[str, CameraState] = {}  # as the shards report them
        self._open = [OpenTracks() for _ in range(self.plan.count)]  # what each shard left open
        self.epochs = TrackEpochs()  # where track ids start, for every start and hand-over of this run
        self.shard_engines = ShardEngines(self, cfg)
        self._on_message: dict[type, Callable[[int, Any], None]] = {
            ProgressReport: self._on_progress,
            CameraChanged: self._on_camera,
            TelemetryReport: self._on_telemetry,
            EngineState: lambda k, m: self.shard_engines.shard_state(k, m.model, m.fields),
            RebuildAsked: self._on_rebuild,
            TrackEvent: lambda k, m: self._open[k].event(m.camera, m.body),
            RegionState: lambda k, m: self._open[k].region(m.topic, m.body),
        }
        self._progress: dict[int, tuple[Progress, float]] = {}
        self._telemetry: dict[int, dict[str, Any]] = {}
        self.hosts = [self._host(k) for k in range(self.plan.count)]
        self._threads: list[threading.Thread] = []

    def _host(self, k: int) -> ShardHost:
        return ShardHost(
            k,
            self.plan.gpus[k],
            part_of(self.cfg, self.plan, k),
            self.level,
            self,
            self.cfg.pipeline.restart,
            epochs=self.epochs,
        )

    @property
    def managers(self) -> dict[str | None, EngineManager]:
        """One engine lifecycle per GPU model the shards run on (agent.shards.engines)."""
        return self.shard_engines.managers

    @property
    def engines(self) -> EngineManager:
        """The first shard's GPU model's lifecycle: the engine state's own fields."""
        return self.shard_engines.primary

    # ---- the outlet, read at each call (a reload may replace its MQTT client) ----------------------
    def attach(self, outlet: Outlet) -> None:
        self._outlet = outlet

    @property
    def mqtt(self) -> MqttClient | None:
        return self._outlet.mqtt if self._outlet is not None else None

    @property
    def topics(self) -> Topics:
        assert self._outlet is not None, "ShardedRuntime: attach() an outlet first"
        return self._outlet.topics

    def _status_changed(self) -> None:
        if self._outlet is not None:
            self._outlet.status_changed()

    # ---- start and stop -----------------------------------------------------------------------------
    def open(self) -> None:
        log.info(
            "%s; cameras per shard: %s",
            self.plan.why,
            {k: len(self.plan.of(k)) for k in range(self.plan.count)},
        )
        for manager in self.managers.values():
            for name in self.cfg.models:  # checks only: the shards load and serve
                manager.check(name)

    def start(self) -> None:
        for host in self.hosts:
            host.start()
        with extending(self._notifier, f"starting {len(self.hosts)} pipeline shards"):
            deadline = time.monotonic() + START_S
            for host in self.hosts:
                host.first_outcome.wait(max(0.0, deadline - time.monotonic()))
        failed = [h for h in self.hosts if h.state != "running"]
        why = "; ".join(f"shard {h.index}: {h.failure or h.last_exit or h.state}" for h in failed)
        if failed and len(failed) == len(self.hosts):
            raise RuntimeError(f"pipeline shards did not start: {why}")
        if failed:  # e.g. a GPU that fails: its shards retry with backoff, the other cameras run
            log.error("some pipeline shards did not start (they retry with backoff): %s", why)
        for manager in self.managers.values():
            manager.start()
        t = threading.Thread(target=self._watch_loop, name="shard-watch", daemon=True)
        t.start()
        self._threads.append(t)
        log.info(
            "edge-agent %s started: device %s, %d model(s), %d camera(s) in %d shards",
            __version__,
            self.cfg.device_id,
            len(self.cfg.models),
            len(self.plan.cameras),
            len(self.hosts),
        )

    def stop(self) -> None:
        self._stop.set()
        t0 = time.monotonic()
        for host in self.hosts:
            host.ask_stop()  # all at once: they stop in parallel
        for host in self.hosts:
            host.stop(timeout=max(1.0, 10.0 - (time.monotonic() - t0)))
        for manager in self.managers.values():
            manager.close()
        log.info("edge-agent stopped in %.2f s (%d shards)", time.monotonic() - t0, len(self.hosts))

    # ---- what the shards say (ShardEvents; their host threads) ---------------------------------------
    def shard_started(self, k: int, pid: int) -> None:
        log.info("shard %d: running (pid %d, cameras %s)", k, pid, ", ".join(self.plan.of(k)) or "none")

    def shard_failed(self, k: int, error: str) -> None:
        log.error("shard %d: failed to start: %s", k, error)
        self.hosts[k].last_exit = error

    def shard_exited(self, k: int, why: str, restart_in: float | None) -> None:
        cams = self.plan.of(k)
        log.error(
            "shard %d: %s; restarting in %.1f s (cameras %s)", k, why, restart_in or 0.0, ", ".join(cams)
        )
        self._progress.pop(k, None)
        failure = self.hosts[k].failure
        reason = f"shard {k} failed to start: {failure}" if failure else f"shard {k} {why}; restarting"
        with self._lock:
            for cam in cams:
                last = self.cameras.get(cam, CameraState("reconnecting"))
                self.cameras[cam] = replace(
                    last, state="reconnecting", fps_in=0.0, fps_out=0.0, last_error=reason
                )
            down = {cam: self.cameras[cam] for cam in cams}
        events, regions = self._open[k].close(cfg=self.cfg)
        client = self.mqtt
        if client is not None:
            # Its own client is gone: the supervisor says what happened to its cameras, and closes what it
            # left open (the events contract: every `new` has its `end`; zones empty).
            for cam, state in down.items():
                body = camera_state_payload(state)
                client.publish(self.topics.camera_state(cam), body, qos=1, retain=True, kind="state")
            for cam, body in events:
                client.publish(self.topics.events(cam), body, qos=1, kind="event")
            for topic, body in regions:
                client.publish(topic, body, qos=1, retain=True, kind="state")
        if events:
            log.info("shard %d: closed %d open track event(s) of its cameras", k, len(events))
        self._status_changed()

    def shard_message(self, k: int, msg: Up) -> None:
        handler = self._on_message.get(type(msg))
        if handler is None:
            log.warning("shard %d: unknown message %r", k, type(msg).__name__)
            return
        handler(k, msg)

    def _on_progress(self, k: int, msg: ProgressReport) -> None:
        self._progress[k] = (msg.progress, time.monotonic())

    def _on_camera(self, k: int, msg: CameraChanged) -> None:
        with self._lock:
            before = self._up()
            self.cameras[msg.camera] = msg.state
            changed = self._up() != before
        if changed:
            self._status_changed()

    def _on_telemetry(self, k: int, msg: TelemetryReport) -> None:
        self._telemetry[k] = msg.fields
        self.stages.absorb(msg.stages)

    def _on_rebuild(self, k: int, msg: RebuildAsked) -> None:
        manager = self.shard_engines.manager_of(k)
        if msg.model in manager.models:
            manager.rebuild(msg.model, force=msg.force, precision=msg.precision, reasons=msg.reasons)

    # ---- what the device asks (agent.runtime.protocol.Runtime) ----------------------------------------
    def progress(self) -> Progress:
        """Every shard's cameras and models (agent.shards.status)."""
        return status.progress(self.hosts, self.plan, self._progress, time.monotonic())

    def _up(self) -> int:
        return sum(1 for s in self.cameras.values() if s.state == "streaming")

    def camera_states(self) -> list[str]:
        with self._lock:
            return [s.state for s in self.cameras.values()]

    def cameras_total(self) -> int:
        return len(self.plan.cameras)

    def status_fields(self) -> dict[str, Any]:
        return {"shards": self._shards_summary()}

    def _shards_summary(self) -> dict[str, Any]:
        return {
            "count": len(self.hosts),
            "running": sum(1 for h in self.hosts if h.state == "running"),
            "restarts": sum(h.restarts for h in self.hosts),
        }

    def status_note(self) -> str:
        summary = self._shards_summary()
        if summary["running"] == summary["count"]:
            return ""
        return f"{summary['running']}/{summary['count']} shards running"

    def telemetry_fields(self, mqtt: Mapping[str, Any] | None) -> dict[str, Any]:
        return status.telemetry_fields(self.hosts, self.plan, self._telemetry, self.stages, mqtt)

    def after_telemetry(self) -> None:
        """Nothing: each shard republishes its cameras' states itself."""

    def republish(self) -> None:
        self.shard_engines.republish()

    def stale_region(self, topic: str, topics: Topics) -> bool:
        live = set()
        for name, cam in self.cfg.cameras.items():
            if cam.enabled:
                live.add(topics.camera_state(name))
            if cam.enabled and cam.tracking.enabled:
                live |= {topics.zone(name, z) for z in cam.zones}
                live |= {topics.line(name, ln) for ln in cam.lines}
        if topic in live:
            return False
        log.info("deleting stale camera/zone/line state %s", topic)
        return True

    def deploy_host(
        self,
        own: Callable[[], AgentConfig],
        publish: Callable[[str, bytes], None],
        lock: AbstractContextManager[Any],
    ) -> None:
        """None: no deployments while shards run (a version would have to be promoted in every shard)."""
        return None

    def snapshot(self, camera: str) -> dict[str, Any]:
        k = self.plan.cameras.get(camera)
        if k is None:
            known = sorted(self.plan.cameras)
            raise CommandError(f"field 'camera': unknown camera {camera!r} (known: {known})")
        ok, body = self.hosts[k].snapshot(camera, REQUEST_S)
        if not ok:
            raise CommandError(str(body))
        return dict(body, shard=k)

    def rebuild_targets(self) -> list[str]:
        return list(self.engines.models)

    def rebuild(self, model: str, force: bool, precision: Precision | None) -> bool:
        return self.shard_engines.rebuild(model, force, precision)

    def _watch_loop(self) -> None:
        """A running shard that stopped reporting (hung: a deadlock, a decoder stuck in a driver call) is
        killed; its host restarts it."""
        while not self._stop.wait(1.0):
            for host, silent_s in status.hung(self.hosts, self._progress, time.monotonic(), HUNG_S):
                log.error("shard %d: no report for %.0f s; killing it (it restarts)", host.index, silent_s)
                self._progress.pop(host.index, None)
                host.kill()

    # ---- reload (the device read and checked the file) --------------------------------------------------
    def prepare(self, new: AgentConfig, plan: ReloadPlan) -> ShardedReload:
        placement = place(new, previous=self.plan.cameras, count=self.plan.count)
        return ShardedReload(self, new, plan, placement)


class ShardedReload:
    """A prepared reload of a ShardedRuntime (agent.runtime.protocol.Prepared): the new placement. Each
    shard applies its part in place, as a single process would."""

    def __init__(self, runtime: ShardedRuntime, new: AgentConfig, plan: ReloadPlan, placement: ShardPlan):
        self._runtime, self._new, self._plan, self._placement = runtime, new, plan, placement

    def commit(self, switch: Callable[[], None]) -> str:
        rt, new, placement = self._runtime, self._new, self._placement
        old_plan = rt.plan
        rt.shard_engines.apply(new, self._plan)
        switch()
        rt.cfg, rt.plan = new, placement
        errors = []
        for host in rt.hosts:
            had = set(host.part.cameras)
            host.part = part_of(new, placement, host.index)
            if host.state != "running":
                continue  # it starts with its new part (a later start: ids afresh)
            handed = [c for c in host.part.cameras if c not in had]  # added, moved here, back again
            first = rt.epochs.fresh() if handed else 0
            ok, body = host.reload(host.part, RELOAD_S, dict.fromkeys(handed, first))
            if not ok:
                errors.append(f"shard {host.index}: {body}")
        with rt._lock:
            for cam in [c for c in rt.cameras if c not in placement.cameras]:
                del rt.cameras[cam]
        moved = [c for c, k in placement.cameras.items() if old_plan.cameras.get(c, k) != k]
        summary = self._plan.summary() + (f"; moved to another shard: {', '.join(moved)}" if moved else "")
        if errors:
            raise RuntimeError(f"applied in part ({summary}); " + "; ".join(errors))
        return summary

    def rollback(self) -> None:
        """Nothing to undo: prepare only placed the cameras."""
