"""stdout's reader leaving (`edge-agent ... | head`): the quiet end Unix tools give, not a traceback."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

# What a shell shows for a command whose pipe's reader left (128 + SIGPIPE): `edge-agent ... | head`.
READER_LEFT = 128 + signal.SIGPIPE


class Console:
    """sys.stdout while an agent runs: console lines come from a scheduler thread, where a reader that left
    (`edge-agent demo | head`) raised BrokenPipeError with a traceback for every line. The first one sends
    the rest of the output to /dev/null and calls `on_gone` once (demo: stop; run: keep serving)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self.gone = False
        self.on_gone: Callable[[], None] = lambda: None

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._out.write(text)
            except BrokenPipeError:
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._lost()

    def _lost(self) -> None:
        with self._lock:
            if self.gone:
                return
            self.gone = True
        discard_stdout()
        self.on_gone()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._out, name)


def stdout_reader_left() -> bool:
    """stdout is a pipe (or socket) whose reading end is closed: poll says POLLERR (pipe) or POLLHUP."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file descriptor (tests' captures)
        return False


def discard_stdout() -> None:
    """From now on stdout's descriptor is /dev/null: whatever is still buffered, and the interpreter's own
    flush at exit, go nowhere instead of raising BrokenPipeError again ("Exception ignored ...")."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)
    except (AttributeError, OSError, ValueError):
        pass
