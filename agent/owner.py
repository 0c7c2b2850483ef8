"""What the process that owns a device's MQTT identity does, whether it runs the pipeline itself (the
daemon's Agent) or supervises pipeline shards (agent.shards.sharded.ShardedAgent): the main loop over
signals, reloads from the config file, the offline status, command answers, Home Assistant discovery.

The owner class provides: cfg, config_path, started_at, mqtt, topics, supervisor, commands, engines, _signals,
_stop, _reload_lock, and the hooks below (`_cameras_total`, `_apply_reload`, `stop`, `_publish_status`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from agent import __version__
from agent.config import AgentConfig, ConfigError, load_config
from agent.mqtt import MqttClient, MqttError
from agent.mqtt.commands import Answer, CommandError, CommandRouter, RebuildRequest, ReloadRequest
from agent.mqtt.discovery import discovery_messages, node_filter, removed_topics, stale_topics
from agent.mqtt.topics import Topics, payload
from agent.preflight import preflight
from agent.reload import ReloadPlan, keep_until_restart, plan_reload
from agent.service.signals import SignalInbox
from agent.service.supervisor import Supervisor
from agent.telemetry import Metrics
from engines.precision import Precision

log = logging.getLogger(__name__)


class DeviceOwner:
    cfg: AgentConfig
    config_path: Path | None
    started_at: float
    mqtt: MqttClient | None
    topics: Topics
    supervisor: Supervisor
    commands: CommandRouter
    metrics: Metrics
    _signals: SignalInbox
    _stop: threading.Event
    _reload_lock: threading.Lock
    last_reload: dict | None
    reload_note = ""  # the last reload's failure, kept in STATUS until a reload succeeds
    _quiet_mqtt = False  # the demo: connection trouble at DEBUG (a broker may simply not exist)

    # ---- hooks -----------------------------------------------------------------------------------
    def _cameras_total(self) -> int:
        raise NotImplementedError

    def _apply_reload(self, new: AgentConfig, plan: ReloadPlan) -> str:
        """Apply a checked config; what changed (a summary line)."""
        raise NotImplementedError

    def _publish_status(self) -> None:
        raise NotImplementedError

    def _rebuild_targets(self) -> list[str]:
        return list(self.engines.models)  # type: ignore[attr-defined]

    def _rebuild(self, model: str, force: bool, precision: Precision | None) -> bool:
        return bool(self.engines.rebuild(model, force=force, precision=precision))  # type: ignore[attr-defined]

    def stop(self) -> None:
        raise NotImplementedError

    def _owns_device(self) -> bool:
        return True

    def _shard_index(self) -> int | None:
        return None

    def _status_fields(self) -> dict:
        raise NotImplementedError

    def publish_telemetry(self) -> None:
        raise NotImplementedError

    def _republish(self) -> None:
        """After a new MQTT client started (a reload): the retained states it must carry again."""
        raise NotImplementedError

    def _on_region_state(self, topic: str, body: bytes) -> None:
        raise NotImplementedError

    def _status_extra(self) -> str:
        """What STATUS= adds after the cameras and models (agent.service.supervisor)."""
        return self.reload_note

    # ---- status and telemetry ----------------------------------------------------------------------------
    def _status_of(self, states: list[str], total: int, **extra: Any) -> dict:
        """The status payload's fields from the cameras' states (`extra` before `last_reload`)."""
        up = sum(1 for s in states if s == "streaming")
        ended = sum(1 for s in states if s == "ended")  # a file played once: no fault
        state = "offline" if self._stop.is_set() else ("online" if up + ended == total else "degraded")
        fields = {
            "state": state,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": up,
            "cameras_total": total,
            **extra,
        }
        if self.last_reload is not None:
            fields["last_reload"] = self.last_reload
        return fields

    def _telemetry_loop(self) -> None:
        while not self._stop.wait(self.cfg.telemetry.interval_s):  # re-read: a reload may change it
            try:
                self.publish_telemetry()
            except Exception:
                log.exception("telemetry failed")

    def _publish_telemetry(self, fields: dict[str, Any]) -> None:
        """One telemetry payload: to Prometheus and, when connected to a broker, on the telemetry topic."""
        configured = [name for name, cam in self.cfg.cameras.items() if cam.enabled]
        self.metrics.update(fields, cameras=configured)  # a removed camera's series go
        if self.mqtt is not None:
            self.mqtt.publish(self.topics.telemetry, payload("telemetry", **fields), qos=0, kind="event")

    # ---- the MQTT client ----------------------------------------------------------------------------
    def _make_mqtt(self, cfg: AgentConfig, topics: Topics) -> MqttClient | None:
        """The client for `cfg` (not started). A shard's has no will, status or commands (agent.mqtt) and
        watches nothing: discovery and stale zone states are the owner's, who knows every camera."""
        if not cfg.mqtt.enabled:
            return None
        shard = self._shard_index()
        client = MqttClient.from_config(
            cfg.mqtt,
            topics,
            birth=self._status_fields,
            offline=self._offline_fields,
            quiet=self._quiet_mqtt,
            commands=self.commands,
            answer=self._publish_answer,
            shard=shard,
        )
        if shard is None:
            client.watch(node_filter(cfg), self._on_discovery_config)
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
            self._republish()  # discovery configs follow in _apply_reload

    # ---- status and answers ------------------------------------------------------------------------
    def _offline_fields(self, reason: str) -> dict:
        """The graceful offline status and the LWT carry the same fields (the LWT's are fixed at connect)."""
        return {
            "state": "offline",
            "reason": reason,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": 0,
            "cameras_total": self._cameras_total(),
        }

    def _publish_answer(self, answer: Answer) -> None:
        # Through the client in use now: a reload may have replaced the one the command came in on.
        if self.mqtt is not None:
            # `device`: a fleet command (_all, _group/<g>) is answered by many devices, each on its own topic.
            body = payload("cmd-result", **{**answer.body(), "device": self.topics.device})
            self.mqtt.publish(self.topics.cmd_result(answer.action), body, qos=1, kind="event")

    def _cmd_rebuild(self, req: RebuildRequest) -> dict:
        """cmd/rebuild {model?, force?, precision?}: starts builds, answers at once; progress and the
        outcome follow on the engine state topics."""
        known = self._rebuild_targets()
        if req.model is not None and req.model not in known:
            why = f"unknown or not a TensorRT model {req.model!r} (known: {known})"
            raise CommandError(f"field 'model': {why}")
        targets = [req.model] if req.model else known
        started = [m for m in targets if self._rebuild(m, req.force, req.precision)]
        return {"started": started, "already_building": [m for m in targets if m not in started]}

    def _cmd_reload(self, req: ReloadRequest) -> dict:
        """cmd/reload {}: the SIGHUP path; answers with what changed, or why the config was refused."""
        if not self.reload():
            error = (self.last_reload or {}).get("error")
            raise CommandError(f"config refused, the previous one is still running: {error}")
        return {"changes": (self.last_reload or {}).get("changes")}

    # ---- Home Assistant discovery (agent.mqtt.discovery) --------------------------------------------------
    def _publish_discovery(self, old: AgentConfig | None = None) -> None:
        if self.mqtt is None or not self._owns_device():
            return
        for topic in removed_topics(old, self.cfg) if old is not None else []:
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")  # deletes the entity
        for topic, body in discovery_messages(self.cfg, self.topics, __version__).items():
            self.mqtt.publish(topic, body, qos=1, retain=True, kind="state")

    def _on_discovery_config(self, topic: str, body: bytes) -> None:
        """A retained config of our node that the config does not publish (a camera removed while the agent
        was stopped, discovery turned off): delete it. Network thread; publish() does not block."""
        if body and self.mqtt is not None and stale_topics(self.cfg, [topic]):
            log.info("Home Assistant: deleting stale discovery config %s", topic)
            self.mqtt.publish(topic, b"", qos=1, retain=True, kind="state")

    # ---- reload (SIGHUP, cmd/reload) -------------------------------------------------------------------
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
            self.supervisor.set_extra(self._status_extra())
            self._publish_status()
            self.supervisor.reloaded()
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
        return self._apply_reload(new, plan)

    # ---- the main loop -----------------------------------------------------------------------------------
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
