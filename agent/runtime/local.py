"""The pipeline of this process as a device's runtime (agent.runtime.protocol.Runtime): config -> camera
readers -> model workers -> sinks (MQTT, console, telemetry), with the engine lifecycle.

`LocalRuntime` composes the parts of agent.runtime (the pipeline's wiring, the result sinks, the reports,
the reload transaction) with the engine lifecycle, and owns their order: open, start, reload, stop. It
publishes through its outlet: the device (agent.device), or in a pipeline shard the pipe to the
supervisor with the shard's own MQTT client (agent.shards.child, agent.shards.link). Its lines keep the
logger name `agent.daemon` (journald, greps).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from agent import __version__
from agent.config import AgentConfig, ModelConfig
from agent.config.reload import ReloadPlan
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.model import ModelContext
from agent.lifecycle.roles import DEVICE, Role
from agent.mqtt import MqttClient
from agent.mqtt.topics import Topics
from agent.runtime import reports
from agent.runtime.cameras import CameraRuntime
from agent.runtime.deploy_host import LocalDeployHost, check_backend
from agent.runtime.protocol import Outlet
from agent.runtime.sinks import EventOut, ResultSinks
from agent.runtime.transaction import ReloadTransaction
from agent.runtime.wiring import Pipeline
from agent.service.heap import HEAP
from agent.service.notify import Notifier, extending
from agent.service.supervisor import Progress
from agent.telemetry import StageWindow
from engines.precision import Precision
from pipelines.scheduler import ModelWorker

log = logging.getLogger("agent.daemon")  # its lines keep the name they had (journald, greps)


class LocalRuntime:
    """See the module docstring. `role`: the engine lifecycle's (a shard's hands rebuilds to its
    supervisor); `first_id`: where track ids start (agent.shards.tracks); `notifier`: STATUS= while a
    model loads at start."""

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        console: bool | None = None,
        role: Role = DEVICE,
        first_id: int = 1,
        notifier: Notifier | None = None,
    ) -> None:
        self.cfg = cfg
        self._outlet: Outlet | None = None
        self._notifier = notifier or Notifier()
        self._lock = threading.Lock()
        events_out = EventOut(self, mirror=self._mirror)
        self.pipeline = Pipeline(self._on_camera_state, events_out, first_id=first_id)
        self.sinks = ResultSinks(
            self, self.pipeline.cameras, self.pipeline.labels, cfg.console if console is None else console
        )
        self.engines = EngineManager(
            cfg,
            self._engine_state,
            self.pipeline.swap_backend,
            __version__,
            frames_for=self.sinks.taps.get,
            role=role,
        )

    # ---- the outlet, read at each call (a reload may replace its MQTT client) ----------------------
    def attach(self, outlet: Outlet) -> None:
        self._outlet = outlet

    @property
    def mqtt(self) -> MqttClient | None:
        return self._outlet.mqtt if self._outlet is not None else None

    @property
    def topics(self) -> Topics:
        assert self._outlet is not None, "LocalRuntime: attach() an outlet first"
        return self._outlet.topics

    def _mirror(self, topic: str, body: bytes, state: bool) -> None:
        mirror = self._outlet.mirror if self._outlet is not None else None
        if mirror is not None:
            mirror(topic, body, state)

    def _engine_state(self, model: str, fields: dict[str, Any]) -> None:
        if self._outlet is not None:
            self._outlet.engine_state(model, fields)

    # ---- the parts' state, by name -----------------------------------------------------------------
    @property
    def cameras(self) -> dict[str, CameraRuntime]:
        return self.pipeline.cameras

    @property
    def workers(self) -> dict[str, ModelWorker]:
        return self.pipeline.workers

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

    # ---- start and stop ------------------------------------------------------------------------
    def open(self) -> None:
        cfg = self.cfg
        # Models first: a broken model is a start-up error, before any camera is opened.
        for name, mcfg in cfg.models.items():
            with extending(self._notifier, f"starting: loading model {name}"):
                self._open_model(name, mcfg)
        for cam_name, cam in cfg.cameras.items():
            if cam.enabled:
                self.pipeline.open_camera(cam_name, cam, cfg)

    def start(self) -> None:
        self._publish_region_states()  # zeros: a previous run's counts must not stand
        self.engines.start()
        for worker in self.workers.values():
            worker.start()
        for cam in self.cameras.values():
            cam.reader.start()
        log.info(
            "edge-agent %s started: device %s, %d model(s), %d camera(s)",
            __version__,
            self.cfg.device_id,
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

    def stop(self) -> None:
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
        for cam in self.cameras.values():
            cam.state = "stopped"  # retained: not "streaming" after the agent is gone
            self._publish_camera_state(cam)
        log.info("edge-agent stopped in %.2f s", time.monotonic() - t0)

    # ---- camera states ---------------------------------------------------------------------------
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
        if changed and state == "streaming":
            HEAP.request()  # the old connection's capture and decoder buffers are freed by now
        if changed and self._outlet is not None:
            self._outlet.status_changed()

    def _publish_camera_state(self, cam: CameraRuntime) -> None:
        state = reports.camera_state(cam)
        client = self.mqtt
        if client is not None:
            body = reports.camera_state_payload(state)
            client.publish(self.topics.camera_state(cam.name), body, qos=1, retain=True, kind="state")
        if self._outlet is not None:
            self._outlet.camera_changed(cam.name, state)

    def _clear_camera_state(self, camera: str) -> None:
        """An empty retained message deletes the topic: a removed camera must not stay "streaming"."""
        client = self.mqtt
        if client is not None:
            client.publish(self.topics.camera_state(camera), b"", qos=1, retain=True, kind="state")

    def _publish_region_states(self) -> None:
        for cam in self.cameras.values():
            if cam.events is not None:
                cam.events.publish_states()

    # ---- what the device asks (agent.runtime.protocol.Runtime) -----------------------------------
    def camera_states(self) -> list[str]:
        return [c.state for c in self.cameras.values()]

    def cameras_total(self) -> int:
        return len(self.cameras)

    def status_fields(self) -> dict[str, Any]:
        return {}

    def status_note(self) -> str:
        return ""

    def progress(self) -> Progress:
        """For the supervisor (READY, STATUS, WATCHDOG): cameras tried, frames in, results out."""
        return reports.progress(self.pipeline, self.results_out, self.engines)

    def telemetry_fields(self, mqtt: Mapping[str, Any] | None) -> dict[str, Any]:
        return reports.telemetry_fields(self.pipeline, self.stages, mqtt)

    def after_telemetry(self) -> None:
        for cam in list(self.cameras.values()):
            self._publish_camera_state(cam)

    def republish(self) -> None:
        for cam in self.cameras.values():
            self._publish_camera_state(cam)
            if cam.events is not None:
                cam.events.publish_states()
        self.engines.republish()

    def stale_region(self, topic: str, topics: Topics) -> bool:
        live = self.pipeline.region_topics(topics) | {topics.camera_state(c) for c in self.cameras}
        if topic in live:  # a camera state or zone/line state no camera owns: one removed while stopped
            return False
        log.info("deleting stale camera/zone/line state %s", topic)
        return True

    def snapshot(self, camera: str) -> dict[str, Any]:
        """cmd/snapshot {camera}: the annotated last frame as JPEG on cameras/<camera>/snapshot."""
        return self.sinks.snapshot(camera)

    def rebuild_targets(self) -> list[str]:
        return list(self.engines.models)

    def rebuild(self, model: str, force: bool, precision: Precision | None) -> bool:
        return bool(self.engines.rebuild(model, force=force, precision=precision))

    # ---- deployed versions (agent.deploy through agent.runtime.deploy_host) ----------------------------
    def deploy_host(
        self,
        own: Callable[[], AgentConfig],
        publish: Callable[[str, bytes], None],
        lock: AbstractContextManager[Any],
    ) -> LocalDeployHost:
        """Where deployments run here (agent.deploy.host.DeployHost): this runtime's live frames, candidate
        checks and hot swap; `own`: the device's config now, `lock`: its reload lock."""
        return LocalDeployHost(self, own=own, publish=publish, lock=lock)

    def serve_models(self, models: Mapping[str, ModelConfig]) -> None:
        """Before open(): serve these model sections in place of the config's (deployed versions)."""
        if models:
            self.cfg = self.cfg.model_copy(update={"models": {**self.cfg.models, **models}})
            self.engines.reconfigure(self.cfg)

    def serve_model(self, name: str, mcfg: ModelConfig) -> None:
        """Serve `mcfg` for the running model `name` (a deployed version, or back): reopened through the
        engine lifecycle, checked with one inference, and handed to its worker, which switches backend and
        adapter at the top of its next batch. Cameras, readers and slots stay; a labels file with other
        names re-routes the class masks. A failure leaves the model serving what it served."""
        new = self.cfg.model_copy(update={"models": {**self.cfg.models, name: mcfg}})
        ctx = ModelContext.from_config(new, name)
        labels = list(ctx.spec.labels)
        old_me, old_labels = self.engines.detach(name), self.pipeline.labels[name]
        backend = None
        try:
            backend = self.engines.open(name, new, ctx)
            check_backend(name, mcfg, ctx, backend)
            self.pipeline.labels[name] = labels
            mine = {c: cam.cfg for c, cam in self.cameras.items() if cam.cfg.model == name}
            for cam_name, cam_cfg in mine.items():
                self.pipeline.check_camera(cam_name, cam_cfg, new)
        except Exception:
            self.pipeline.labels[name] = old_labels
            if backend is not None:
                backend.close()
            self.engines.retire(self.engines.detach(name))
            self.engines.attach(name, old_me)
            raise
        self.engines.retire(old_me)
        self.workers[name].swap_backend(backend, ctx.spec.adapter())
        if labels != old_labels:
            for cam_name, cam_cfg in mine.items():
                self.pipeline.reroute(cam_name, cam_cfg, new)
        self.cfg = new
        self.engines.reconfigure(new)
        self.engines.start_pending()  # an engine to build for it (TensorRT targets), as at start

    # ---- reload: a checked config applied in place (agent.runtime.transaction) --------------------------
    def prepare(self, new: AgentConfig, plan: ReloadPlan) -> LocalReload:
        tx = ReloadTransaction(self.pipeline, self.sinks, self.engines, new, plan)
        tx.prepare(self._open_model)  # a failure leaves everything as it was
        return LocalReload(self, tx, new, plan)


class LocalReload:
    """A prepared reload of a LocalRuntime (agent.runtime.protocol.Prepared)."""

    def __init__(self, runtime: LocalRuntime, tx: ReloadTransaction, new: AgentConfig, plan: ReloadPlan):
        self._runtime, self._tx, self._new, self._plan = runtime, tx, new, plan

    def commit(self, switch: Callable[[], None]) -> str:
        rt = self._runtime
        self._tx.close(rt._clear_camera_state)  # nothing fails from here on
        switch()
        rt.cfg = self._new
        self._tx.open()
        rt.sinks.console_on = self._new.console
        return self._plan.summary()

    def rollback(self) -> None:
        self._tx.rollback()
