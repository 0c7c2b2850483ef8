"""The daemon: wires config -> camera readers -> model workers -> sinks (MQTT, console, telemetry)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent import __version__
from agent.config import AgentConfig, CameraConfig, ConfigError, ModelConfig
from agent.lifecycle.calibration import FrameTap
from agent.lifecycle.manager import EngineManager
from agent.mqtt import MqttClient
from agent.results import ConsoleSink, detection_fields
from agent.telemetry import Metrics, RateCounter, StageWindow, build_telemetry, process_stats
from agent.topics import Topics, payload
from engines.plan import REQUESTABLE
from engines.runtimes.base import Backend
from pipelines.frames import stage_latencies_ms
from pipelines.models import make_adapter
from pipelines.postprocess import load_labels
from pipelines.scheduler import CameraRoute, ModelWorker, Result
from pipelines.sources import CameraReader, SourceSpec

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


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        console: bool | None = None,
        quiet_mqtt: bool = False,
    ) -> None:
        self.cfg = cfg
        self.started_at = time.time()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.topics = Topics(cfg.mqtt.prefix, cfg.device_id)
        self.stages = StageWindow()
        self.metrics = Metrics()
        self.labels: dict[str, list[str]] = {}
        self.workers: dict[str, ModelWorker] = {}
        self.cameras: dict[str, CameraRuntime] = {}
        self.mqtt: MqttClient | None = None
        self._quiet_mqtt = quiet_mqtt
        self._console = ConsoleSink(self.labels) if (cfg.console if console is None else console) else None
        self._telemetry_thread: threading.Thread | None = None
        self.taps: dict[str, FrameTap] = {}  # per model: frames for the gate, from the running pipeline
        self.engines = EngineManager(
            cfg, self._publish_engine, self._swap_backend, __version__, frames_for=self.taps.get
        )

    # ---- start -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        if cfg.mqtt.enabled:
            self.mqtt = MqttClient(
                topics=self.topics,
                host=cfg.mqtt.host,
                port=cfg.mqtt.port,
                username=cfg.mqtt.username,
                password=cfg.mqtt.read_password(),
                tls=cfg.mqtt.tls,
                keepalive=cfg.mqtt.keepalive,
                qos=cfg.mqtt.qos,
                offline_queue=cfg.mqtt.offline_queue,
                birth=self._status_fields,
                quiet=self._quiet_mqtt,
            )
        # Models first: a broken model is a start-up error, before any camera is opened.
        sinks = [self._publish_sink, self._telemetry_sink]
        if self._console is not None:
            sinks.append(self._console)
        for name, mcfg in cfg.models.items():
            self._open_model(name, mcfg, sinks)
        for cam_name, cam in cfg.cameras.items():
            if cam.enabled:
                self._open_camera(cam_name, cam)
        if self.mqtt is not None:
            self.mqtt.on_command("rebuild", self._cmd_rebuild)
            self.mqtt.start()
        self.engines.start()
        for worker in self.workers.values():
            worker.start()
        for cam in self.cameras.values():
            cam.reader.start()
        process_stats()  # primes psutil's CPU counter so the first telemetry has a real value
        if cfg.telemetry.prometheus_port:
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

    def _open_model(self, name: str, mcfg: ModelConfig, sinks: list) -> None:
        backend = self.engines.open(name)
        labels = load_labels(mcfg.labels) if mcfg.labels is not None else []
        self.labels[name] = labels
        adapter = make_adapter(mcfg.format, backend.input_spec, len(labels))
        self.taps[name] = FrameTap()
        self.workers[name] = ModelWorker(
            name,
            backend,
            adapter,
            [*sinks, self.taps[name]],
            iou_threshold=mcfg.iou_threshold,
            max_batch=mcfg.batch.max,
        )

    def _open_camera(self, name: str, cam: CameraConfig) -> None:
        worker = self.workers[cam.model]
        labels_src = str(self.cfg.models[cam.model].labels)
        mask = class_mask(name, cam, self.labels[cam.model], labels_src)
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
        reader = CameraReader(spec, slot, on_state=self._on_camera_state)
        self.cameras[name] = CameraRuntime(name, cam, reader)
        worker.add_camera(CameraRoute(name, slot, mask, cam.min_score))

    # ---- callbacks ---------------------------------------------------------------------------
    def _status_fields(self) -> dict:
        up = sum(1 for c in self.cameras.values() if c.state == "streaming")
        total = len(self.cameras)
        state = "offline" if self._stop.is_set() else ("online" if up == total else "degraded")
        return {
            "state": state,
            "version": __version__,
            "started_at": self.started_at,
            "cameras_up": up,
            "cameras_total": total,
        }

    def _on_camera_state(self, camera: str, state: str, reason: str | None) -> None:
        cam = self.cameras.get(camera)
        if cam is None:
            return
        with self._lock:
            changed = cam.state != state
            cam.state, cam.reason = state, reason
        level = logging.WARNING if state in ("reconnecting", "failed") else logging.INFO
        log.log(level, "camera %s: %s%s", camera, state, f" ({reason})" if reason else "")
        self._publish_camera_state(cam)
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
            last_error=cam.reader.last_error,
        )
        self.mqtt.publish(self.topics.camera_state(cam.name), body, qos=1, retain=True, kind="state")

    def _publish_status(self) -> None:
        if self.mqtt is not None:
            body = payload("status", **self._status_fields())
            self.mqtt.publish(self.topics.status, body, qos=1, retain=True, kind="state")

    def _publish_engine(self, model: str, fields: dict) -> None:
        if self.mqtt is None:
            return
        body = payload("engine", model=model, **fields)
        self.mqtt.publish(self.topics.engine(model), body, qos=1, retain=True, kind="state")

    def _swap_backend(self, model: str, backend: Backend) -> None:
        """Hot swap between two batches; cameras and slots stay as they are. The worker switches at the top
        of its next batch, logs "now served by", and closes the old backend once no batch uses it."""
        self.workers[model].swap_backend(backend)

    def _cmd_rebuild(self, args: dict) -> dict:
        """MQTT cmd/rebuild {model?, force?, precision?}: starts builds, answers at once; progress and
        the outcome follow on the engine state topics."""
        known = self.engines.models
        model = args.get("model")
        if model is not None and model not in known:
            raise ValueError(f"field 'model': unknown or not a TensorRT model {model!r} (known: {known})")
        force = args.get("force", False)
        if not isinstance(force, bool):
            raise ValueError("field 'force': must be true or false")
        precision = args.get("precision")
        if precision is not None and precision not in REQUESTABLE:
            raise ValueError(f"field 'precision': must be one of {', '.join(REQUESTABLE)}")
        unknown = sorted(set(args) - {"model", "force", "precision"})
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}")
        targets = [model] if model else known
        started = [m for m in targets if self.engines.rebuild(m, force=force, precision=precision)]
        busy = [m for m in targets if m not in started]
        return {"started": started, "already_building": busy}

    def _publish_sink(self, result: Result) -> None:
        result.frame.stamp("published")
        if self.mqtt is None:
            return
        fields = detection_fields(result, self.labels.get(result.model, []))
        body = payload("detections", **fields)
        self.mqtt.publish(self.topics.detections(result.frame.camera), body, kind="event")

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
        interval = self.cfg.telemetry.interval_s
        while not self._stop.wait(interval):
            try:
                self.publish_telemetry()
            except Exception:
                log.exception("telemetry failed")

    def telemetry_fields(self) -> dict:
        cams = {}
        for name, cam in self.cameras.items():
            frames_in = cam.reader.frames_in
            cam.fps_in.tick(frames_in - cam.last_frame_in)
            cam.last_frame_in = frames_in
            slot = self.workers[cam.cfg.model]._routes.get(name)
            cams[name] = {
                "state": cam.state,
                "fps_in": round(cam.fps_in.rate(), 2),
                "fps_out": round(cam.fps_out.rate(), 2),
                "dropped": slot.slot.dropped if slot else 0,
                # How stale the newest result is: grows when a camera or the model stalls.
                "frame_age_ms": None
                if cam.last_capture_ts is None
                else round((time.time() - cam.last_capture_ts) * 1000.0, 1),
            }
        fills = [w.batch_fill_sum / w.batches for w in self.workers.values() if w.batches]
        backends = {name: w.backend.name for name, w in self.workers.items()}
        return build_telemetry(
            cameras=cams,
            stages=self.stages.summary(),
            backend=backends,
            batch_fill=round(float(np.mean(fills)), 3) if fills else None,
            process=process_stats(),
            mqtt=self.mqtt.stats() if self.mqtt else None,
        )

    def publish_telemetry(self) -> None:
        fields = self.telemetry_fields()
        self.metrics.update(fields)
        if self.mqtt is not None:
            self.mqtt.publish(self.topics.telemetry, payload("telemetry", **fields), qos=0, kind="event")
            for cam in self.cameras.values():
                self._publish_camera_state(cam)

    # ---- stop --------------------------------------------------------------------------------
    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run_forever(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        try:
            while not self._stop.wait(0.5):
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        t0 = time.monotonic()
        for cam in self.cameras.values():
            cam.reader.request_stop()  # signal only; joined below so slow cameras stop in parallel
        for worker in self.workers.values():
            worker.stop(timeout=2.0)
        self.engines.close()
        for cam in self.cameras.values():
            cam.reader.join(timeout=max(0.1, 3.0 - (time.monotonic() - t0)))
        for worker in self.workers.values():
            worker.close_backends()  # leaves (and logs) a backend whose worker thread did not stop
        if self.mqtt is not None:
            self.mqtt.close()
        log.info("edge-agent stopped in %.2f s", time.monotonic() - t0)
