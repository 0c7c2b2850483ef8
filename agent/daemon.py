"""The daemon: wires config -> camera readers -> model workers -> sinks (MQTT, console, telemetry)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agent import __version__, snapshot
from agent.commands import (
    CommandError,
    CommandRouter,
    SnapshotRequest,
)
from agent.config import AgentConfig, CameraConfig, ConfigError, ModelConfig
from agent.events import CameraEvents, analytics_settings, track_floor
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.manager import EngineManager
from agent.mqtt import MqttClient
from agent.owner import DeviceOwner
from agent.reload import ReloadPlan, plan_reload
from agent.results import ConsoleSink, detection_fields
from agent.service import Notifier, extending
from agent.signals import SignalInbox
from agent.supervisor import ModelProgress, Progress, Supervisor
from agent.telemetry import Metrics, RateCounter, StageWindow, build_telemetry, process_stats
from agent.topics import Topics, payload
from engines.errors import EngineError
from engines.runtimes.base import Backend
from pipelines.frames import host_image, stage_latencies_ms
from pipelines.models import check_outputs, make_adapter, probe_input
from pipelines.postprocess import load_labels
from pipelines.scheduler import CameraRoute, ModelWorker, Result
from pipelines.sources import CameraReader, SourceSpec, open_reader

if TYPE_CHECKING:
    from agent.shards.child import ShardLink
    from pipelines.preprocess_gpu import GpuLetterbox

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent / "assets"


@dataclass
class CameraRuntime:
    name: str
    cfg: CameraConfig
    reader: CameraReader
    state: str = "starting"
    reason: str | None = None
    fps_in: RateCounter = field(default_factory=RateCounter)
    fps_out: RateCounter = field(default_factory=RateCounter)
    last_frame_in: int = 0
    last_capture_ts: float | None = None  # wall-clock capture time of the newest frame published
    events: CameraEvents | None = None  # tracking, zones, lines and their events (tracking.enabled)
    # publish.detections on_change: what the last published detections held, and when (monotonic).
    last_signature: bytes | None = None
    last_published: float = -1e9


ON_CHANGE_KEEPALIVE_S = 10.0  # publish.detections on_change: a message at least this often anyway


class _EventOut:
    """agent.events.Publisher over the agent's MQTT client as it is at each call (a reload may swap it)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    @property
    def topics(self) -> Topics:
        return self._agent.topics

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None:
        client = self._agent.mqtt
        if client is None:
            return
        if state:
            client.publish(topic, body, qos=qos, retain=True, kind="state")
        elif qos or client.connected:  # QoS 0 (snapshots) only while connected: never queued offline
            client.publish(topic, body, qos=qos, kind="event")

    def connected(self) -> bool:
        client = self._agent.mqtt
        return client is not None and client.connected


def _gpu_preprocess(model: str) -> GpuLetterbox:
    """models.M.preprocess: gpu, or a start-up error saying why it cannot be."""
    from pipelines.preprocess_gpu import GpuLetterbox  # CUDA only where asked for

    try:
        return GpuLetterbox()
    except EngineError as exc:
        raise ConfigError(f"models.{model}.preprocess: gpu is not available here: {exc}") from None


