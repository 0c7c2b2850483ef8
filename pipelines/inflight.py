"""The batches between a model worker's stages (pipelines.scheduler): handed over by the batcher, inferred
in any order on the execution slots, delivered in the order they were handed over.

At most slots + 1 batches are handed over and not yet delivered, and at most `slots` are in inference, so
frames never queue up. The moving averages of one batch's preprocessing and inference time the batcher's
next take of frames (``wait_until_worth_preparing``).

One condition guards it all: the batcher, the inference threads and the delivery thread wait on it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engines.runtimes.base import Backend, Batch
from pipelines.frames import Frame
from pipelines.models.base import ModelAdapter
from pipelines.preprocess import Letterbox
from pipelines.routes import CameraRoute


@dataclass(eq=False)
class BatchInFlight:
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
    inferred: bool = False  # inference ended (outputs or error); written under InFlight's condition

    @property
    def frames(self) -> list[Frame]:
        return [f for _, f in self.items]


class InFlight:
    """The handed-over batches in order, how many are in inference, and how long the stages take."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._cond = threading.Condition()
        self._order: deque[BatchInFlight] = deque()
        self._in_infer = 0
        self._infer_starts: dict[int, float] = {}  # id(batch) -> when it entered inference
        # Moving averages of one batch's inference and preprocessing (s), for just-in-time batching.
        self._infer_s = 0.0
        self._preprocess_s = 0.0
        self._batcher_done = False

    def admit(self, batch: BatchInFlight) -> bool:
        """Wait for a free execution slot and room before delivery, then count the batch in; False when
        stopping (the batch is not admitted)."""
        slots = batch.backend.slots
        with self._cond:
            self._cond.wait_for(
                lambda: self._stop.is_set() or (self._in_infer < slots and len(self._order) <= slots)
            )
            if self._stop.is_set():
                return False
            self._in_infer += 1
            self._infer_starts[id(batch)] = time.monotonic()
            self._order.append(batch)
            return True

    def inferred(self, batch: BatchInFlight) -> None:
        """Inference of `batch` ended (outputs or error): its slot is free, delivery may take it."""
        with self._cond:
            self._in_infer -= 1
            took = time.monotonic() - self._infer_starts.pop(id(batch))
            if batch.error is None:
                self._infer_s += 0.2 * (took - self._infer_s)
            batch.inferred = True
            self._cond.notify_all()

    def next_to_deliver(self) -> BatchInFlight | None:
        """The oldest batch once it is inferred; None once the batcher has ended and all are delivered."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    bool(self._order and self._order[0].inferred) or (self._batcher_done and not self._order)
                )
            )
            if not self._order:
                return None
            batch = self._order.popleft()
            self._cond.notify_all()  # room for another batch
            return batch

    def preprocessed(self, took: float) -> None:
        """One batch's preprocessing took `took` seconds (batcher thread)."""
        self._preprocess_s += 0.2 * (took - self._preprocess_s)

    def wait_until_worth_preparing(self, slots: int) -> None:
        """Just in time: while every slot is busy, take frames only shortly before the first batch in flight
        is expected to end (by the average inference time), leaving time to preprocess them and some
        lead. The next batch is then ready when a slot frees (the overlap), and its frames are as fresh as
        they can be: taken at once, they would wait a whole inference in the pipeline (measured with ONNX
        Runtime on the CPU, batch 4: frame age p50 385 ms instead of ~200)."""
        with self._cond:
            while not self._stop.is_set() and self._in_infer >= slots and self._infer_starts:
                lead = 1.5 * self._preprocess_s + 0.1 * self._infer_s + 0.001
                delay = min(self._infer_starts.values()) + self._infer_s - lead - time.monotonic()
                if delay <= 0:
                    return
                self._cond.wait(delay)

    def drained(self) -> bool:
        """Wait until no batch is in inference, or stop; returns whether none is."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_infer == 0 or self._stop.is_set())
            return self._in_infer == 0

    def batcher_ended(self) -> None:
        """No batch will be handed over any more: delivery ends after the last one."""
        with self._cond:
            self._batcher_done = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter (to see stop)."""
        with self._cond:
            self._cond.notify_all()
