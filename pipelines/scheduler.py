"""Batching scheduler: latest frames of several cameras -> batches -> backend -> per-camera results.

One ModelWorker per model runs a three-stage pipeline, so the engine does not wait for Python work:

    batcher    (thread model-M)          take frames (fair round robin; too old ones dropped), preprocess,
                                          wait for a free execution slot, hand the batch over
    inference  (threads model-M-infer-i)  backend.infer; up to backend.slots batches at once
    delivery   (thread model-M-out)       in hand-over order: postprocess, per-camera filter, the camera's
                                          analytics (CameraRoute.analytics: tracking, zones, lines), sinks

While batch k is inferred, batch k+1 is preprocessed and batch k-1 postprocessed; the frames of batch k+1
are taken just in time (shortly before batch k is expected to end), so they do not wait a whole inference
in the pipeline. Batches are delivered
in the order they were formed, so each camera's results arrive in capture order even when execution slots
finish out of order. Frames never queue up: each camera has a latest-frame-wins slot and gives at most one
frame per batch, and at most slots + 2 batches exist at once (one being prepared, up to slots + 1 handed
over and not yet delivered), so a slow model drops frames (counted by the slot) instead of building a
backlog.

Fairness: the round robin starts after the camera served last, whichever cameras had no frame, so every
live camera gets an equal share whatever the order or number of dead ones.

Stale frames: a frame older than ``max_age_ms`` when the batcher takes it (a camera that stalled with a
frame in its slot, or the pipeline itself stalled) is dropped before preprocessing and counted on its
route (``CameraRoute.stale``). A frame waiting in a slot is always that camera's newest, so steady
overload alone does not make frames stale; it drops more of them in the slot.

Hot swap: ``swap_backend`` only files the new backend as *pending*; the batcher switches to it at the top of
its next batch, after the batches in flight on the old one have finished, and then closes the old one
itself, so a backend is never closed while a batch runs on it (with TensorRT that would be a use-after-free
of device buffers). A pending backend that is replaced by a newer one before it served was never used and
is closed at once; ``stop`` closes a backend still pending, ``close_backends`` the serving one once the
worker's threads have ended.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engines.runtimes.base import Backend, Batch
from pipelines.analytics import Analysis
from pipelines.frames import Detections, DeviceImage, Frame, host_image
from pipelines.models.base import ModelAdapter
from pipelines.postprocess import filter_detections
from pipelines.preprocess import Letterbox
from pipelines.sources import FrameSlot

if TYPE_CHECKING:
    from pipelines.preprocess_gpu import GpuLetterbox

log = logging.getLogger(__name__)

_LIVE_S = 1.0  # a camera that put a frame within this long counts as live (worth waiting for)
_ERROR_PAUSE_S = 0.5  # after a failed batch: do not spin on a persistent failure
_STALE_LOG_S = 10.0  # at most one "dropped stale frames" warning per model per this long


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
# A camera's analytics (agent.events.CameraEvents): the frame and its detections (class filter applied,
# scores >= the route's min_score) -> Analysis, whose `detections` the result carries instead.
AnalyticsHook = Callable[[Frame, Detections], Analysis]
# on_swapped(model, old, new): called on the batcher thread right after it switched, before `old` is closed.
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
    min_score: float  # with analytics: the tracker's floor (the analytics narrows to what is reported)
    stale: int = 0  # frames dropped unprocessed: older than the model's max age when taken
    analytics: AnalyticsHook | None = None


@dataclass(eq=False)
class _Batch:
    """One batch on its way from the batcher to delivery."""

    items: list[tuple[CameraRoute, Frame]]
    backend: Backend
    adapter: ModelAdapter
    limit: int
    tensor: Batch
    letterboxes: list[Letterbox]
    release: Callable[[], None] | None = None  # gives GPU input buffers back once inference is over
    outputs: dict[str, np.ndarray] | None = None
    gpu_ms: float | None = None
    error: BaseException | None = None
    inferred: bool = False  # inference ended (outputs or error); written under the worker's _flow

    @property
    def frames(self) -> list[Frame]:
        return [f for _, f in self.items]


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
        self._backend = backend
        self._adapter = adapter
        self._sinks = list(sinks)
        self._iou = iou_threshold
        self._max_batch = max_batch
        self._batch_wait_s = batch_wait_s
        self._max_age_s = max_age_ms / 1000.0
        self._gpu = gpu_preprocess
        self._gpu_refused_by: Backend | None = None  # the backend we last said cannot take device input
        self._on_error = on_error
        self._on_swapped = on_swapped
        self._routes: dict[str, CameraRoute] = {}
        self._routes_lock = threading.Lock()
        # Held while results go to the sinks: remove_camera waits for it, so none follows its return.
        self._deliver_lock = threading.RLock()
        # Guards _backend/_adapter (written only by the batcher, at a switch), the pending pair and
        # _closed. Backends are closed outside it, and only once nobody can reach them any more.
        self._swap_lock = threading.Lock()
        self._pending: tuple[Backend, ModelAdapter | None] | None = None
        self._closed = False  # close_backends() ran: a swap arriving later is closed, not filed
        # The pipeline between the stages: batches handed over and not yet delivered (in order), how many
        # of them are in inference, and whether the batcher has ended. All under _flow.
        self._flow = threading.Condition()
        self._order: deque[_Batch] = deque()
        self._in_infer = 0
        self._infer_starts: dict[int, float] = {}  # id(batch) -> when it entered inference
        # Moving averages of one batch's inference and preprocessing (s), for just-in-time batching.
        self._infer_s = 0.0
        self._preprocess_s = 0.0
        self._batcher_done = False
        self._infer_queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._infer_threads: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._last_served: str | None = None  # round robin: the next batch starts after this camera
        self._rr_pos = 0  # ... or at this position, if that camera was removed
        self._error_at = -math.inf
        self._stale_logged_at = -math.inf
        self.swaps = 0  # switches the batcher made
        self.batches = 0
        self.frames = 0
        self.batch_fill_sum = 0.0
        # Host CPU seconds of the stages (time.thread_time() around each, ~1 us a call): for the benchmark.
        self.cpu_s = {"preprocess": 0.0, "postprocess": 0.0, "publish": 0.0}
        self.stale = 0
        self.last_tick = time.monotonic()

    # -- routing ---------------------------------------------------------------------------
    def new_slot(self) -> FrameSlot:
        return NotifyingSlot(self.wake)

    def add_camera(self, route: CameraRoute) -> None:
        with self._routes_lock:
            self._routes[route.name] = route

    def remove_camera(self, name: str) -> None:
        """Stop serving a camera; once this returns, none of its results reaches a sink (safe while running,
        also from inside a sink)."""
        with self._routes_lock:
            self._routes.pop(name, None)
        with self._deliver_lock:  # a delivery under way finishes; later ones no longer find the route
            pass

    def route(self, name: str) -> CameraRoute | None:
        with self._routes_lock:
            return self._routes.get(name)

    @property
    def backend(self) -> Backend:
        """The backend serving batches now (a pending one serves from the next batch on)."""
        with self._swap_lock:
            return self._backend

    def swap_backend(self, backend: Backend, adapter: ModelAdapter | None = None) -> None:
        """File a loaded backend (and optionally its adapter) to serve from the next batch on.

        Returns at once; the batcher switches at the top of its next batch, once the batches in flight on
        the old backend have finished, and closes the old backend itself. A still-pending backend that this
        call replaces was never used and is closed here. ``adapter=None`` keeps the adapter in effect (that
        of a replaced pending swap, if it brought one). The caller hands ``backend`` over: the worker closes
        it when it is replaced or at close_backends().
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
        self.wake.set()  # an idle batcher switches now rather than at the next frame

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
        """Batcher, between batches: adopt a pending backend and close the old one. Returns the backend
        and adapter that serve the coming batch."""
        with self._swap_lock:
            if self._pending is None:
                return self._backend, self._adapter
        # Batches in flight run on the serving backend: it may be closed only once they have finished.
        if not self._wait_flow(lambda: self._in_infer == 0):
            with self._swap_lock:  # stopping: no switch (and nothing closed) under running batches
                return self._backend, self._adapter
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
        # No batch runs on `old` any more: none is in flight, and this thread is between batches.
        _close_quietly(self.model, old, "swapped out")
        return backend, adapter

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
        with self._flow:
            self._flow.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads + self._infer_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._close_pending()
        return not self.running

    @property
    def running(self) -> bool:
        """Any of the worker's threads still alive (a batch may still run on the serving backend)."""
        return any(t.is_alive() for t in self._threads + self._infer_threads)

    def _close_pending(self) -> None:
        # Taken out under the lock, so the batcher can no longer adopt it, even if it is still running.
        with self._swap_lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not self._backend:
            _close_quietly(self.model, pending[0], "pending at stop")

    def close_backends(self) -> bool:
        """After stop(): close the pending and the serving backend (and the GPU preprocessing buffers);
        later swaps are closed on arrival.

        If a worker thread is still running (stop timed out) the serving backend may still be in use: it
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
        if self._gpu is not None:
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
            with self._flow:
                self._batcher_done = True
                self._flow.notify_all()
            for _ in self._infer_threads:
                self._infer_queue.put(None)  # after every batch handed over: those still finish

    def _next_batch(self, timeout: float) -> _Batch | None:
        """Wait for frames, take a fair batch of fresh ones and preprocess it (None: nothing to do)."""
        woke = self.wake.wait(timeout)
        self.last_tick = time.monotonic()
        # Top of a batch (or an idle tick): the only place the serving backend changes.
        backend, adapter = self._switch_if_pending()
        if not woke or self._stop.is_set():
            return None
        self._wait_until_worth_preparing(backend.slots)
        self.wake.clear()
        limit = self._limit_of(backend)
        items = self._collect(limit)
        if not items:
            return None
        # A short wait lets frames of the other live cameras join a partly filled batch.
        if self._batch_wait_s > 0 and len(items) < min(limit, self._live_cameras()):
            time.sleep(self._batch_wait_s)
            items += self._collect(limit - len(items), frozenset(r.name for r, _ in items))
        if len(items) >= limit:
            self.wake.set()  # other cameras may still hold frames: come back for them at once
        frames = [f for _, f in items]
        _stamp_all(frames, "dequeued")
        c0 = time.thread_time()
        tensor, boxes, release = self._preprocess(backend, adapter, [f.image for f in frames])
        self.cpu_s["preprocess"] += time.thread_time() - c0
        _stamp_all(frames, "preprocessed")
        took = frames[0].stamps["preprocessed"] - frames[0].stamps["dequeued"]
        self._preprocess_s += 0.2 * (took - self._preprocess_s)
        return _Batch(items, backend, adapter, limit, tensor, boxes, release)

    def _wait_until_worth_preparing(self, slots: int) -> None:
        """Just in time: while every slot is busy, take frames only shortly before the first batch in flight
        is expected to end (by the average inference time), leaving time to preprocess them and some
        lead. The next batch is then ready when a slot frees (the overlap), and its frames are as fresh as
        they can be: taken at once, they would wait a whole inference in the pipeline (measured with ONNX
        Runtime on the CPU, batch 4: frame age p50 385 ms instead of ~200)."""
        with self._flow:
            while not self._stop.is_set() and self._in_infer >= slots and self._infer_starts:
                lead = 1.5 * self._preprocess_s + 0.1 * self._infer_s + 0.001
                delay = min(self._infer_starts.values()) + self._infer_s - lead - time.monotonic()
                if delay <= 0:
                    return
                self._flow.wait(delay)

    def _collect(self, limit: int, exclude: frozenset[str] = frozenset()) -> list[tuple[CameraRoute, Frame]]:
        """At most one frame per camera, at most `limit`, in round-robin order starting after the camera
        served last; frames older than the max age are dropped and counted."""
        with self._routes_lock:
            routes = list(self._routes.values())
        n = len(routes)
        if not n or limit <= 0:
            return []
        names = [r.name for r in routes]
        start = names.index(self._last_served) + 1 if self._last_served in names else self._rr_pos
        now = time.monotonic()
        items: list[tuple[CameraRoute, Frame]] = []
        stale: list[str] = []
        for i in range(n):
            route = routes[(start + i) % n]
            if route.name in exclude:
                continue
            frame = route.slot.get(timeout=0)
            if frame is None:
                continue
            if self._max_age_s and now - frame.stamps.get("captured", now) > self._max_age_s:
                route.stale += 1
                stale.append(route.name)
                continue
            items.append((route, frame))
            if len(items) >= limit:
                break
        if items:
            self._last_served = items[-1][0].name
            self._rr_pos = (names.index(self._last_served) + 1) % n
        if stale:
            self._note_stale(stale, now)
        return items

    def _live_cameras(self) -> int:
        with self._routes_lock:
            routes = list(self._routes.values())
        since = time.monotonic() - _LIVE_S
        return sum(1 for r in routes if r.slot.last_put >= since)

    def _note_stale(self, cameras: list[str], now: float) -> None:
        self.stale += len(cameras)
        if now - self._stale_logged_at >= _STALE_LOG_S:
            self._stale_logged_at = now
            log.warning(
                "model %s: dropping frames older than %.0f ms (cameras %s; %d so far)",
                self.model,
                self._max_age_s * 1000.0,
                ", ".join(sorted(set(cameras))),
                self.stale,
            )

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

    def _hand_over(self, batch: _Batch) -> None:
        """Wait for a free execution slot (and room before delivery), then queue the batch for inference."""
        slots = batch.backend.slots
        with self._flow:
            self._flow.wait_for(
                lambda: self._stop.is_set() or (self._in_infer < slots and len(self._order) <= slots)
            )
            if self._stop.is_set():
                if batch.release is not None:
                    batch.release()
                return
            self._in_infer += 1
            self._infer_starts[id(batch)] = time.monotonic()
            self._order.append(batch)
        _stamp_all(batch.frames, "submitted")
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
            with self._flow:
                self._in_infer -= 1
                took = time.monotonic() - self._infer_starts.pop(id(batch))
                if batch.error is None:
                    self._infer_s += 0.2 * (took - self._infer_s)
                batch.inferred = True
                self._flow.notify_all()

    def _infer(self, batch: _Batch) -> None:
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
        while True:
            with self._flow:
                self._flow.wait_for(
                    lambda: (
                        bool(self._order and self._order[0].inferred)
                        or (self._batcher_done and not self._order)
                    )
                )
                if not self._order:
                    return
                batch = self._order.popleft()
                self._flow.notify_all()  # room for another batch
            if batch.error is not None:
                self._report(batch.error)
                continue
            try:
                self._deliver(batch)
            except Exception as exc:
                self._report(exc)

    def _deliver(self, batch: _Batch) -> int:
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
            with self._routes_lock:
                routes = dict(self._routes)
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
    def _wait_flow(self, ready: Callable[[], bool]) -> bool:
        """Wait under _flow until `ready()` or stop; returns `ready()`."""
        with self._flow:
            self._flow.wait_for(lambda: ready() or self._stop.is_set())
            return ready()

    def _report(self, exc: BaseException) -> None:
        log.error("model %s: batch failed", self.model, exc_info=exc)
        self._error_at = time.monotonic()
        if self._on_error is not None:
            self._on_error(self.model, exc)


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
