"""Batching scheduler: latest frames of several cameras -> one batch -> backend -> per-camera results.

One worker thread per model. Frames never queue up: each camera has a latest-frame-wins slot, and
the worker takes at most one frame per camera per batch, so a slow model drops frames (counted by
the slot) instead of building a backlog.

Hot swap: ``swap_backend`` only files the new backend as *pending*; the worker thread switches to it at the
top of its next batch and then closes the old one itself, so a backend is never closed while a batch runs
on it (with TensorRT that would be a use-after-free of device buffers). A pending backend that is replaced
by a newer one before the worker took it was never used and is closed at once; ``stop`` closes a backend
still pending, ``close_backends`` the serving one once the worker thread has ended.
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
    gpu_ms: float | None = None  # device time of the batch, where the backend measures it (TensorRT)


Sink = Callable[[Result], None]
# on_swapped(model, old, new): called on the worker thread right after it switched, before `old` is closed.
SwapCallback = Callable[[str, Backend, Backend], None]


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
        on_swapped: SwapCallback | None = None,
    ) -> None:
        self.model = model
        self._backend = backend
        self._adapter = adapter
        self._sinks = list(sinks)
        self._iou = iou_threshold
        self._max_batch = max_batch
        self._batch_wait_s = batch_wait_s
        self._on_error = on_error
        self._on_swapped = on_swapped
        self._routes: dict[str, CameraRoute] = {}
        self._routes_lock = threading.Lock()
        # Guards _backend/_adapter (written only by the worker thread, at a switch), the pending pair and
        # _closed. Backends are closed outside it, and only once nobody can reach them any more.
        self._swap_lock = threading.Lock()
        self._pending: tuple[Backend, ModelAdapter | None] | None = None
        self._closed = False  # close_backends() ran: a swap arriving later is closed, not filed
        self.swaps = 0  # switches the worker made
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
        """The backend serving batches now (a pending one serves from the next batch on)."""
        with self._swap_lock:
            return self._backend

    def swap_backend(self, backend: Backend, adapter: ModelAdapter | None = None) -> None:
        """File a loaded backend (and optionally its adapter) to serve from the next batch on.

        Returns at once; the worker thread switches at the top of its next batch and closes the old
        backend itself. A still-pending backend that this call replaces was never used and is closed here.
        ``adapter=None`` keeps the adapter in effect (that of a replaced pending swap, if it brought one).
        The caller hands ``backend`` over: the worker closes it when it is replaced or at close_backends().
        """
        replaced: Backend | None = None
        with self._swap_lock:
            if self._closed:
                if backend is not self._backend:
                    replaced = backend  # the worker is gone: nothing will ever serve with it
            else:
                if self._pending is not None:
                    prev, prev_adapter = self._pending
                    if adapter is None:
                        adapter = prev_adapter
                    if prev is not backend and prev is not self._backend:
                        replaced = prev
                self._pending = (backend, adapter)
        if replaced is not None:
            why = "worker already closed" if replaced is backend else "replaced before it served"
            _close_quietly(self.model, replaced, why)

    @property
    def batch_limit(self) -> int:
        """Batch limit of the backend that serves the next batch (the pending one, if any)."""
        with self._swap_lock:
            # Under the lock: neither backend can be switched out, let alone closed, while we ask it.
            backend = self._pending[0] if self._pending is not None else self._backend
            return self._limit_of(backend)

    def _limit_of(self, backend: Backend) -> int:
        limit = backend.max_batch
        return min(limit, self._max_batch) if self._max_batch else limit

    def _switch_if_pending(self) -> tuple[Backend, ModelAdapter]:
        """Worker thread, between batches: adopt a pending backend and close the old one. Returns the
        backend and adapter that serve the coming batch."""
        with self._swap_lock:
            pending, self._pending = self._pending, None
            old = self._backend
            if pending is not None:
                self._backend = pending[0]
                if pending[1] is not None:
                    self._adapter = pending[1]
            backend, adapter = self._backend, self._adapter
        if pending is None or backend is old:
            return backend, adapter
        self.swaps += 1
        log.info(
            "model %s: now served by %s (%s), was %s (%s)",
            self.model,
            backend.name,
            backend.precision,
            old.name,
            old.precision,
        )
        if self._on_swapped is not None:
            try:
                self._on_swapped(self.model, old, backend)
            except Exception:
                log.exception("model %s: on_swapped callback failed", self.model)
        # No batch runs on `old` any more: this thread was its only user and is between batches.
        _close_quietly(self.model, old, "swapped out")
        return backend, adapter

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"model-{self.model}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> bool:
        """Stop the worker thread; close a backend still pending (it never served). The serving backend
        stays open: close it with close_backends(). Returns False if the thread did not end in time."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_pending()
        return not self.running

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _close_pending(self) -> None:
        # Taken out under the lock, so the worker can no longer adopt it, even if it is still running.
        with self._swap_lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not self._backend:
            _close_quietly(self.model, pending[0], "pending at stop")

    def close_backends(self) -> bool:
        """After stop(): close the pending and the serving backend; later swaps are closed on arrival.

        If the worker thread is still running (stop timed out) the serving backend may still be in use: it
        is left open and logged instead. Returns True when everything is closed. Idempotent."""
        self._close_pending()
        if self.running:
            log.error(
                "model %s: worker thread still running after stop; leaving backend %s open",
                self.model,
                self._backend.name,
            )
            return False
        with self._swap_lock:
            if self._closed:
                return True
            self._closed = True
            backend = self._backend
        _close_quietly(self.model, backend, "worker stopped")
        return True

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
        woke = self.wake.wait(timeout)
        # Top of a batch (or an idle tick): the only place the serving backend changes.
        backend, adapter = self._switch_if_pending()
        if not woke:
            return 0
        self.wake.clear()
        limit = self._limit_of(backend)
        batch = self._collect(limit)
        if not batch:
            return 0
        # A short wait lets frames of the other cameras join a partly filled batch.
        if len(batch) < min(limit, len(self._routes)) and self._batch_wait_s > 0:
            time.sleep(self._batch_wait_s)
            batch += self._collect(limit - len(batch), frozenset(r.name for r, _ in batch))
        if len(batch) >= limit:
            self.wake.set()  # other cameras may still hold frames: come back for them at once
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
        self.batch_fill_sum += len(frames) / max(1, limit)
        for (route, frame), d in zip(batch, dets, strict=True):
            result = Result(
                frame=frame,
                detections=filter_detections(d, route.class_mask, route.min_score),
                model=self.model,
                backend=backend.name,
                precision=backend.precision,
                batch_size=len(frames),
                gpu_ms=backend.last_gpu_ms,
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


def _close_quietly(model: str, backend: Backend, why: str) -> None:
    """Close a backend nobody uses any more; a failure is logged, never raised into the worker loop."""
    try:
        backend.close()
    except Exception:
        log.exception("model %s: closing backend %s (%s) failed", model, backend.name, why)
    else:
        log.debug("model %s: closed backend %s (%s)", model, backend.name, why)


def _stamp_all(frames: list[Frame], stage: str) -> None:
    now = time.monotonic()
    for f in frames:
        f.stamps[stage] = now
