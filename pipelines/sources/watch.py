"""The stall watch: one thread for the process that notices a camera delivering no picture in time.

A reader notices most stalls itself (FFmpeg's read timeout interrupts a read; packets that give no picture
are seen in its loop), but not a call that never returns: a V4L2 or GStreamer read has no timeout in
OpenCV, a decoder can hang. So every reader publishes a deadline (the latest time its next picture may
come: the last picture, or the next one a file's schedule is due, plus ``read_timeout_s``) and this thread
compares the deadlines with the clock ten times a second. Past its deadline a camera is reported
``reconnecting`` with ``last_error`` "no frame for N s", whatever its thread is stuck in, so ``streaming``
never shows without frames; the reader ends the connection as soon as its thread comes back.

The thread only reads a float per camera and calls the camera's own ``stalled()``; it holds no lock that a
camera's thread holds across a slow call.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

log = logging.getLogger(__name__)

PERIOD_S = 0.1


class Watched(Protocol):
    deadline: float  # time.monotonic() by which the next picture must come; 0.0: not watched now

    def stalled(self, now: float) -> None: ...


class StallWatch:
    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period = period_s
        self._lock = threading.Lock()
        self._readers: weakref.WeakSet[Watched] = weakref.WeakSet()  # type: ignore[type-var]
        self._thread: threading.Thread | None = None

    def add(self, reader: Watched) -> None:
        with self._lock:
            self._readers.add(reader)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
                self._thread.start()

    def discard(self, reader: Watched) -> None:
        with self._lock:
            self._readers.discard(reader)

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            with self._lock:
                readers = list(self._readers)
            now = time.monotonic()
            for reader in readers:
                deadline = reader.deadline
                if deadline and now > deadline:
                    try:
                        reader.stalled(now)
                    except Exception:  # one broken camera must not stop the watch of the others
                        log.exception("stall watch: a camera's stall handler failed")


WATCH = StallWatch()  # the process's one watch thread (started with the first camera)
