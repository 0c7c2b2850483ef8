"""Ending an engine job before its child runs: while it waits for another device's build (the fleet's build
claims, agent.lifecycle.shared_cache), which may last `engines.claim_wait_s` (30 min by default).

    cancel = JobCancel(stop)            # the runner's stop: shutdown
    on_start(cancel)                    # me.job: a reload that retires the model kills it, as a child
    sleep = cancel.sleeper(shared.closed)   # acquire's sleep: raises JobCancelled / SectionReplaced
    cancel.check(shared.closed)         # before the child starts: the same

A killed child ends its job; a job that has no child yet ends at its next look (every `SLICE_S` at most
while it waits) with JobCancelled: nothing adopted, its build lock released. An engines section replaced
by a reload (`closed` set) ends the wait with SectionReplaced: the runner tries again with the new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

SLICE_S = 0.5  # the runner's stop is looked at this often while a job waits


class Killable(Protocol):
    """What ends a job: its JobCancel before the child starts, the child (engines.buildproc) after."""

    def kill(self) -> None: ...


class JobCancelled(Exception):
    """The job was cancelled before its child ran (its model retired by a reload, the agent stopping)."""


class SectionReplaced(JobCancelled):
    """The engines section the wait belonged to was replaced by a reload: wait (or build) under the new."""


class JobCancel:
    """A job's kill() handle until its child starts (then the child's handle takes its place)."""

    def __init__(self, stop: threading.Event) -> None:
        self._killed = threading.Event()
        self._stop = stop

    def kill(self) -> None:
        self._killed.set()

    def check(self, closed: threading.Event | None = None, stop: bool = True) -> None:
        """Raise where the job is to end; `stop` False: the runner's stop is left to the runner (its
        `stopped` result)."""
        if stop and self._stop.is_set():  # first: a stopping agent kills every job too
            raise JobCancelled("cancelled (the agent is stopping)")
        if self._killed.is_set():
            raise JobCancelled("cancelled (the model was reloaded away)")
        if closed is not None and closed.is_set():
            raise SectionReplaced("the engines section was replaced by a reload")

    def sleeper(self, closed: threading.Event | None = None) -> Callable[[float], None]:
        """A sleep that ends early, raising, once the job is cancelled or `closed` is set."""

        def sleep(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while True:
                self.check(closed)
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._killed.wait(min(SLICE_S, left))

        return sleep
