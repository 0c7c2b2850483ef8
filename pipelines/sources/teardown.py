"""A camera's teardowns (capture release, a decoder session's end) on short-lived threads of their own.

A reconnect starts at once, and a release that blocks (an RTSP teardown to a frozen server, a decoder that
waits for its GPU work) delays nobody. The reader joins these threads when it stops: a release still
running in C++ when the interpreter exits aborts the process. A failing teardown is logged (scrubbed),
never raised: the connection is over either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pipelines.sources.stages import Closer

log = logging.getLogger("pipelines.sources")


class Teardowns:
    """The teardown threads of one camera (the reader's thread starts them; stop joins them)."""

    def __init__(self, camera: str, scrub: Callable[[str], str]) -> None:
        self.camera = camera
        self._scrub = scrub
        self._threads: list[threading.Thread] = []

    def later(self, *closers: Closer | None) -> None:
        """Run the closers on a thread of their own, in order."""
        if not any(c is not None for c in closers):
            return
        thread = threading.Thread(target=self.now, args=closers, name=f"close-{self.camera}", daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def now(self, *closers: Closer | None) -> None:
        """Run the closers here, in order."""
        for closer in closers:
            if closer is None:
                continue
            try:
                closer()
            except Exception as exc:
                log.debug("camera %s: teardown: %s", self.camera, self._scrub(repr(exc)))

    def join(self, deadline: float) -> bool:
        """Wait for the teardown threads until `deadline` (time.monotonic()); True when all have ended."""
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
