"""The daemon: wires config -> camera readers -> model workers -> sinks (MQTT, console, telemetry).

`Agent` composes the parts of agent.runtime (the pipeline's wiring, the result sinks, the reports, the
reload transaction) with the engine lifecycle, the MQTT client and the service supervisor, and owns their
order: start, reload, stop.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.config import AgentConfig, ModelConfig
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.model import ModelContext
from agent.lifecycle.roles import DEVICE, ShardRole
from agent.mqtt import MqttClient
from agent.mqtt.commands import CommandRouter, SnapshotRequest
from agent.mqtt.topics import Topics, payload
from agent.owner import DeviceOwner
from agent.reload import ReloadPlan, plan_reload
from agent.runtime import reports
from agent.runtime.cameras import CameraRuntime
from agent.runtime.sinks import EventOut, ResultSinks
from agent.runtime.transaction import ReloadTransaction
from agent.runtime.wiring import Pipeline
from agent.service.notify import Notifier, extending
from agent.service.signals import SignalInbox
from agent.service.supervisor import Progress, Supervisor
from agent.telemetry import Metrics, StageWindow, process_stats
from pipelines.scheduler import ModelWorker

if TYPE_CHECKING:
    from agent.shards.link import ShardLink

log = logging.getLogger(__name__)


class Agent(DeviceOwner):
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        console: bool | None = None,
        quiet_mqtt: bool = False,
        config_path: str | Path | None = None,
        notifier: Notifier | None = None,
        shard: ShardLink | None = None,
        first_id: int = 1,
    ) -> None:
        self.cfg = cfg
        # A pipeline shard (agent.shards): this process runs its cameras' pipelines and publishes their
        # topics; the supervisor process owns status, commands, discovery, engine builds and systemd.
        self.shard = shard
        self.config_path = Path(config_path) if config_path is not None else None
        self.started_at = time.time()
        self._stop = threading.Event()
        # SIGTERM/SIGINT/SIGHUP only set flags there; the main loop (run_forever) stops or reloads.
        self._signals = SignalInbox()
        self._reload_lock = threading.Lock()
        self.last_reload: dict | None = None  # outcome of the last reload, in the status payload
        self.notifier = notifier or Notifier()
        self.supervisor = Supervisor(self.notifier, self.progress)
        self.commands = self._make_router(cfg)
        self._lock = threading.Lock()
        self.topics = Topics(cfg.mqtt.prefix, cfg.device_id)
        self.metrics = Metrics()
        self.mqtt: MqttClient | None = None
        self._quiet_mqtt = quiet_mqtt
        events_out = EventOut(self, mirror=None if shard is None else shard.mirror)
        self.pipeline = Pipeline(self._on_camera_state, events_out, first_id=first_id)
        self.sinks = ResultSinks(
            self, self.pipeline.cameras, self.pipeline.labels, cfg.console if console is None else console
        )
        self._telemetry_thread: threading.Thread | None = None
        self.engines = EngineManager(
            cfg,
            self._publish_engine if shard is None else shard.engine_state,
            self.pipeline.swap_backend,
            __version__,
            frames_for=self.sinks.taps.get,
            role=DEVICE if shard is None else ShardRole(shard.request_rebuild),
        )

    # ---- the parts' state, by name -----------------------------------------------------------------
    @property
    def cameras(self) -> dict[str, CameraRuntime]:
        return self.pipeline.cameras

    @property
    def workers(self) -> dict[str, ModelWorker]:
        return self.pipeline.workers

    @property
    def labels(self) -> dict[str, list[str]]:
        return self.pipeline.labels

    @property
    def taps(self) -> dict[str, FrameTap]:
        """Per model: frames for the gate, from the running pipeline."""
        return self.sinks.taps

    @property
    def results_out(self) -> dict[str, int]:
        """Per model: results that passed every sink (the watchdog's progress)."""
        return self.sinks.results_out

    @property
    def stages(self) -> StageWindow:
        return self.sinks.stages

    # ---- start -------------------------------------------------------------------------------
    def _shard_index(self) -> int | None:
        return None if self.shard is None else self.shard.index

    def _on_region_state(self, topic: str, body: bytes) -> None:
        """A retained zone or line state that no camera publishes now (a zone removed while the agent was
        stopped): delete it. Network thread."""
        if not body or self.mqtt is None:
            return
        if topic not in self.pipeline.region_topics(self.topics):
            log.info("deleting stale zone/line state %s", topic)
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")

    def _make_router(self, cfg: AgentConfig) -> CommandRouter:
        router = CommandRouter(enabled=frozenset(cfg.mqtt.commands))
        router.register("rebuild", self._cmd_rebuild)
        router.register("reload", self._cmd_reload)
        router.register("snapshot", self._cmd_snapshot)
        return router

    def start(self) -> None:
        cfg = self.cfg
        self._install_signals()  # first: a SIGHUP or SIGTERM during start-up must not kill the process
        self.mqtt = self._make_mqtt(cfg, self.topics)
        # Models first: a broken model is a start-up error, before any camera is opened.
        for name, mcfg in cfg.models.items():
            with extending(self.notifier, f"starting: loading model {name}"):
                self._open_model(name, mcfg)
        for cam_name, cam in cfg.cameras.items():
            if cam.enabled:
                self.pipeline.open_camera(cam_name, cam, cfg)
        if self.shard is None:
            self.commands.start()
        if self.mqtt is not None:
            self.mqtt.start()
            self._publish_discovery()
        self._publish_region_states()  # zeros: a previous run's counts must not stand
        self.engines.start()
        for worker in self.workers.values():
            worker.start()
        for cam in self.cameras.values():
            cam.reader.start()
        if self.shard is None:
            self.supervisor.start()  # READY once every camera was tried and every model served a result
        process_stats()  # primes psutil's CPU counter so the first telemetry has a real value
        if cfg.telemetry.prometheus_port and self.shard is None:
            self.metrics.start_http(cfg.telemetry.prometheus_port)
        self._telemetry_thread = threading.Thread(target=self._telemetry_loop, name="telemetry", daemon=True)
        self._telemetry_thread.start()
        log.info(
            "edge-agent %s started: device %s, %d model(s), %d camera(s)",
            __version__,
            cfg.device_id,
            len(self.workers),
            len(self.cameras),
        )

    def _open_model(self, name: str, mcfg: ModelConfig, cfg: AgentConfig | None = None) -> None:
        """Open a model's backend and make its (not yet started) worker. `cfg`: a reloaded config that is
        not in effect yet. Raises before anything is registered, so a failure leaves no trace."""
        ctx = ModelContext.from_config(cfg or self.cfg, name)
        spec = ctx.spec  # resolved once: labels read, the ONNX grafted; the engine manager reuses it
        opener = functools.partial(self.engines.open, name, cfg, ctx)
        self.pipeline.open_model(name, mcfg, spec, opener, self.sinks.for_model)

    # ---- status and camera states ----------------------------------------------------------------
    def _status_fields(self) -> dict:
        return self._status_of([c.state for c in self.cameras.values()], len(self.cameras))

    def _on_camera_state(self, camera: str, state: str, reason: str | None) -> None:
        cam = self.cameras.get(camera)
        if cam is None:
            return
        with self._lock:
            changed = cam.state != state
            left_streaming = changed and cam.state == "streaming"
            cam.state, cam.reason = state, reason
        if left_streaming and cam.events is not None:
            # A reconnect (or a file that ended) ends every track: the next picture may show anything.
            cam.events.reset("reconnect" if state == "reconnecting" else state)
        self._publish_camera_state(cam)  # the reader logged the change
        if changed:
            self._publish_status()

    def _publish_camera_state(self, cam: CameraRuntime) -> None:
        state = reports.camera_state(cam)
        if self.shard is not None:  # the supervisor republishes it if this process dies
            self.shard.camera_state(cam.name, state)
        if self.mqtt is None:
            return
        body = reports.camera_state_payload(state)
        self.mqtt.publish(self.topics.camera_state(cam.name), body, qos=1, retain=True, kind="state")

    def _clear_camera_state(self, camera: str) -> None:
        """An empty retained message deletes the topic: a removed camera must not stay "streaming"."""
        if self.mqtt is not None:
            self.mqtt.publish(self.topics.camera_state(camera), b"", qos=1, retain=True, kind="state")

    def _publish_region_states(self) -> None:
        for cam in self.cameras.values():
            if cam.events is not None:
                cam.events.publish_states()

    def _publish_status(self) -> None:
        if self.mqtt is not None and self.shard is None:
            self.mqtt.publish_status(self._status_fields())

    def _publish_engine(self, model: str, fields: dict) -> None:
        if self.mqtt is None:
            return
        body = payload("engine", model=model, **fields)
        self.mqtt.publish(self.topics.engine(model), body, qos=1, retain=True, kind="state")

    def progress(self) -> Progress:
        """For the supervisor (READY, STATUS, WATCHDOG): cameras tried, frames in, results out."""
        return reports.progress(self.pipeline, self.results_out, self.engines)

    # ---- MQTT commands (validated by agent.mqtt.commands; they run one at a time on its thread) -----------
    def snapshot(self, camera: str) -> dict:
        """cmd/snapshot for one camera of this process (a shard answers the supervisor with it)."""
        return self._cmd_snapshot(SnapshotRequest(camera=camera))

    def _cmd_snapshot(self, req: SnapshotRequest) -> dict:
        """cmd/snapshot {camera}: the annotated last frame as JPEG on cameras/<camera>/snapshot."""
        return self.sinks.snapshot(req.camera)

    # ---- telemetry ---------------------------------------------------------------------------
    def telemetry_fields(self) -> dict[str, Any]:
        mqtt = {**self.mqtt.stats(), "commands": self.commands.stats()} if self.mqtt else None
        return reports.telemetry_fields(self.pipeline, self.stages, mqtt)

    def publish_telemetry(self) -> None:
        if self.shard is not None:  # the supervisor adds every shard's up and publishes one message
            self.shard.telemetry(self.telemetry_fields(), self.stages.drain())
        else:
            self._publish_telemetry(self.telemetry_fields())
        if self.mqtt is not None:
            for cam in list(self.cameras.values()):
                self._publish_camera_state(cam)

    # ---- DeviceOwner hooks (agent.owner: reloads, the main loop, discovery, answers) -----------------
    def _owns_device(self) -> bool:
        return self.shard is None  # a shard: its supervisor owns the device's identity

    def _cameras_total(self) -> int:
        return len(self.cameras)

    def _apply_reload(self, new: AgentConfig, plan: ReloadPlan) -> str:
        old = self.cfg
        self._apply(new, plan)
        self._publish_discovery(old)  # after every reload: cameras, labels or the section itself changed
        return plan.summary()

    def apply_config(self, new: AgentConfig) -> str:
        """A shard's reload: the supervisor read, checked and placed the config; this applies this shard's
        part in place (as reload() does with the file) and says what changed."""
        with self._reload_lock:
            plan = plan_reload(self.cfg, new)
            self._apply(new, plan)
            return plan.summary()

    # ---- reload (SIGHUP): applying a checked config in place (agent.runtime.transaction) -------------
    def _apply(self, new: AgentConfig, plan: ReloadPlan) -> None:
        topics = Topics(new.mqtt.prefix, new.device_id)
        mqtt = self._make_mqtt(new, topics) if plan.mqtt else None  # not started: nothing to undo
        tx = ReloadTransaction(self.pipeline, self.sinks, self.engines, new, plan)
        tx.prepare(self._open_model)  # a failure leaves everything as it was
        tx.close(self._clear_camera_state)  # nothing fails from here on
        if plan.mqtt:
            self._replace_mqtt(mqtt, topics)
        self.cfg = new
        tx.open()
        if plan.log_level:
            logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))
        self.sinks.console_on = new.console
        self._publish_status()

    def _republish(self) -> None:
        for cam in self.cameras.values():
            self._publish_camera_state(cam)
            if cam.events is not None:
                cam.events.publish_states()
        self.engines.republish()

    # ---- stop --------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if self.shard is None:  # a shard takes no signal: its supervisor stops it (agent.shards.child)
            self._signals.install()

    def _restore_signals(self) -> None:
        if self.shard is None:
            self._signals.restore()

    def stop(self) -> None:
        self._stop.set()
        self.supervisor.stopping()
        t0 = time.monotonic()
        for cam in self.cameras.values():
            cam.reader.request_stop()  # signal only; joined below so slow cameras stop in parallel
        for worker in self.workers.values():
            worker.stop(timeout=2.0)
        self.engines.close()
        for cam in self.cameras.values():
            if cam.reader.ident is not None:  # a start-up error may come before the readers started
                cam.reader.stop(timeout=max(0.1, 3.0 - (time.monotonic() - t0)))  # and its teardown
        for worker in self.workers.values():
            worker.close_backends()  # leaves (and logs) a backend whose worker thread did not stop
        for cam in self.cameras.values():
            if cam.events is not None:
                cam.events.close("stopped", clear=False)  # end events, zones empty (retained zeros)
        if self.shard is None:
            self.commands.stop()
        if self.mqtt is not None:
            for cam in self.cameras.values():
                cam.state = "stopped"  # retained: not "streaming" after the agent is gone
                self._publish_camera_state(cam)
            self.mqtt.close()
        self._restore_signals()
        log.info("edge-agent stopped in %.2f s", time.monotonic() - t0)
