"""SIGTERM, SIGINT and SIGHUP into the daemon's main loop, with no lock taken inside a handler.

    inbox = SignalInbox()
    inbox.install()                  # main thread only; SIGTERM/SIGINT -> stop, SIGHUP -> reload
    while not inbox.stop:
        inbox.wait(0.5)              # returns early when a signal (or poke()) arrived
        if inbox.take_reload(): ...
    inbox.restore()

Why: CPython runs a Python signal handler in the main thread between two bytecodes, which can be inside a
lock that thread already holds (a threading.Event's condition while it waits or sets, logging's lock). A
handler that sets an Event or logs can then block on that lock forever: two quick Ctrl-C hung the agent
in 1 of 20 tries, and every later SIGTERM was ignored. So a handler here only assigns a flag and writes
one byte to a non-blocking pipe; the main loop wakes up on the pipe and does the work.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNALS = (signal.SIGHUP,)


class SignalInbox:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)  # a full pipe drops the byte, never blocks the handler
        self.stop = False
        self.reload = False
        self._old: dict[int, Any] = {}

    # -- handler: flags and one byte, nothing else ---------------------------------------------------
    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum in RELOAD_SIGNALS:
            self.reload = True
        else:
            self.stop = True
        self.poke()

    def poke(self) -> None:
        """Wake wait() (from a handler, or from any thread asking for a stop or reload)."""
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed (shut down)
            os.write(self._w, b"\0")

    # -- main loop side ------------------------------------------------------------------------------
    def install(self) -> None:
        """Take SIGTERM/SIGINT/SIGHUP (main thread only: an embedding application keeps its own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (*STOP_SIGNALS, *RELOAD_SIGNALS):
            self._old.setdefault(sig, signal.signal(sig, self._handle))

    def restore(self) -> None:
        """Give the signals back to whatever handled them before install()."""
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old.items():
                signal.signal(sig, handler)
        self._old.clear()

    def wait(self, timeout: float) -> None:
        """Sleep until a signal or poke() arrives, or `timeout` passes; pending wake-ups are consumed."""
        if not (self.stop or self.reload):
            with contextlib.suppress(OSError, ValueError):  # closed under us: nothing to wait for
                select.select([self._r], [], [], timeout)
        with contextlib.suppress(OSError):
            while os.read(self._r, 512):
                pass

    def take_reload(self) -> bool:
        """True once per reload asked for (any number of SIGHUPs before it counts as one)."""
        if self.reload:
            self.reload = False
            return True
        return False

    def __del__(self) -> None:
        # Only when nothing can poke any more: a closed descriptor number may be reused by another file.
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
