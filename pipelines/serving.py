"""The backend that serves a model's batches (pipelines.scheduler), and its hot swap.

``file`` only files a new backend as *pending*; the batcher switches to it at the top of its next batch
(``switch``), after the batches in flight on the old one have finished, and then closes the old one itself,
so a backend is never closed while a batch runs on it (with TensorRT that would be a use-after-free of
device buffers). A pending backend that is replaced by a newer one before it served was never used and is
closed at once; ``close_pending`` closes a backend still pending at stop, ``close`` the serving one once
the worker's threads have ended.

Threads: ``file``, ``serving``, ``next_limit`` from any thread; ``switch`` from the batcher only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engines.runtimes.base import Backend
from pipelines.models.base import ModelAdapter

log = logging.getLogger("pipelines.scheduler")  # the journal's name for the scheduler's lines

# on_swapped(model, old, new): called on the batcher thread right after it switched, before `old` is closed.
SwapCallback = Callable[[str, Backend, Backend], None]


class Serving:
    """One model's serving backend and adapter, and the pending pair that replaces them."""

    def __init__(
        self,
        model: str,
        backend: Backend,
        adapter: ModelAdapter,
        max_batch: int | None = None,
        on_swapped: SwapCallback | None = None,
    ) -> None:
        self.model = model
        self._backend = backend
        self._adapter = adapter
        self._max_batch = max_batch
        self._on_swapped = on_swapped
        # Guards _backend/_adapter (written only by the batcher, at a switch), the pending pair and
        # _closed. Backends are closed outside it, and only once nobody can reach them any more.
        self._lock = threading.Lock()
        self._pending: tuple[Backend, ModelAdapter | None] | None = None
        self._closed = False  # close() ran: a swap arriving later is closed, not filed
        self.swaps = 0  # switches the batcher made

    @property
    def backend(self) -> Backend:
        """The backend serving batches now (a pending one serves from the next batch on)."""
        with self._lock:
            return self._backend

    def file(self, backend: Backend, adapter: ModelAdapter | None = None) -> None:
        """File a loaded backend (and optionally its adapter) to serve from the next switch on; a pending
        one it replaces was never used and is closed here. ``adapter=None`` keeps the adapter in effect
        (that of a replaced pending swap, if it brought one)."""
        replaced: Backend | None = None
        with self._lock:
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
            close_quietly(self.model, replaced, why)

    def next_limit(self) -> int:
        """Batch limit of the backend that serves the next batch (the pending one, if any)."""
        with self._lock:
            # Under the lock: neither backend can be switched out, let alone closed, while we ask it.
            backend = self._pending[0] if self._pending is not None else self._backend
            return self.limit_of(backend)

    def limit_of(self, backend: Backend) -> int:
        limit = backend.max_batch
        return min(limit, self._max_batch) if self._max_batch else limit

    def switch(self, drained: Callable[[], bool]) -> tuple[Backend, ModelAdapter]:
        """Batcher, between batches: adopt a pending backend and close the old one. `drained` waits until
        no batch is in inference (False: stopping, then nothing switches). Returns the backend and adapter
        that serve the coming batch."""
        with self._lock:
            if self._pending is None:
                return self._backend, self._adapter
        # Batches in flight run on the serving backend: it may be closed only once they have finished.
        if not drained():
            with self._lock:  # stopping: no switch (and nothing closed) under running batches
                return self._backend, self._adapter
        with self._lock:
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
        close_quietly(self.model, old, "swapped out")
        return backend, adapter

    def close_pending(self) -> None:
        # Taken out under the lock, so the batcher can no longer adopt it, even if it is still running.
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not self._backend:
            close_quietly(self.model, pending[0], "pending at stop")

    def close(self) -> bool:
        """Close the serving backend (the worker's threads have ended); later swaps are closed on arrival.
        Returns False when it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            backend = self._backend
        close_quietly(self.model, backend, "worker stopped")
        return True


def close_quietly(model: str, backend: Backend, why: str) -> None:
    """Close a backend nobody uses any more; a failure is logged, never raised into the worker loop."""
    try:
        backend.close()
    except Exception:
        log.exception("model %s: closing backend %s (%s) failed", model, backend.name, why)
    else:
        log.debug("model %s: closed backend %s (%s)", model, backend.name, why)
