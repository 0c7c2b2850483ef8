"""Batching scheduler: latest frames of several cameras -> one batch -> backend -> per-camera results.

One worker thread per model. Frames never queue up: each camera has a latest-frame-wins slot, and
the worker takes at most one frame per camera per batch, so a slow model drops frames (counted by
the slot) instead of building a backlog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engines.runtimes.base import Backend
from pipelines.frames import Detections, Frame
from pipelines.models.base import ModelAdapter
from pipelines.postprocess import filter_detections
from pipelines.sources import FrameSlot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Result:
    frame: Frame
    detections: Detections
    model: str
    backend: str
    precision: str
    batch_size: int


Sink = Callable[[Result], None]


class NotifyingSlot(FrameSlot):
    """A FrameSlot that also wakes the scheduler that reads it."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._wake = wake

    def put(self, frame: Frame) -> None:
        super().put(frame)
        self._wake.set()


@dataclass
class CameraRoute:
    name: str
    slot: FrameSlot
    class_mask: np.ndarray | None  # bool per class id; None keeps every class
    min_score: float


class ModelWorker:
    """Runs one model over the frames of the cameras routed to it."""

    def __init__(
        self,
        model: str,
        backend: Backend,
        adapter: ModelAdapter,
        sinks: Sequence[Sink],
        *,
        iou_threshold: float = 0.5,
        max_batch: int | None = None,
        batch_wait_s: float = 0.004,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self._backend = backend
        self._adapter = adapter
        self._sinks = list(sinks)
        self._iou = iou_threshold
        self._max_batch = max_batch
        self._batch_wait_s = batch_wait_s
        self._on_error = on_error
        self._routes: dict[str, CameraRoute] = {}
        self._routes_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rr = 0  # round-robin start, so cameras beyond max_batch are not starved
        self.batches = 0
        self.frames = 0
        self.batch_fill_sum = 0.0

    # -- routing ---------------------------------------------------------------------------
    def new_slot(self) -> FrameSlot:
        return NotifyingSlot(self.wake)

    def add_camera(self, route: CameraRoute) -> None:
        with self._routes_lock:
            self._routes[route.name] = route

    def remove_camera(self, name: str) -> None:
        with self._routes_lock:
            self._routes.pop(name, None)

    @property
    def backend(self) -> Backend:
        return self._backend

    def swap_backend(self, backend: Backend, adapter: ModelAdapter | None = None) -> Backend:
        """Switch to another (loaded) backend between batches; returns the old one to close."""
        with self._swap_lock:
            old, self._backend = self._backend, backend
            if adapter is not None:
                self._adapter = adapter
        return old

    @property
    def batch_limit(self) -> int:
        limit = self._backend.max_batch
        return min(limit, self._max_batch) if self._max_batch else limit

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"model-{self.model}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- work ------------------------------------------------------------------------------
    def _collect(self, limit: int, exclude: frozenset[str] = frozenset()) -> list[tuple[CameraRoute, Frame]]:
        with self._routes_lock:
            routes = [r for r in self._routes.values() if r.name not in exclude]
        if not routes or limit <= 0:
            return []
        n = len(routes)
        start = self._rr % n
        batch: list[tuple[CameraRoute, Frame]] = []
        for i in range(n):
            route = routes[(start + i) % n]
            frame = route.slot.get(timeout=0)
            if frame is not None:
                batch.append((route, frame))
                if len(batch) >= limit:
                    break
        self._rr = (start + len(batch)) % n if batch else start
        return batch

    def run_once(self, timeout: float = 0.5) -> int:
        """Wait for frames, run one batch through the model, hand results to sinks. Returns frames done."""
        if not self.wake.wait(timeout):
            return 0
        self.wake.clear()
        limit = self.batch_limit
        batch = self._collect(limit)
        if not batch:
            return 0
        # A short wait lets frames of the other cameras join a partly filled batch.
        if len(batch) < min(limit, len(self._routes)) and self._batch_wait_s > 0:
            time.sleep(self._batch_wait_s)
            batch += self._collect(limit - len(batch), frozenset(r.name for r, _ in batch))
        if len(batch) >= limit:
            self.wake.set()  # other cameras may still hold frames: come back for them at once
        with self._swap_lock:
            backend, adapter = self._backend, self._adapter
        frames = [f for _, f in batch]
        for f in frames:
            f.stamp("dequeued")
        tensor, boxes = adapter.preprocess([f.image for f in frames])
        _stamp_all(frames, "preprocessed")
        outputs = backend.infer(tensor)
        _stamp_all(frames, "inferred")
        min_score = min(r.min_score for r, _ in batch)
        dets = adapter.postprocess(outputs, boxes, score_threshold=min_score, iou_threshold=self._iou)
        _stamp_all(frames, "postprocessed")
        self.batches += 1
        self.frames += len(frames)
        self.batch_fill_sum += len(frames) / max(1, self.batch_limit)
        for (route, frame), d in zip(batch, dets, strict=True):
            result = Result(
                frame=frame,
                detections=filter_detections(d, route.class_mask, route.min_score),
                model=self.model,
                backend=backend.name,
                precision=backend.precision,
                batch_size=len(frames),
            )
            for sink in self._sinks:
                try:
                    sink(result)
                except Exception:  # a failing sink must not stop detection for the others
                    log.exception("sink %r failed for camera %s", sink, route.name)
        return len(frames)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as exc:
                log.exception("model %s: batch failed", self.model)
                if self._on_error is not None:
                    self._on_error(self.model, exc)
                self._stop.wait(0.5)  # do not spin on a persistent failure


def _stamp_all(frames: list[Frame], stage: str) -> None:
    now = time.monotonic()
    for f in frames:
        f.stamps[stage] = now
