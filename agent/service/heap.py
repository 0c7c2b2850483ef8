"""Freed heap memory given back to the system after the moments that free a lot (glibc's malloc_trim).

A camera reconnect frees the old capture's and decoder's buffers, a reload the old analytics; glibc keeps
freed memory in its arenas (one per thread that allocated, up to 8 per core) instead of returning it, so
RSS stepped up at every reconnect and reload while Python's objects stayed flat: tools/memtrace.py, two
RTSP cameras, one cycle of reconnect + broker restart + reload + junk commands took RSS from 224 to 334 MB,
and malloc_trim(0) took it back to 212 MB. Where libc has no malloc_trim (musl, macOS) this does
nothing.

    heap = HeapTrimmer()
    heap.request()      # after a reconnect or reload: trims now, or at the next tick() if one just ran
    heap.tick()         # periodically (the telemetry loop): a deferred request, and at most every
                        # `every_s` anyway (what a long steady run leaves free)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("agent.heap")

_MIN_INTERVAL_S = 5.0  # a burst of reconnects (every camera at once) trims once, then once more later
_EVERY_S = 300.0


def _libc_trim() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Thread-safe; `trims` counts the trims done (tests, stats)."""

    def __init__(
        self,
        min_interval_s: float = _MIN_INTERVAL_S,
        every_s: float = _EVERY_S,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self._trim = trim if trim is not None else _libc_trim()
        self._min_interval_s, self._every_s = min_interval_s, every_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._pending = False
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def request(self) -> bool:
        """Trim now unless one ran within the minimum interval (then at the next tick). True: trimmed."""
        return self._maybe(force=True)

    def tick(self) -> bool:
        """A request deferred by the minimum interval, or the periodic trim when due. True: trimmed."""
        return self._maybe(force=False)

    def _maybe(self, force: bool) -> bool:
        if self._trim is None:
            return False
        now = time.monotonic()
        with self._lock:
            since = now - self._last
            due = (force or self._pending) and since >= self._min_interval_s
            if not due and since < self._every_s:
                self._pending = self._pending or force
                return False
            self._last, self._pending = now, False
            self.trims += 1
        try:
            self._trim()  # outside the lock: it may take milliseconds on a large heap
        except Exception as exc:  # never fatal: memory is only given back later
            log.debug("malloc_trim failed: %r", exc)
        return True


HEAP = HeapTrimmer()  # the process's: the runtime (reconnects) and the device (reloads, ticks) share it
