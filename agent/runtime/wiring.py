"""Building the pipeline of one process: a worker per model over the backend the engine lifecycle serves,
a reader per camera into its model's worker, and each camera's analytics (agent.events) on its route.

Opening checks everything that can fail before anything is registered, so a failed open leaves no trace
(start-up errors, and the reload transaction's undo, rely on that). Closing is the reverse: a camera's
route goes first (none of its results reaches a sink afterwards), then its reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from agent.config import AgentConfig, CameraConfig, ConfigError, ModelConfig
from agent.config.reader import camera_reader, source_spec
from agent.events import CameraEvents, Publisher, analytics_settings, track_floor
from agent.mqtt.topics import Topics
from agent.runtime.cameras import CameraRuntime, class_mask
from engines.errors import EngineError
from engines.runtimes.base import Backend
from pipelines.models import ModelSpec, check_outputs, probe_input
from pipelines.scheduler import CameraRoute, ModelWorker, Sink

if TYPE_CHECKING:
    from pipelines.preprocess_gpu import GpuLetterbox

log = logging.getLogger("agent.daemon")  # its lines keep the name they had (journald, greps)

CameraStateCallback = Callable[[str, str, "str | None"], None]


def _gpu_preprocess(model: str) -> GpuLetterbox:
    """models.M.preprocess: gpu, or a start-up error saying why it cannot be."""
    from pipelines.preprocess_gpu import GpuLetterbox  # CUDA only where asked for

    try:
        return GpuLetterbox()
    except EngineError as exc:
        raise ConfigError(f"models.{model}.preprocess: gpu is not available here: {exc}") from None


class Pipeline:
    """The model workers, camera readers and analytics of this process (``labels``, ``workers`` and
    ``cameras`` by name). Workers and readers are made here, started by the caller."""

    def __init__(
        self, on_camera_state: CameraStateCallback, events_out: Publisher, first_id: int = 1
    ) -> None:
        self._on_camera_state = on_camera_state
        self._events_out = events_out
        self._first_id = first_id  # where a camera's track ids start (a shard's start: agent.shards.tracks)
        # Per camera, where its next analytics' ids start: above every id it had in this process (removed and
        # added again, tracking off and on) or where the shard supervisor says (raise_first_ids).
        self._next_ids: dict[str, int] = {}
        self.labels: dict[str, list[str]] = {}
        self.workers: dict[str, ModelWorker] = {}
        self.cameras: dict[str, CameraRuntime] = {}
        self._kept_events: dict[str, CameraEvents] = {}  # of cameras closed to be reopened (reload)

    # ---- models ----------------------------------------------------------------------------------------
    def open_model(
        self,
        name: str,
        mcfg: ModelConfig,
        spec: ModelSpec,
        open_backend: Callable[[], Backend],
        sinks_for: Callable[[str], Sequence[Sink]],
    ) -> None:
        """Make a model's (not yet started) worker over the backend `open_backend()` gives (the engine
        lifecycle's), closed here when the model cannot serve with it. `spec`: the resolved model (labels,
        host or graph decoding). `sinks_for(name)`: the worker's sinks, asked once the model fits."""
        labels = list(spec.labels)
        backend = open_backend()
        try:
            adapter = spec.adapter()
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
        self.workers[name] = ModelWorker(
            name,
            backend,
            adapter,
            sinks_for(name),
            iou_threshold=mcfg.iou_threshold,
            max_batch=mcfg.batch.max,
            max_age_ms=mcfg.max_age_ms,
            gpu_preprocess=gpu,
        )

    def close_model(self, worker: ModelWorker, name: str) -> None:
        """Stop a model's worker (already out of ``workers`` or about to be replaced) and its cameras."""
        for cam_name in [c for c, cam in self.cameras.items() if cam.cfg.model == name]:
            self.close_camera(cam_name, clear_state=False)
        if not worker.stop(timeout=2.0):
            log.warning("model %s: worker did not stop in time", name)
        worker.close_backends()

    def swap_backend(self, model: str, backend: Backend) -> None:
        """Hot swap between two batches; cameras and slots stay as they are. The worker switches at the top
        of its next batch, logs "now served by", and closes the old backend once no batch uses it."""
        self.workers[model].swap_backend(backend)

    # ---- cameras ---------------------------------------------------------------------------------------
    def check_camera(self, name: str, cam: CameraConfig, cfg: AgentConfig) -> None:
        """Raise ConfigError where `cam` does not fit the labels its model has now (classes, zones, lines)."""
        labels, labels_src = self.labels[cam.model], str(cfg.models[cam.model].labels)
        class_mask(name, cam, labels, labels_src)
        if cam.tracking.enabled:  # zone and line labels against the model's labels
            analytics_settings(name, cam, labels, labels_src)

    def open_camera(
        self, name: str, cam: CameraConfig, cfg: AgentConfig, events: CameraEvents | None = None
    ) -> None:
        """A camera's reader (not yet started) and route. ``events``: a restarted camera's analytics, kept
        (counts and ids go on) and reconfigured."""
        worker = self.workers[cam.model]
        labels, labels_src = self.labels[cam.model], str(cfg.models[cam.model].labels)
        mask = class_mask(name, cam, labels, labels_src)
        events = self._analytics(name, cam, cfg, events or self._kept_events.pop(name, None))
        slot = worker.new_slot()
        reader = camera_reader(source_spec(name, cam), cam, slot, self._on_camera_state)
        self.cameras[name] = CameraRuntime(name, cam, reader, events=events)
        worker.add_camera(CameraRoute(name, slot, mask, track_floor(cam), analytics=events))

    def reroute(self, name: str, cam: CameraConfig, cfg: AgentConfig) -> None:
        """A running camera's route (classes, min_score) and analytics (tracking, zones, lines, events,
        publish) in place; its reader keeps streaming."""
        runtime = self.cameras[name]
        mask = class_mask(name, cam, self.labels[cam.model], str(cfg.models[cam.model].labels))
        fresh = runtime.events is None
        events = self._analytics(name, cam, cfg, runtime.events)
        if fresh and events is not None:
            events.publish_states()
        worker = self.workers[cam.model]
        route = worker.route(name)
        if route is not None:
            worker.add_camera(CameraRoute(name, route.slot, mask, track_floor(cam), analytics=events))
        runtime.cfg, runtime.events = cam, events

    def _analytics(
        self, name: str, cam: CameraConfig, cfg: AgentConfig, events: CameraEvents | None
    ) -> CameraEvents | None:
        """The camera's analytics for `cam`: `events` (kept) reconfigured, new ones, or none (closed)."""
        labels, labels_src = self.labels[cam.model], str(cfg.models[cam.model].labels)
        if not cam.tracking.enabled:
            if events is not None:
                events.close("reconfigured", clear=True)
                self._ids_used(name, events)
            return None
        if events is None:
            first = max(self._first_id, self._next_ids.get(name, 1))
            return CameraEvents(name, cam, labels, labels_src, self._events_out, first_id=first)
        events.reconfigure(cam, labels, labels_src)
        return events

    def close_camera(self, name: str, clear_state: bool) -> None:
        """Removed (`clear_state`): its tracks end and its zone/line states go. Otherwise (restarted): its
        analytics are kept for open_camera, so ids and line counts go on."""
        cam = self.cameras.pop(name)
        worker = self.workers.get(cam.cfg.model)
        if worker is not None:
            worker.remove_camera(name)
        if not cam.reader.stop():
            log.warning("camera %s: reader did not stop in time; left to end on its own", name)
        if cam.events is not None:
            cam.events.close("removed" if clear_state else "restarted", clear=clear_state)
            if not clear_state:
                self._kept_events[name] = cam.events
            else:
                self._ids_used(name, cam.events)

    def raise_first_ids(self, first_ids: Mapping[str, int]) -> None:
        """Cameras' next analytics start their ids at least here (a shard's supervisor hands them over:
        agent.shards.tracks.TrackEpochs); ids already used in this process stay above."""
        for name, first in first_ids.items():
            self._next_ids[name] = max(self._next_ids.get(name, 1), first)

    def _ids_used(self, name: str, events: CameraEvents) -> None:
        """A camera's analytics went: its next ones go on above its ids (DESIGN: never reused in a run)."""
        self._next_ids[name] = max(self._next_ids.get(name, 1), events.analytics.tracker.next_id)

    def region_topics(self, topics: Topics) -> set[str]:
        """The zone and line state topics the cameras publish now."""
        live: set[str] = set()
        for cam in list(self.cameras.values()):
            if cam.events is not None:
                live |= cam.events.region_topics(topics)
        return live
