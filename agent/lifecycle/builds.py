"""The engine manager's jobs: one per model at a time, in a child process, frames captured first.

    manager.rebuild("det", force=True)        # False when one is already under way

A job runs on its own thread: the model's build lock is taken (a sibling manager's, of another GPU
model, is waited for), the frames the gate (and INT8) need are taken from the model's running pipeline
(FrameTap) or its folder, then agent.lifecycle.job runs in a child holding the lock with us. Its
progress is published at most twice a second; its engine is adopted by agent.lifecycle.swap.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agent.lifecycle.calibration import CalibrationError, FrameTap, frames_to_capture
from agent.lifecycle.capture import capture_calibration_set, capture_from_frames
from agent.lifecycle.job import JobRequest, JobResult, job_command, start_job
from agent.lifecycle.state import ModelEngine
from engines.buildproc import Event, Progress
from engines.errors import BuildLockedError, EngineError
from engines.plan import needs_calibration_frames, needs_gate, plan_steps
from engines.precision import Precision
from engines.store.lock import BuildLock

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from engines.store import EngineStore

# The daemon's log names the engine manager for every line of its lifecycle, jobs included.
log = logging.getLogger("agent.lifecycle.manager")

Delegate = Callable[[str, bool, "Precision | None", "list[str] | None"], bool]  # rebuild(name, force, ...)


class Jobs:
    """EngineManager's job side. A mixin: the attributes below are EngineManager's, and so are `_set`
    (publish) and the swap side's `_adopt` and `_listing` it calls."""

    cfg: AgentConfig
    _models: dict[str, ModelEngine]
    _stop: threading.Event
    _delegate: Delegate | None
    _build_gate: threading.Lock | None
    _gpu: int | None
    _version: str
    _frames_for: Callable[[str], FrameTap | None]

    if TYPE_CHECKING:

        @property
        def store(self) -> EngineStore: ...
        def _set(self, me: ModelEngine, **fields: Any) -> None: ...
        def _adopt(self, me: ModelEngine, key: str) -> None: ...
        def _listing(self, name: str) -> tuple: ...

    def rebuild(
        self,
        name: str,
        force: bool = False,
        precision: Precision | None = None,
        reasons: list[str] | None = None,
    ) -> bool:
        """Start a job for `name` in the background; False when one is already under way. `reasons`: why,
        for the published state (kept from before when None)."""
        if self._delegate is not None:  # a shard: the supervisor's manager builds (once, for every shard)
            return self._delegate(name, force, precision, reasons)
        me = self._models[name]
        if me.retired:
            return False
        requested = precision or me.ctx.cfg.precision
        with me.lock:
            if me.busy or self._stop.is_set():
                return False
            me.busy = True
            me.requested = requested
            me.phases_logged = set()
        why = {} if reasons is None else {"reasons": reasons}
        self._set(me, state="building", progress=None, error=None, **why)
        request = JobRequest(me.ctx, requested, force, 0.0, self._version)
        threading.Thread(target=self._run_job, args=(me, request), name=f"job-{name}", daemon=True).start()
        return True

    def _run_job(self, me: ModelEngine, request: JobRequest) -> None:
        try:
            result = self._job(me, request)
        except Exception as exc:  # never leave the model `building` forever
            log.exception("model %s: engine job failed", me.name)
            result = JobResult.failed(request.precision, str(exc), type(exc).__name__)
        finally:
            with me.lock:
                me.job, me.busy = None, False
                me.seen = self._listing(me.name)
        if self._stop.is_set() or me.retired:
            return
        if not result.ok:
            log.error(
                "model %s: engine job failed: %s (still serving %s)",
                me.name,
                result.error,
                me.state.backend,
            )
            self._set(me, state="failed", error=result.error or "job failed", progress=None)
            return
        log.info("model %s: %s", me.name, result.message)
        self._set(
            me,
            build_s=result.build_s if result.built else me.state.build_s,
            reasons=result.reasons or me.state.reasons,
            validation=result.state_validation or me.state.validation,
            tried=result.tried,
            progress=None,
            error=None,
        )
        if result.key is not None:
            self._adopt(me, result.key)

    def _job(self, me: ModelEngine, request: JobRequest) -> JobResult:
        """The whole job under the model's build lock: frames, gate and build (the child inherits it). A
        lock held by another process (`edge-agent rebuild`) fails the job at once, naming the holder; one
        held by this process (the manager of another GPU model building the same model) is waited for."""
        try:
            lock = self._lock(me, request.precision)
        except EngineError as exc:
            return JobResult.failed(request.precision, f"model {me.name!r}: {exc}", type(exc).__name__)
        with lock:
            steps = plan_steps(request.precision, me.target.api)
            if needs_gate(steps):
                self._ensure_frames(me, calibration=needs_calibration_frames(steps))
            if self._stop.is_set():
                return JobResult.failed(request.precision, "stopped", "Stopped")
            request = replace(request, lock_fd=lock.fd)
            if self._build_gate is None:
                return self._run_child(me, request)
            with self._build_gate:  # another GPU model's build first (builds run one at a time)
                return self._run_child(me, request)

    def _lock(self, me: ModelEngine, precision: Precision) -> BuildLock:
        command = job_command(me.name, precision)
        try:
            lock = self.store.lock(me.name, wait_s=0, command=command)
            lock.acquire()
        except BuildLockedError as exc:
            if exc.pid != os.getpid():
                raise
            lock = self.store.lock(me.name, wait_s=None, command=command)  # a sibling manager's job
            lock.acquire()
        return lock

    def _run_child(self, me: ModelEngine, request: JobRequest) -> JobResult:
        on_event = lambda ev: self._on_event(me, ev)  # noqa: E731
        if self._gpu is None:
            job = start_job(request, on_event)
        else:
            job = start_job(
                request, on_event, {"CUDA_VISIBLE_DEVICES": str(self._gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            )
        with me.lock:
            me.job = job
        return JobResult.from_event(job.wait())

    def _ensure_frames(self, me: ModelEngine, calibration: bool) -> None:
        """The frames the gate (and INT8) need when missing: from the model's running pipeline (its
        cameras are never opened a second time), or from its configured folder."""
        counts = frames_to_capture(me.ctx, calibration)
        if counts is None:
            return
        samples, held_out = counts
        cal = me.ctx.cfg.calibration
        if cal.source == "folder":
            capture_calibration_set(self.cfg, me.name, samples=samples, held_out=held_out, progress=False)
            return
        tap = self._frames_for(me.name)
        if tap is None:
            raise CalibrationError(
                f"model {me.name}: no calibration set; run edge-agent calibrate --model {me.name}"
            )
        total = samples + held_out
        cams = max(1, sum(1 for c in self.cfg.cameras.values() if c.model == me.name and c.enabled))
        timeout = 60.0 + 3.0 * total / cams * cal.interval_s
        log.info(
            "model %s: capturing %d frames from its pipeline (%d held out for the gate)",
            me.name,
            total,
            held_out,
        )
        t0 = time.monotonic()
        frames = tap.frames(total, cal.interval_s, timeout, self._stop)
        cset = capture_from_frames(me.ctx, self._counted(me, frames, total), samples, held_out)
        log.info(
            "model %s: captured %d of %d frames from its pipeline in %.0f s (%d held out for the gate)",
            me.name,
            cset.manifest["samples"] + cset.manifest["held_out_count"],
            total,
            time.monotonic() - t0,
            cset.manifest["held_out_count"],
        )

    def _counted(self, me: ModelEngine, frames: Iterator[Any], total: int) -> Iterator[Any]:
        for n, item in enumerate(frames, 1):
            self._on_event(me, Progress("capture frames", n, total))
            yield item

    def _on_event(self, me: ModelEngine, ev: Event) -> None:
        if not isinstance(ev, Progress):
            return
        now = time.monotonic()
        phase = ev.phase
        with me.lock:
            first = phase not in me.phases_logged
            me.phases_logged.add(phase)
            publish = now - me.last_progress_pub >= 0.5  # a progress state at most twice a second
            if publish:
                me.last_progress_pub = now
        # The log gets each phase of a job once, as it starts (frame captures: a line before and one after,
        # in _ensure_frames); every step is in the published state, and in the log at DEBUG.
        if first and not phase.startswith("capture"):
            log.info("model %s: %s %s/%s", me.name, phase, ev.step, ev.total)
        elif publish:
            log.debug("model %s: %s %s/%s", me.name, phase, ev.step, ev.total)
        if publish:
            self._set(me, state="building", progress=ev)
