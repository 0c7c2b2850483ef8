"""Batching scheduler: latest frames of several cameras -> batches -> backend -> per-camera results.

One ModelWorker per model runs a three-stage pipeline, so the engine does not wait for Python work:

    batcher    (thread model-M)          take frames (fair round robin; too old ones dropped), preprocess,
                                          wait for a free execution slot, hand the batch over
    inference  (threads model-M-infer-i)  backend.infer; up to backend.slots batches at once
    delivery   (thread model-M-out)       in hand-over order: postprocess, per-camera filter, the camera's
                                          analytics (CameraRoute.analytics: tracking, zones, lines), sinks

While batch k is inferred, batch k+1 is preprocessed and batch k-1 postprocessed; the frames of batch k+1
are taken just in time (shortly before batch k is expected to end), so they do not wait a whole inference
in the pipeline. Batches are delivered in the order they were formed, so each camera's results arrive in
capture order even when execution slots finish out of order. Frames never queue up: each camera has a
latest-frame-wins slot and gives at most one frame per batch, and at most slots + 2 batches exist at once
(one being prepared, up to slots + 1 handed over and not yet delivered), so a slow model drops frames
(counted by the slot) instead of building a backlog.

Its parts: pipelines.routes (the cameras, the fair take of their frames, stale ones dropped),
pipelines.inflight (the batches between the stages), pipelines.serving (the serving backend and its hot
swap: the batcher switches at the top of a batch, and a backend is never closed while a batch runs on it).

Cameras come and go while it runs: after ``remove_camera`` returns, no result of that camera reaches a sink
(a delivery in progress finishes first; later ones skip it).

``run_once`` runs one batch through every stage on the calling thread (tests, step-by-step benchmarks).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engines.runtimes.base import Backend, Batch
from pipelines.analytics import Analysis
from pipelines.frames import Detections, DeviceImage, Frame, host_image
from pipelines.inflight import BatchInFlight, InFlight
from pipelines.models.base import ModelAdapter
from pipelines.postprocess import filter_detections
from pipelines.preprocess import Letterbox
from pipelines.routes import CameraRoute, NotifyingSlot, Routes
from pipelines.serving import Serving, SwapCallback
from pipelines.sources import FrameSlot

if TYPE_CHECKING:
    from pipelines.preprocess_gpu import GpuLetterbox

log = logging.getLogger(__name__)

_ERROR_PAUSE_S = 0.5  # after a failed batch: do not spin on a persistent failure


@dataclass(slots=True)
class Result:
    frame: Frame
    detections: Detections
    model: str
    backend: str
    precision: str
    batch_size: int
    gpu_ms: float | None = None  # device time of the batch, where the backend measures it (TensorRT)
    # The camera's tracking, zones and lines for this frame (CameraRoute.analytics), else None.
    analysis: Analysis | None = None


Sink = Callable[[Result], None]


class ModelWorker:
    """Runs one model over the frames of the cameras routed to it.

    Counters (monotonic, written by the delivery thread): ``batches``, ``frames`` (frames that completed
    inference and postprocessing and went to the sinks: the progress a watchdog can watch),
    ``batch_fill_sum``, ``swaps``; ``stale`` (frames dropped as too old, also per route); ``last_tick``
    (time.monotonic() of the batcher's latest round, idle or not).
    """

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
        max_age_ms: float = 0.0,
        gpu_preprocess: GpuLetterbox | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
        on_swapped: SwapCallback | None = None,
    ) -> None:
        """``max_age_ms``: drop frames older than this when taken (0: never; the daemon passes
        ``models.M.max_age_ms``). ``gpu_preprocess``: letterbox on the GPU into device memory whenever the
        serving backend takes device input (the worker closes it in close_backends)."""
        self.model = model
        self._serving = Serving(model, backend, adapter, max_batch, on_swapped)
        self._routes = Routes(model, max_age_ms)
        self._sinks = list(sinks)
        self._iou = iou_threshold
        self._batch_wait_s = batch_wait_s
        self._gpu = gpu_preprocess
        self._gpu_refused_by: Backend | None = None  # the backend we last said cannot take device input
        self._on_error = on_error
        self.errors = 0
        # Held while results go to the sinks: remove_camera waits for it, so none follows its return.
        self._deliver_lock = threading.RLock()
        self._stop = threading.Event()
        self._flight = InFlight(self._stop)
        self._infer_queue: queue.SimpleQueue[BatchInFlight | None] = queue.SimpleQueue()
        self._infer_threads: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        self.wake = threading.Event()
        self._error_at = -math.inf
        self.batches = 0
        self.frames = 0
        self.batch_fill_sum = 0.0
        # Host CPU seconds of the stages (time.thread_time() around each, ~1 us a call): for the benchmark.
        self.cpu_s = {"preprocess": 0.0, "postprocess": 0.0, "publish": 0.0}
        self.last_tick = time.monotonic()

    @property
    def swaps(self) -> int:
        """Switches the batcher made to a swapped-in backend."""
        return self._serving.swaps

    @property
    def stale(self) -> int:
        """Frames dropped as too old when taken, all cameras together."""
        return self._routes.stale

    # -- routing ---------------------------------------------------------------------------
    def new_slot(self) -> FrameSlot:
        return NotifyingSlot(self.wake)

    def add_camera(self, route: CameraRoute) -> None:
        self._routes.add(route)

    def remove_camera(self, name: str) -> None:
        """Stop serving a camera; once this returns, none of its results reaches a sink (safe while running,
        also from inside a sink)."""
        self._routes.remove(name)
        with self._deliver_lock:  # a delivery under way finishes; later ones no longer find the route
            pass

    def route(self, name: str) -> CameraRoute | None:
        return self._routes.get(name)

    @property
    def backend(self) -> Backend:
        """The backend serving batches now (a pending one serves from the next batch on)."""
        return self._serving.backend

    def swap_backend(self, backend: Backend, adapter: ModelAdapter | None = None) -> None:
        """File a loaded backend (and optionally its adapter) to serve from the next batch on; returns at
        once (pipelines.serving: when the batcher switches, what is closed; ``adapter=None`` keeps the one in
        effect). The caller hands ``backend`` over: the worker closes it when replaced or at close_backends().
        """
        self._serving.file(backend, adapter)
        self.wake.set()  # an idle batcher switches now rather than at the next frame

    @property
    def batch_limit(self) -> int:
        """Batch limit of the backend that serves the next batch (the pending one, if any)."""
        return self._serving.next_limit()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._batch_loop, name=f"model-{self.model}", daemon=True),
            threading.Thread(target=self._deliver_loop, name=f"model-{self.model}-out", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 3.0) -> bool:
        """Stop taking frames; batches already handed over still finish and are delivered. Closes a backend
        still pending (it never served); the serving one stays open: close it with close_backends().
        Returns False if the worker's threads did not end within `timeout`."""
        self._stop.set()
        self.wake.set()
        self._flight.wake()
        deadline = time.monotonic() + timeout
        for t in self._threads + self._infer_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._serving.close_pending()
        return not self.running

    @property
    def running(self) -> bool:
        """Any of the worker's threads still alive (a batch may still run on the serving backend)."""
        return any(t.is_alive() for t in self._threads + self._infer_threads)

    def close_backends(self) -> bool:
        """After stop(): close the pending and the serving backend (and the GPU preprocessing buffers);
        later swaps are closed on arrival.

        If a worker thread is still running (stop timed out) the serving backend may still be in use: it
        is left open and logged instead. Returns True when everything is closed. Idempotent."""
        self._serving.close_pending()
        if self.running:
            log.error(
                "model %s: worker thread still running after stop; leaving backend %s open",
                self.model,
                self._serving.backend.name,
            )
            return False
        if self._serving.close() and self._gpu is not None:
            self._gpu.close()
        return True

    # -- stage 1: the batcher ----------------------------------------------------------------
    def _batch_loop(self) -> None:
        try:
            while not self._stop.is_set():
                pause = self._error_at + _ERROR_PAUSE_S - time.monotonic()
                if pause > 0:
                    self._stop.wait(pause)
                    continue
                try:
                    batch = self._next_batch(timeout=0.5)
                    if batch is not None:
                        self._hand_over(batch)
                except Exception as exc:
                    self._report(exc)
        finally:
            self._flight.batcher_ended()
            for _ in self._infer_threads:
                self._infer_queue.put(None)  # after every batch handed over: those still finish

    def _next_batch(self, timeout: float) -> BatchInFlight | None:
        """Wait for frames, take a fair batch of fresh ones and preprocess it (None: nothing to do)."""
        woke = self.wake.wait(timeout)
        self.last_tick = time.monotonic()
        # Top of a batch (or an idle tick): the only place the serving backend changes.
        backend, adapter = self._serving.switch(self._flight.drained)
        if not woke or self._stop.is_set():
            return None
        self._flight.wait_until_worth_preparing(backend.slots)
        self.wake.clear()
        limit = self._serving.limit_of(backend)
        items = self._routes.take(limit)
        if not items:
            return None
        # A short wait lets frames of the other live cameras join a partly filled batch.
        if self._batch_wait_s > 0 and len(items) < min(limit, self._routes.live()):
            time.sleep(self._batch_wait_s)
            items += self._routes.take(limit - len(items), frozenset(r.name for r, _ in items))
        if len(items) >= limit:
            self.wake.set()  # other cameras may still hold frames: come back for them at once
        frames = [f for _, f in items]
        _stamp_all(frames, "dequeued")
        c0 = time.thread_time()
        tensor, boxes, release = self._preprocess(backend, adapter, [f.image for f in frames])
        self.cpu_s["preprocess"] += time.thread_time() - c0
        _stamp_all(frames, "preprocessed")
        self._flight.preprocessed(frames[0].stamps["preprocessed"] - frames[0].stamps["dequeued"])
        return BatchInFlight(items, backend, adapter, limit, tensor, boxes, release)

    def _preprocess(
        self, backend: Backend, adapter: ModelAdapter, images: list[np.ndarray | DeviceImage]
    ) -> tuple[Batch, list[Letterbox], Callable[[], None] | None]:
        if self._gpu is not None:
            if backend.accepts_device_input:
                return self._gpu.preprocess(images, adapter.normalisation)
            if self._gpu_refused_by is not backend:
                self._gpu_refused_by = backend
                log.warning(
                    "model %s: GPU preprocessing needs a backend that takes device input; %s takes host "
                    "arrays, so frames are preprocessed on the CPU while it serves",
                    self.model,
                    backend.name,
                )
        # NVDEC pictures meet the CPU path only here (GPU preprocessing off, or a host-only backend).
        tensor, boxes = adapter.preprocess([host_image(i) for i in images])
        return tensor, boxes, None

    def _hand_over(self, batch: BatchInFlight) -> None:
        """Wait for a free execution slot (and room before delivery), then queue the batch for inference."""
        if not self._flight.admit(batch):
            if batch.release is not None:
                batch.release()
            return
        _stamp_all(batch.frames, "submitted")
        slots = batch.backend.slots
        while len(self._infer_threads) < slots:  # one thread per slot; a larger backend gets more
            name = f"model-{self.model}-infer-{len(self._infer_threads)}"
            t = threading.Thread(target=self._infer_loop, name=name, daemon=True)
            self._infer_threads.append(t)
            t.start()
        self._infer_queue.put(batch)

    # -- stage 2: inference ------------------------------------------------------------------
    def _infer_loop(self) -> None:
        while (batch := self._infer_queue.get()) is not None:
            self._infer(batch)
            self._flight.inferred(batch)

    def _infer(self, batch: BatchInFlight) -> None:
        try:
            batch.outputs = batch.backend.infer(batch.tensor)
            batch.gpu_ms = batch.backend.last_gpu_ms  # this thread's batch (per-thread value)
        except Exception as exc:
            batch.error = exc
        finally:
            if batch.release is not None:
                batch.release()
        _stamp_all(batch.frames, "inferred")

    # -- stage 3: delivery -------------------------------------------------------------------
    def _deliver_loop(self) -> None:
        while (batch := self._flight.next_to_deliver()) is not None:
            if batch.error is not None:
                self._report(batch.error)
                continue
            try:
                self._deliver(batch)
            except Exception as exc:
                self._report(exc)

    def _deliver(self, batch: BatchInFlight) -> int:
        assert batch.outputs is not None
        frames = batch.frames
        min_score = min(r.min_score for r, _ in batch.items)
        c0 = time.thread_time()
        dets = batch.adapter.postprocess(
            batch.outputs, batch.letterboxes, score_threshold=min_score, iou_threshold=self._iou
        )
        c1 = time.thread_time()
        self.cpu_s["postprocess"] += c1 - c0
        _stamp_all(frames, "postprocessed")
        self.batches += 1
        self.frames += len(frames)
        self.batch_fill_sum += len(frames) / max(1, batch.limit)
        backend = batch.backend
        with self._deliver_lock:
            routes = self._routes.current()
            for (route, frame), d in zip(batch.items, dets, strict=True):
                if routes.get(route.name) is not route:
                    continue  # removed (or replaced) while its frame was in flight
                kept = filter_detections(d, route.class_mask, route.min_score)
                analysis = None
                if route.analytics is not None:
                    try:
                        analysis = route.analytics(frame, kept)
                        kept = analysis.detections
                    except Exception:  # the hook reports its own failures; this is the last resort
                        log.exception("camera %s: analytics failed", route.name)
                result = Result(
                    frame=frame,
                    detections=kept,
                    model=self.model,
                    backend=backend.name,
                    precision=backend.precision,
                    batch_size=len(frames),
                    gpu_ms=batch.gpu_ms,
                    analysis=analysis,
                )
                for sink in self._sinks:
                    try:
                        sink(result)
                    except Exception:  # a failing sink must not stop detection for the others
                        log.exception("sink %r failed for camera %s", sink, route.name)
        self.cpu_s["publish"] += time.thread_time() - c1
        return len(frames)

    # -- synchronous ---------------------------------------------------------------------------
    def run_once(self, timeout: float = 0.5) -> int:
        """Wait for frames and run one batch through every stage on the calling thread; returns the frames
        delivered. A failed batch raises."""
        batch = self._next_batch(timeout)
        if batch is None:
            return 0
        _stamp_all(batch.frames, "submitted")
        self._infer(batch)
        if batch.error is not None:
            raise batch.error
        return self._deliver(batch)

    # -- helpers -------------------------------------------------------------------------------
    def _report(self, exc: BaseException) -> None:
        log.error("model %s: batch failed", self.model, exc_info=exc)
        self._error_at = time.monotonic()
        self.errors += 1  # counted since start (a deployment's watch rolls back when it grows)
        if self._on_error is not None:
            self._on_error(self.model, exc)


def _stamp_all(frames: list[Frame], stage: str) -> None:
    now = time.monotonic()
    for f in frames:
        f.stamps[stage] = now