def class_mask(cam_name: str, cam: CameraConfig, labels: list[str], labels_src: str) -> np.ndarray | None:
    if not cam.classes:
        return None
    index = {name: i for i, name in enumerate(labels)}
    unknown = [c for c in cam.classes if c not in index]
    if unknown:
        raise ConfigError(f"cameras.{cam_name}.classes: unknown class {unknown[0]!r} (labels: {labels_src})")
    mask = np.zeros(len(labels), dtype=bool)
    mask[[index[c] for c in cam.classes]] = True
    return mask


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
        self.results_out: dict[str, int] = {}  # per model: results that passed every sink (watchdog)
        self.commands = self._make_router(cfg)
        self._last_result: dict[str, Result] = {}  # per camera, for snapshots (a reference, no copy)
        self._last_snapshot: dict[str, float] = {}
        self._lock = threading.Lock()
        self.topics = Topics(cfg.mqtt.prefix, cfg.device_id)
        self.stages = StageWindow()
        self.metrics = Metrics()
        self.labels: dict[str, list[str]] = {}
        self.workers: dict[str, ModelWorker] = {}
        self.cameras: dict[str, CameraRuntime] = {}
        self.mqtt: MqttClient | None = None
        self._quiet_mqtt = quiet_mqtt
        self._console_on = cfg.console if console is None else console
        self._console = ConsoleSink(self.labels)
        self._event_out = _EventOut(self)
        self._kept_events: dict[str, CameraEvents] = {}  # of cameras closed to be reopened (reload)
        self._telemetry_thread: threading.Thread | None = None
        self.taps: dict[str, FrameTap] = {}  # per model: frames for the gate, from the running pipeline
        self.engines = EngineManager(
            cfg,
            self._publish_engine if shard is None else shard.engine_state,
            self._swap_backend,
            __version__,
            frames_for=self.taps.get,
            delegate=None if shard is None else shard.request_rebuild,
        )

    # ---- start -------------------------------------------------------------------------------
    def _shard_index(self) -> int | None:
        return None if self.shard is None else self.shard.index

    def _on_region_state(self, topic: str, body: bytes) -> None:
        """A retained zone or line state that no camera publishes now (a zone removed while the agent was
        stopped): delete it. Network thread."""
        if not body or self.mqtt is None:
            return
        live = set()
        for cam in list(self.cameras.values()):
            if cam.events is not None:
                live |= cam.events.region_topics(self.topics)
        if topic not in live:
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
                self._open_camera(cam_name, cam)
        if self.shard is None:
            self.commands.start()
        if self.mqtt is not None:
            self.mqtt.start()
            self._publish_discovery()
        for cam in self.cameras.values():
            if cam.events is not None:
                cam.events.publish_states()  # zeros: a previous run's counts must not stand
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
        labels = load_labels(mcfg.labels) if mcfg.labels is not None else []
        backend = self.engines.open(name, cfg)
        try:
            adapter = make_adapter(mcfg.format, backend.input_spec, len(labels))
            # One real inference: exported detectors often leave output shapes dynamic.
            image = probe_input(backend.input_spec)  # dynamic H/W as the adapter sizes them
            probe = np.zeros((backend.warmup_shape[0], *image.shape[1:]), dtype=backend.input_spec.dtype)
            check_outputs(mcfg.format, adapter, backend.infer(probe))
            gpu = _gpu_preprocess(name) if mcfg.preprocess == "gpu" else None
        except ConfigError:
            backend.close()
            raise
        except ValueError as exc:  # the adapter does not fit the model's input/outputs
            backend.close()
            raise ConfigError(f"models.{name}.format: {mcfg.format}: {exc}") from None
        except Exception:
            backend.close()
            raise
        log.info("model %s: served by %s (%s), %d labels", name, backend.name, backend.precision, len(labels))
        self.labels[name] = labels
        self.taps[name] = FrameTap()
        self.results_out.setdefault(name, 0)
        sinks = [self._publish_sink, self._telemetry_sink, self._console_sink, self.taps[name]]
        self.workers[name] = ModelWorker(
            name,
            backend,
            adapter,
            [*sinks, self._progress_sink],  # last: a result counts as progress once every sink took it
            iou_threshold=mcfg.iou_threshold,
            max_batch=mcfg.batch.max,
            max_age_ms=mcfg.max_age_ms,
            gpu_preprocess=gpu,
        )

    def _open_camera(
        self, name: str, cam: CameraConfig, cfg: AgentConfig | None = None, events: CameraEvents | None = None
    ) -> None:
        """``events``: a restarted camera's analytics, kept (counts and ids go on) and reconfigured."""
        worker = self.workers[cam.model]
        labels_src = str((cfg or self.cfg).models[cam.model].labels)
        labels = self.labels[cam.model]
        mask = class_mask(name, cam, labels, labels_src)
        events = events or self._kept_events.pop(name, None)
        if not cam.tracking.enabled:
            if events is not None:
                events.close("reconfigured", clear=True)
            events = None
        elif events is None:
            events = CameraEvents(name, cam, labels, labels_src, self._event_out)
        else:
            events.reconfigure(cam, labels, labels_src)
        slot = worker.new_slot()
        spec = SourceSpec(
            camera=name,
            url=cam.url,
            pipeline=cam.pipeline,
            fps=cam.fps,
            loop=cam.loop,
            open_timeout_s=cam.open_timeout_s,
            read_timeout_s=cam.read_timeout_s,
        )
        reader = open_reader(
            spec, slot, self._on_camera_state, decoder=cam.decoder, latency=cam.decoder_latency
        )
        self.cameras[name] = CameraRuntime(name, cam, reader, events=events)
        worker.add_camera(CameraRoute(name, slot, mask, track_floor(cam), analytics=events))

    # ---- callbacks ---------------------------------------------------------------------------
    def _status_fields(self) -> dict:
        up = sum(1 for c in self.cameras.values() if c.state == "streaming")
        total = len(self.cameras)
        ended = sum(1 for c in self.cameras.values() if c.state == "ended")  # a file played once: no fault
        state = "offline" if self._stop.is_set() else ("online" if up + ended == total else "degraded")
        fields = {
            "state": state,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": up,
            "cameras_total": total,
        }
        if self.last_reload is not None:
            fields["last_reload"] = self.last_reload
        return fields

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
        if self.shard is not None:
            self.shard.camera_state(camera, state, reason)
        if changed:
            self._publish_status()

    def _publish_camera_state(self, cam: CameraRuntime) -> None:
        if self.mqtt is None:
            return
        body = payload(
            "camera-state",
            state=cam.state,
            fps_in=round(cam.fps_in.rate(), 2),
            fps_out=round(cam.fps_out.rate(), 2),
            reconnects=cam.reader.reconnects,
            loops=cam.reader.loops,  # a looping file's passes (a loop is not a reconnect)
            last_error=cam.reader.last_error,
            decoder=cam.reader.decoder,
            decoder_reason=cam.reader.decoder_reason,
        )
        self.mqtt.publish(self.topics.camera_state(cam.name), body, qos=1, retain=True, kind="state")

    def _publish_status(self) -> None:
        if self.mqtt is not None and self.shard is None:
            self.mqtt.publish_status(self._status_fields())

    def _publish_engine(self, model: str, fields: dict) -> None:
        if self.mqtt is None:
            return
        body = payload("engine", model=model, **fields)
        self.mqtt.publish(self.topics.engine(model), body, qos=1, retain=True, kind="state")

    def _swap_backend(self, model: str, backend: Backend) -> None:
        """Hot swap between two batches; cameras and slots stay as they are. The worker switches at the top
        of its next batch, logs "now served by", and closes the old backend once no batch uses it."""
        self.workers[model].swap_backend(backend)

    # ---- MQTT commands (validated by agent.commands; they run one at a time on its thread) -----------
    def snapshot(self, camera: str) -> dict:
        """cmd/snapshot for one camera of this process (a shard answers the supervisor with it)."""
        return self._cmd_snapshot(SnapshotRequest(camera=camera))

    def apply_config(self, new: AgentConfig) -> str:
        """A shard's reload: the supervisor read, checked and placed the config; this applies this shard's
        part in place (as reload() does with the file) and says what changed."""
        with self._reload_lock:
            plan = plan_reload(self.cfg, new)
            self._apply(new, plan)
            return plan.summary()

    def _cmd_snapshot(self, req: SnapshotRequest) -> dict:
        """cmd/snapshot {camera}: the annotated last frame as JPEG on cameras/<camera>/snapshot."""
        if req.camera not in self.cameras:
            known = sorted(self.cameras)
            raise CommandError(f"field 'camera': unknown camera {req.camera!r} (known: {known})")
        result = self._last_result.get(req.camera)
        if result is None:
            raise CommandError(f"camera {req.camera}: no processed frame yet")
        size = self._publish_snapshot(result)
        return {"camera": req.camera, "frame_id": result.frame.frame_id, "bytes": size}

    def _publish_snapshot(self, result: Result) -> int:
        cam = self.cameras.get(result.frame.camera)
        quality = cam.cfg.snapshot.quality if cam is not None else 80
        image = snapshot.annotate(
            host_image(result.frame.image), result.detections, self.labels.get(result.model, [])
        )
        data = snapshot.jpeg(image, quality)
        if self.mqtt is not None and self.mqtt.connected:  # never queued offline: JPEGs would fill memory
            self.mqtt.publish(self.topics.snapshot(result.frame.camera), data, qos=0, kind="event")
        return len(data)

    def _snapshot_on_detection(self, result: Result) -> None:
        cam = self.cameras.get(result.frame.camera)
        if cam is None or not cam.cfg.snapshot.on_detection or not len(result.detections):
            return
        now = time.monotonic()
        if now - self._last_snapshot.get(cam.name, -1e9) < cam.cfg.snapshot.min_interval_s:
            return
        self._last_snapshot[cam.name] = now
        self._publish_snapshot(result)

    def _publish_sink(self, result: Result) -> None:
        result.frame.stamp("published")
        self._last_result[result.frame.camera] = result
        if self.mqtt is None:
            return
        self._snapshot_on_detection(result)
        cam = self.cameras.get(result.frame.camera)
        if cam is not None and not self._detections_due(cam, result):
            return
        fields = detection_fields(result, self.labels.get(result.model, []))
        body = payload("detections", **fields)
        self.mqtt.publish(self.topics.detections(result.frame.camera), body, kind="event")

    @staticmethod
    def _detections_due(cam: CameraRuntime, result: Result) -> bool:
        """cameras.C.publish.detections: every_frame, off, or on_change (the labels, or the track ids, in
        the picture differ from the last message's; and at least every ON_CHANGE_KEEPALIVE_S)."""
        mode = cam.cfg.publish.detections
        if mode == "every_frame":
            return True
        if mode == "off":
            return False
        d = result.detections
        ids = result.analysis.track_ids if result.analysis is not None else None
        key = np.sort(d.class_ids.astype(np.int64) if ids is None else ids * 4096 + d.class_ids)
        signature = key.tobytes()
        now = time.monotonic()
        if signature == cam.last_signature and now - cam.last_published < ON_CHANGE_KEEPALIVE_S:
            return False
        cam.last_signature, cam.last_published = signature, now
        return True

    def _console_sink(self, result: Result) -> None:
        if self._console_on:
            self._console(result)

    def _progress_sink(self, result: Result) -> None:
        # One writer per model (its worker thread); the supervisor only reads.
        self.results_out[result.model] = self.results_out.get(result.model, 0) + 1

    def progress(self) -> Progress:
        """For the supervisor (READY, STATUS, WATCHDOG): cameras tried, frames in, results out."""
        cams = dict(self.cameras)
        models = {}
        for name, worker in list(self.workers.items()):
            mine = [c for c in cams.values() if c.cfg.model == name]
            backend = worker.backend
            models[name] = ModelProgress(
                frames_in=sum(c.reader.frames_in for c in mine),
                results=self.results_out.get(name, 0),
                running=worker.running,
                serving=f"{backend.name} {backend.precision}",
                streaming_cameras=sum(1 for c in mine if c.state == "streaming"),
                note=self.engines.summary(name),
            )
        fps = sum(c.fps_out.rate() for c in cams.values())
        return Progress({n: c.state for n, c in cams.items()}, models, fps)

    def _telemetry_sink(self, result: Result) -> None:
        lat = stage_latencies_ms(result.frame)
        if result.gpu_ms is not None:
            lat["gpu"] = result.gpu_ms  # the batch's device time, for each of its frames
        self.stages.add_many(lat)
        cam = self.cameras.get(result.frame.camera)
        if cam is not None:
            cam.fps_out.tick()
            cam.last_capture_ts = result.frame.ts_capture

    # ---- telemetry ---------------------------------------------------------------------------
    def _telemetry_loop(self) -> None:
        while not self._stop.wait(self.cfg.telemetry.interval_s):  # re-read: a reload may change it
            try:
                self.publish_telemetry()
            except Exception:
                log.exception("telemetry failed")

    def telemetry_fields(self) -> dict:
        cams = {}
        for name, cam in list(self.cameras.items()):  # a reload may change the dict meanwhile
            frames_in = cam.reader.frames_in
            cam.fps_in.tick(frames_in - cam.last_frame_in)
            cam.last_frame_in = frames_in
            route = self.workers[cam.cfg.model].route(name)
            cams[name] = {
                "state": cam.state,
                "fps_in": round(cam.fps_in.rate(), 2),
                "fps_out": round(cam.fps_out.rate(), 2),
                "dropped": route.slot.dropped if route else 0,
                "dropped_stale": route.stale if route else 0,  # older than models.M.max_age_ms
                "reconnects": cam.reader.reconnects,
                "loops": cam.reader.loops,
                "decoder": cam.reader.decoder,  # nvdec, cpu or pipeline
                # Packets NVDEC rejected (corrupt bitstream; decoding resumed at the next key frame).
                "decode_errors": cam.reader.decode_errors,
                # How stale the newest result is: grows when a camera or the model stalls.
                "frame_age_ms": None
                if cam.last_capture_ts is None
                else round((time.time() - cam.last_capture_ts) * 1000.0, 1),
            }
            if cam.events is not None:  # tracks_active, tracks_started, events, zones, lines
                cams[name]["tracking"] = cam.events.stats()
        fills = [w.batch_fill_sum / w.batches for w in self.workers.values() if w.batches]
        backends = {name: w.backend.name for name, w in self.workers.items()}
        return build_telemetry(
            cameras=cams,
            stages=self.stages.summary(),
            backend=backends,
            batch_fill=round(float(np.mean(fills)), 3) if fills else None,
            process=process_stats(),
            mqtt={**self.mqtt.stats(), "commands": self.commands.stats()} if self.mqtt else None,
        )

    def publish_telemetry(self) -> None:
        if self.shard is not None:  # the supervisor adds every shard's up and publishes one message
            self.shard.telemetry(self.telemetry_fields(), self.stages.drain())
            if self.mqtt is not None:
                for cam in list(self.cameras.values()):
                    self._publish_camera_state(cam)
            return
        fields = self.telemetry_fields()
        self.metrics.update(fields)
        if self.mqtt is not None:
            self.mqtt.publish(self.topics.telemetry, payload("telemetry", **fields), qos=0, kind="event")
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

    # ---- reload (SIGHUP): applying a checked config in place --------------------------------------
    def _apply(self, new: AgentConfig, plan: ReloadPlan) -> None:
        # 1. Everything that can fail, while nothing has changed yet: class masks of new/changed cameras
        #    against the labels they will use, then the models to open (ORT serves at once; engines build
        #    in the background as at start). A failure closes what was opened and re-raises.
        topics = Topics(new.mqtt.prefix, new.device_id)
        mqtt = self._make_mqtt(new, topics) if plan.mqtt else None  # not started: nothing to undo
        reopen = plan.models_added + plan.models_changed
        old_workers = {n: self.workers[n] for n in plan.models_changed}
        old_labels = {n: self.labels[n] for n in plan.models_changed}
        old_taps = {n: self.taps[n] for n in plan.models_changed}
        detached = {n: self.engines.detach(n) for n in plan.models_changed}
        opened: list[str] = []
        try:
            for name in reopen:
                self._open_model(name, new.models[name], new)
                opened.append(name)
            changed = (
                plan.cameras_added + plan.cameras_restarted + plan.cameras_rerouted + plan.cameras_analytics
            )
            for name in dict.fromkeys(changed):
                cam = new.cameras[name]
                labels_src = str(new.models[cam.model].labels)
                class_mask(name, cam, self.labels[cam.model], labels_src)
                if cam.tracking.enabled:  # zone and line labels against the model's labels
                    analytics_settings(name, cam, self.labels[cam.model], labels_src)
        except Exception:
            for name in opened:
                self.workers.pop(name).close_backends()
                self.engines.retire(self.engines.detach(name))
            self.workers.update(old_workers)
            self.labels.update(old_labels)
            self.taps.update(old_taps)
            for name, me in detached.items():
                self.engines.attach(name, me)
            raise
        # 2. Nothing fails from here on: switch over. Every leaving camera is asked to stop first, so slow
        #    ones (a read or an open in progress) end in parallel, not one after another.
        leaving = plan.cameras_removed + plan.cameras_restarted
        for name in leaving:
            self.cameras[name].reader.request_stop()
        for name in leaving:
            self._close_camera(name, clear_state=name in plan.cameras_removed)
        for name in plan.models_removed:
            self._close_model(self.workers.pop(name), name)
            self.engines.retire(self.engines.detach(name))
            for d in (self.labels, self.taps, self.results_out):
                d.pop(name, None)
        for name, worker in old_workers.items():
            self._close_model(worker, name)
            self.engines.retire(detached[name])
        if plan.mqtt:
            self._replace_mqtt(mqtt, topics)
        self.cfg = new
        self.engines.reconfigure(new)
        for name in reopen:
            self.workers[name].start()
        self.engines.start_pending()
        for name in dict.fromkeys(plan.cameras_rerouted + plan.cameras_analytics):
            self._reroute(name, new.cameras[name])
        for name in plan.cameras_added + plan.cameras_restarted:
            self._open_camera(name, new.cameras[name])
            self.cameras[name].reader.start()
        if plan.log_level:
            logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))
        self._console_on = new.console
        self._publish_status()

    def _reroute(self, name: str, cam: CameraConfig) -> None:
        """A running camera's route (classes, min_score) and analytics (tracking, zones, lines, events,
        publish) in place; its reader keeps streaming."""
        runtime = self.cameras[name]
        labels, labels_src = self.labels[cam.model], str(self.cfg.models[cam.model].labels)
        mask = class_mask(name, cam, labels, labels_src)
        events = runtime.events
        if not cam.tracking.enabled:
            if events is not None:
                events.close("reconfigured", clear=True)
            events = None
        elif events is None:
            events = CameraEvents(name, cam, labels, labels_src, self._event_out)
            events.publish_states()
        else:
            events.reconfigure(cam, labels, labels_src)
        worker = self.workers[cam.model]
        route = worker.route(name)
        if route is not None:
            worker.add_camera(CameraRoute(name, route.slot, mask, track_floor(cam), analytics=events))
        runtime.cfg, runtime.events = cam, events

    def _close_camera(self, name: str, clear_state: bool) -> None:
        cam = self.cameras.pop(name)
        worker = self.workers.get(cam.cfg.model)
        if worker is not None:
            worker.remove_camera(name)
        if not cam.reader.stop():
            log.warning("camera %s: reader did not stop in time; left to end on its own", name)
        if cam.events is not None:
            # Removed: its tracks end and its zone/line states go. Restarted: kept for _open_camera, so
            # ids and line counts go on.
            cam.events.close("removed" if clear_state else "restarted", clear=clear_state)
            if not clear_state:
                self._kept_events[name] = cam.events
        if clear_state and self.mqtt is not None:
            # An empty retained message deletes the topic: a removed camera must not stay "streaming".
            self.mqtt.publish(self.topics.camera_state(name), b"", qos=1, retain=True, kind="state")

    def _close_model(self, worker: ModelWorker, name: str) -> None:
        for cam_name in [c for c, cam in self.cameras.items() if cam.cfg.model == name]:
            self._close_camera(cam_name, clear_state=False)
        if not worker.stop(timeout=2.0):
            log.warning("model %s: worker did not stop in time", name)
        worker.close_backends()

    def _replace_mqtt(self, client: MqttClient | None, topics: Topics) -> None:
        old, self.mqtt, self.topics = self.mqtt, client, topics
        if old is not None:
            old.close()  # graceful: "offline" on the old status topic, then DISCONNECT
        if self.mqtt is not None:
            self.mqtt.start()
            for cam in self.cameras.values():
                self._publish_camera_state(cam)
                if cam.events is not None:
                    cam.events.publish_states()
            self.engines.republish()  # discovery configs follow in _reload_from_file

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
