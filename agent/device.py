"""The device: one MQTT identity over one runtime (agent.runtime.protocol.Runtime: the pipeline in this
process, agent.runtime.local, or pipeline shards, agent.shards.sharded).

It owns what a device has once: the MQTT client (status, its last will, command intake), Home Assistant
discovery and the deletion of stale retained configs and zone states, the service supervisor
(READY/STATUS/WATCHDOG), telemetry (MQTT and Prometheus), the main loop over signals, and reloads (SIGHUP,
cmd/reload): the file read and checked, planned (agent.config.reload), then `runtime.prepare` -> `commit`, or
`rollback` when the device cannot follow. Threads: the main thread runs the loop, stops and reloads; the
MQTT network thread calls the command router and the watch callbacks; a telemetry thread publishes.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Generic, TypeVar

from agent import __version__
from agent.config import AgentConfig, ConfigError, load_config
from agent.config.reload import ReloadPlan, keep_until_restart, plan_reload
from agent.device_deploy import DeviceDeployments
from agent.health import agent_state
from agent.homeassistant.discovery import discovery_messages, node_filter, removed_topics, stale_topics
from agent.mqtt import MqttClient, MqttError
from agent.mqtt.commands import (
    Answer,
    CommandError,
    CommandRouter,
    RebuildRequest,
    ReloadRequest,
    SnapshotRequest,
)
from agent.mqtt.topics import Topics, payload
from agent.preflight import preflight
from agent.runtime.protocol import Mirror, Runtime, device_topics
from agent.runtime.reports import CameraState
from agent.service.heap import HEAP
from agent.service.notify import Notifier
from agent.service.signals import SignalInbox
from agent.service.supervisor import Supervisor
from agent.telemetry import Metrics, process_stats

log = logging.getLogger("agent.owner")  # its lines keep the name they had (journald, greps)

R = TypeVar("R", bound=Runtime)


class Device(Generic[R]):
    """See the module docstring. `config_path`: where reloads read from; `quiet_mqtt` (the demo):
    connection trouble at DEBUG, a broker may simply not exist."""

    mirror: Mirror | None = None  # the device publishes for itself: no copies to anyone

    def __init__(
        self,
        cfg: AgentConfig,
        runtime: R,
        *,
        config_path: str | Path | None = None,
        notifier: Notifier | None = None,
        quiet_mqtt: bool = False,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.config_path = Path(config_path) if config_path is not None else None
        self.started_at = time.time()
        self._starting = False  # the last status published said `starting` (agent.health)
        self._quiet_mqtt = quiet_mqtt
        self._stop = threading.Event()
        # SIGTERM/SIGINT/SIGHUP only set flags there; the main loop (run_forever) stops or reloads.
        self._signals = SignalInbox()
        self._reload_lock = self.reload_lock = threading.Lock()  # reloads and a deployment's hot swap
        self.last_reload: dict | None = None  # outcome of the last reload, in the status payload
        self.reload_note = ""  # the last reload's failure, kept in STATUS until a reload succeeds
        self.notifier = notifier or Notifier()
        self.supervisor = Supervisor(self.notifier, runtime.progress)
        self.commands = CommandRouter(enabled=frozenset(cfg.mqtt.commands))
        self.commands.register("rebuild", self._cmd_rebuild)
        self.commands.register("reload", self._cmd_reload)
        self.commands.register("snapshot", self._cmd_snapshot)
        self.deployments = DeviceDeployments(self)  # cmd/deploy, cmd/rollback, deployments/{model}
        self.topics = device_topics(cfg)
        self.mqtt: MqttClient | None = None
        self.metrics = Metrics()
        self._telemetry_thread: threading.Thread | None = None
        runtime.attach(self)

    # ---- start and stop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._signals.install()  # first: a SIGHUP or SIGTERM during start-up must not kill the process
        self.mqtt = self._make_mqtt(self.cfg, self.topics)
        self.deployments.start()  # the deployed versions the runtime serves in place of the config's
        self.runtime.open()  # a broken model is a start-up error, before anything is announced
        self.commands.start()
        if self.mqtt is not None:
            self.mqtt.start()
            self._publish_discovery()
        self.runtime.start()
        self.supervisor.start()  # READY once every camera was tried and every model served a result
        process_stats()  # primes psutil's CPU counter so the first telemetry has a real value
        if self.cfg.telemetry.prometheus_port:
            self.metrics.start_http(self.cfg.telemetry.prometheus_port)
        self._telemetry_thread = threading.Thread(target=self._telemetry_loop, name="telemetry", daemon=True)
        self._telemetry_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.supervisor.stopping()
        self.deployments.close()  # a pending deployment keeps its record: the next start settles it
        self.runtime.stop()  # its cameras say `stopped` through the client, still connected
        self.commands.stop()
        if self.mqtt is not None:
            self.mqtt.close()
        self._signals.restore()

    def request_stop(self) -> None:
        """Stop from any thread (not a signal handler: those go through SignalInbox)."""
        self._stop.set()
        self._signals.stop = True
        self._signals.poke()

    def request_reload(self) -> None:
        self._signals.reload = True
        self._signals.poke()

    def run_forever(self) -> None:
        """The main thread: signal handlers only set flags (a handler may interrupt any line of this
        thread, even one holding a lock); the stop and the reload themselves run here, between waits. Any
        burst of signals ends in reloads or in one stop: a stop wins over reloads still pending."""
        self._signals.install()
        try:
            while not (self._signals.stop or self._stop.is_set()):
                self._signals.wait(0.5)
                if self._signals.stop:
                    break
                if self._signals.take_reload():
                    self.reload()
        finally:
            self.stop()

    # ---- the outlet the runtime publishes through (agent.runtime.protocol.Outlet) -----------------------
    def camera_changed(self, camera: str, state: CameraState) -> None:
        """Nothing: the retained camera state is the runtime's."""

    def status_changed(self) -> None:
        self._publish_status()

    def engine_state(self, model: str, fields: dict[str, Any]) -> None:
        if self.mqtt is None:
            return
        body = payload("engine", model=model, **fields)
        self.mqtt.publish(self.topics.engine(model), body, qos=1, retain=True, kind="state")

    # ---- status --------------------------------------------------------------------------------------
    def status_fields(self) -> dict:
        """The status payload's fields from the runtime's cameras (its own fields before `last_reload`)."""
        states = self.runtime.camera_states()
        total = self.runtime.cameras_total()
        up = sum(1 for s in states if s == "streaming")
        timeout = max((c.open_timeout_s for c in self.cfg.cameras.values() if c.enabled), default=0.0)
        age = time.time() - self.started_at
        state = agent_state(states, total, self._stop.is_set(), age, timeout)  # starting: not degraded yet
        fields = {
            "state": state,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": up,
            "cameras_total": total,
            "groups": list(self.cfg.mqtt.groups),  # fleet rollouts find a group's devices by it
            **self.runtime.status_fields(),
        }
        if self.last_reload is not None:
            fields["last_reload"] = self.last_reload
        return fields

    def _offline_fields(self, reason: str) -> dict:
        """The graceful offline status and the LWT carry the same fields (the LWT's are fixed at connect)."""
        return {
            "state": "offline",
            "reason": reason,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": 0,
            "cameras_total": self.runtime.cameras_total(),
            "groups": list(self.cfg.mqtt.groups),
        }

    def _status_extra(self) -> str:
        """What STATUS= adds after the cameras and models (agent.service.supervisor)."""
        return ", ".join(t for t in (self.runtime.status_note(), self.reload_note) if t)

    def _publish_status(self) -> None:
        if self.mqtt is not None:
            fields = self.status_fields()
            self._starting = fields["state"] == "starting"  # its grace ends with no camera news: see below
            self.mqtt.publish_status(fields)
        self.supervisor.set_extra(self._status_extra())

    # ---- telemetry -------------------------------------------------------------------------------------
    def telemetry_fields(self) -> dict[str, Any]:
        mqtt = {**self.mqtt.stats(), "commands": self.commands.stats()} if self.mqtt else None
        return self.runtime.telemetry_fields(mqtt)

    def publish_telemetry(self) -> None:
        """One telemetry payload: to Prometheus and, when connected to a broker, on the telemetry topic."""
        if self._starting:
            self._publish_status()  # `starting` is bounded (agent.health): degraded once its grace is over
        fields = self.telemetry_fields()
        configured = [name for name, cam in self.cfg.cameras.items() if cam.enabled]
        self.metrics.update(fields, cameras=configured)  # a removed camera's series go
        if self.mqtt is not None:
            self.mqtt.publish(self.topics.telemetry, payload("telemetry", **fields), qos=0, kind="event")
        self.runtime.after_telemetry()

    def _telemetry_loop(self) -> None:
        while not self._stop.wait(self.cfg.telemetry.interval_s):  # re-read: a reload may change it
            try:
                self.publish_telemetry()
            except Exception:
                log.exception("telemetry failed")
            HEAP.tick()

    # ---- the MQTT client -------------------------------------------------------------------------------
    def _make_mqtt(self, cfg: AgentConfig, topics: Topics) -> MqttClient | None:
        """The client for `cfg` (not started); it watches the node's retained discovery configs and zone
        states, to delete the stale ones."""
        if not cfg.mqtt.enabled:
            return None
        client = MqttClient.from_config(
            cfg.mqtt,
            topics,
            birth=self.status_fields,
            offline=self._offline_fields,
            quiet=self._quiet_mqtt,
            commands=self.commands,
            answer=self._publish_answer,
        )
        client.watch(node_filter(cfg), self._on_discovery_config)
        self.deployments.watch(client, topics)
        for region_filter in topics.regions_filter():
            client.watch(region_filter, self._on_region_state)
        return client

    def _replace_mqtt(self, client: MqttClient | None, topics: Topics) -> None:
        """A reload's new client (or none) in place of the old one, which closes gracefully ("offline" on
        its status topic, then DISCONNECT); the new one starts and gets the retained states again."""
        old, self.mqtt, self.topics = self.mqtt, client, topics
        if old is not None:
            old.close()
        if self.mqtt is not None:
            self.mqtt.start()
            self.runtime.republish()  # discovery configs follow the reload

    def _on_discovery_config(self, topic: str, body: bytes) -> None:
        """A retained config of our node that the config does not publish (a camera removed while the agent
        was stopped, discovery turned off): delete it. Network thread; publish() does not block."""
        if body and self.mqtt is not None and stale_topics(self.cfg, [topic]):
            log.info("Home Assistant: deleting stale discovery config %s", topic)
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")

    def _on_region_state(self, topic: str, body: bytes) -> None:
        """A retained zone or line state that no camera publishes now (a zone removed while the agent was
        stopped): delete it. Network thread."""
        if body and self.mqtt is not None and self.runtime.stale_region(topic, self.topics):
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")

    def _publish_discovery(self, old: AgentConfig | None = None) -> None:
        if self.mqtt is None:
            return
        for topic in removed_topics(old, self.cfg) if old is not None else []:
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")  # deletes the entity
        for topic, body in discovery_messages(self.cfg, self.topics, __version__).items():
            self.mqtt.publish(topic, body, qos=1, retain=True, kind="state")

    # ---- commands (validated by agent.mqtt.commands; they run one at a time on its thread) --------------
    def _publish_answer(self, answer: Answer) -> None:
        # Through the client in use now: a reload may have replaced the one the command came in on.
        if self.mqtt is not None:
            # `device`: a fleet command (_all, _group/<g>) is answered by many devices, each on its own topic.
            body = payload("cmd-result", **{**answer.body(), "device": self.topics.device})
            self.mqtt.publish(self.topics.cmd_result(answer.action), body, qos=1, kind="event")

    def _cmd_rebuild(self, req: RebuildRequest) -> dict:
        """cmd/rebuild {model?, force?, precision?}: starts builds, answers at once; progress and the
        outcome follow on the engine state topics."""
        known = self.runtime.rebuild_targets()
        if req.model is not None and req.model not in known:
            why = f"unknown or not a TensorRT model {req.model!r} (known: {known})"
            raise CommandError(f"field 'model': {why}")
        targets = [req.model] if req.model else known
        started = [m for m in targets if self.runtime.rebuild(m, req.force, req.precision)]
        return {"started": started, "already_building": [m for m in targets if m not in started]}

    def _cmd_reload(self, req: ReloadRequest) -> dict:
        """cmd/reload {}: the SIGHUP path; answers with what changed, or why the config was refused."""
        if not self.reload():
            error = (self.last_reload or {}).get("error")
            raise CommandError(f"config refused, the previous one is still running: {error}")
        return {"changes": (self.last_reload or {}).get("changes")}

    def _cmd_snapshot(self, req: SnapshotRequest) -> dict:
        """cmd/snapshot {camera}: the annotated last frame as JPEG on cameras/<camera>/snapshot."""
        return self.runtime.snapshot(req.camera)

    # ---- reload (SIGHUP, cmd/reload) ---------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the config file and apply what changed in place. An invalid config, or one that cannot be
        applied, leaves everything as it was; the error goes to the log, the service status and the MQTT
        status payload (`last_reload`). True when the new config is in effect."""
        with self._reload_lock:
            self.supervisor.reloading()
            try:
                changes = self._reload_from_file()
            except Exception as exc:  # the old config keeps running whatever went wrong
                expected = isinstance(exc, (ConfigError, OSError, ValueError, RuntimeError, MqttError))
                error = str(exc) if expected else repr(exc)
                if not expected:  # a bug: its traceback helps
                    log.exception("reload failed")
                log.error("reload refused, still running the previous config: %s", error)
                self.last_reload = {"ok": False, "at": round(time.time(), 3), "error": error[:2000]}
                self.reload_note = f"last reload failed: {error.splitlines()[0][:200]}"
                ok = False
            else:
                log.info("reload applied: %s", changes)
                self.last_reload = {"ok": True, "at": round(time.time(), 3), "changes": changes}
                self.reload_note = ""
                ok = True
            self._publish_status()
            self.supervisor.reloaded()
            HEAP.request()  # what the reload replaced is freed: give it back (agent.service.heap)
            return ok

    def _reload_from_file(self) -> str:
        if self.config_path is None:
            raise ConfigError("reload: the agent was not started from a config file")
        new = load_config(self.config_path)
        problems = preflight(new, str(self.config_path))
        if problems:
            raise ConfigError("\n".join(problems))
        plan = plan_reload(self.cfg, new)
        new = keep_until_restart(self.cfg, new, plan)  # what cannot change in place stays; the plan says so
        if new.mqtt.enabled and plan.mqtt:
            new.mqtt.read_password()  # a missing password file fails now, before anything changed
        return self._apply(new, plan)

    def _apply(self, new: AgentConfig, plan: ReloadPlan) -> str:
        """plan -> runtime.prepare -> commit (or rollback when this device cannot follow)."""
        # Deployed versions stay on top of the new sections (agent.device_deploy); a failure changes nothing.
        prepared = self.runtime.prepare(self.deployments.overlay(new), plan)
        topics = device_topics(new)
        try:
            client = self._make_mqtt(new, topics) if plan.mqtt else None  # not started: nothing to undo
        except Exception:
            prepared.rollback()
            raise
        old = self.cfg

        def switch() -> None:
            if plan.mqtt:
                self._replace_mqtt(client, topics)
            self.cfg = new
            if plan.log_level:
                logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))

        try:
            return prepared.commit(switch)
        finally:
            self._publish_discovery(old)  # after every reload: cameras, labels or the section itself changed
            self.deployments.reloaded(old)  # states of removed models deleted
