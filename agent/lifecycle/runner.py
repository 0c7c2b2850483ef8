"""One engine job, the same walk for the daemon and `edge-agent rebuild`: lock -> frames -> request -> child
-> events.

    runner = JobRunner(lambda: store, frames)
    result = runner.run(ctx, api, "fp16", force=False, on_event=progress)

1. lock: the model's build lock, held over the whole job (frames, gate, build). Held by another process:
   LockUnavailable (at once, or after `lock_wait_s`), naming the holder. Held by this process (the manager
   of another GPU model building the same model, agent.shards): waited for.
2. frames: what the gate (and INT8) need, when missing: FrameSource.ensure (the daemon's from the model's
   running pipeline, the CLI's from the cameras or folder). Its errors propagate: the caller words them.
3. request: agent.lifecycle.job's JobRequest, the lock's descriptor handed down (the child holds it too).
4. child: the job in a child process, one at a time across managers sharing `build_gate`; `on_start`
   gets its handle (to kill it).
5. events: the child's (and the capture's) progress events go to `on_event`; the result comes back.

With the fleet's engine cache (`shared`, engines.cache; agent.lifecycle.shared_cache) and the device's
fingerprint, steps 2-5 are the build the cache stands in front of, under the same lock: an engine pulled
from the cache is the job's result (origin `cache`), a build that passed its gate is pushed. While it waits
for another device's build, the caller holds the job's JobCancel (agent.lifecycle.cancel): killed (a reload
that retires the model) or stopped, the wait ends and the job is `Cancelled`; a reload that replaces the
engines section moves the wait under the new one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from agent import __version__
from agent.lifecycle.cancel import JobCancel, JobCancelled, Killable, SectionReplaced
from agent.lifecycle.job import JobRequest, JobResult, job_command, start_job
from agent.lifecycle.model import ModelContext
from agent.lifecycle.shared_cache import SharedCache
from agent.telemetry.engine_cache import ENGINE_CACHE
from engines.buildproc import Event
from engines.errors import BuildLockedError, EngineError
from engines.fingerprint import Fingerprint
from engines.plan import Capabilities, needs_calibration_frames, needs_gate, plan_steps
from engines.precision import Precision
from engines.store import EngineStore
from engines.store.lock import BuildLock

Emit = Callable[[Event], None]
# ctx, caps, precision, force, on_event, on_start, lock: one job's arguments, as _build takes them
_JobArgs = tuple[
    ModelContext, Capabilities, Precision, bool, Emit, "Callable[[Killable], None] | None", BuildLock
]


class LockUnavailable(Exception):
    """The model's build lock could not be taken (held by another build, or the store is unusable)."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error


class FrameSource(Protocol):
    def ensure(self, ctx: ModelContext, calibration: bool, on_event: Emit) -> None:
        """Store the frames the gate (and INT8: `calibration`) need where there are none yet."""


@dataclass
class JobRunner:
    store: Callable[[], EngineStore]  # opened at the first job (StoreError: LockUnavailable)
    frames: FrameSource
    version: str = __version__
    lock_wait_s: float | None = 0.0  # another process's build: 0 = refused at once, None = forever
    on_wait: Callable[[str, str], None] | None = None  # (model, holder): waiting for another build
    env: dict[str, str] | None = None  # added to the child's environment (a build on one GPU of several)
    build_gate: threading.Lock | None = None
    stop: threading.Event = field(default_factory=threading.Event)  # set: no child starts any more
    shared: Callable[[], SharedCache | None] | None = None  # the engine cache as configured now, or None
    # (model, key) -> origin of each engine a job of this process kept (built, cache, store): a model
    # reopened later (a reload, a deployment's promotion) says where its engine came from.
    origins: dict[tuple[str, str], str] = field(default_factory=dict)

    def run(
        self,
        ctx: ModelContext,
        caps: Capabilities,
        precision: Precision,
        force: bool,
        on_event: Emit,
        on_start: Callable[[Killable], None] | None = None,
        fingerprint: Fingerprint | None = None,
        cancel: JobCancel | None = None,
    ) -> JobResult:
        """The whole job under the model's build lock, released however it ends. Raises LockUnavailable,
        and what the frame source raises; a failed job is a result (`error`). `fingerprint`: this device's,
        for the engine cache (without it, or without a cache, every engine is built here). `cancel`: ends the
        job before its child starts (agent.lifecycle.cancel; the runner's `stop` does too)."""
        cancel = cancel if cancel is not None else JobCancel(self.stop)
        with self.lock(ctx.name, precision) as lock:
            try:
                job = (ctx, caps, precision, force, on_event, on_start, lock)
                result = self._acquire(job, fingerprint, cancel)
            except JobCancelled as exc:
                return JobResult.failed(precision, f"model {ctx.name!r}: engine job {exc}", "Cancelled")
        if result.ok and result.key is not None and result.origin != "store":
            self.origins[(ctx.name, result.key)] = result.origin
        return result

    def _acquire(self, job: _JobArgs, fingerprint: Fingerprint | None, cancel: JobCancel) -> JobResult:
        """The job through the engine cache as configured now; again under a section a reload put in place
        while this one waited for another device's build. Raises JobCancelled."""
        ctx, caps, precision, force = job[:4]
        while True:
            shared = self.shared() if self.shared is not None and fingerprint is not None else None
            closed = shared.closed if shared is not None else None
            build = functools.partial(self._checked_build, job, cancel, closed)
            if shared is None or fingerprint is None:
                return build()
            store, sleep = self.store(), cancel.sleeper(closed)
            try:
                return shared.acquire(ctx, caps, fingerprint, store, precision, force, build, sleep)
            except SectionReplaced:
                continue

    def _checked_build(self, job: _JobArgs, cancel: JobCancel, closed: threading.Event | None) -> JobResult:
        cancel.check(closed, stop=False)  # a cancelled job starts no child (a stop: _build says `stopped`)
        return self._build(*job)

    def _build(
        self,
        ctx: ModelContext,
        caps: Capabilities,
        precision: Precision,
        force: bool,
        on_event: Emit,
        on_start: Callable[[Killable], None] | None,
        lock: BuildLock,
    ) -> JobResult:
        """Frames, request, child (steps 2-5), under the lock `run` holds."""
        steps = plan_steps(precision, caps)
        if needs_gate(steps):
            self.frames.ensure(ctx, needs_calibration_frames(steps), on_event)
        if self.stop.is_set():
            return JobResult.failed(precision, "stopped", "Stopped")
        request = JobRequest(ctx, precision, force, 0.0, self.version, lock_fd=lock.fd)
        gate = self.build_gate if self.build_gate is not None else contextlib.nullcontext()
        with gate:  # another GPU model's build first (builds run one at a time)
            result = self._child(request, on_event, on_start)
        if result.ok and result.built:
            ENGINE_CACHE.count(builds=1, build_s=result.build_s)
        return result

    def lock(self, model: str, precision: Precision) -> BuildLock:
        """The model's build lock, taken (LockUnavailable where it cannot be)."""
        command = job_command(model, precision)
        on_wait = None if self.on_wait is None else functools.partial(self.on_wait, model)
        try:
            store = self.store()
            try:
                lock = store.lock(model, wait_s=self.lock_wait_s, command=command, on_wait=on_wait)
                lock.acquire()
            except BuildLockedError as exc:
                if exc.pid != os.getpid():
                    raise
                lock = store.lock(model, wait_s=None, command=command)  # a sibling manager's job
                lock.acquire()
        except EngineError as exc:
            raise LockUnavailable(exc) from exc
        return lock

    def _child(
        self, request: JobRequest, on_event: Emit, on_start: Callable[[Killable], None] | None
    ) -> JobResult:
        job = start_job(request, on_event) if self.env is None else start_job(request, on_event, self.env)
        if on_start is not None:
            on_start(job)
        return JobResult.from_event(job.wait())
