"""The daemon's engine jobs: one per model at a time, each on its own thread, through the JobRunner.

    builds = Builds(runner, board, adopt, listing)
    builds.rebuild(me, force=True)        # False when one is already under way

A job is the runner's walk (agent.lifecycle.runner: lock, frames, request, child, events) with the
daemon's frames (PipelineFrames: from the model's running pipeline, never a second camera session, or
its folder). Its progress is published at most twice a second; the engine it made is adopted
(agent.lifecycle.swap); a failure leaves the model `failed` on the backend serving it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from agent.config import AgentConfig
from agent.lifecycle.calibration import CalibrationError, FrameTap, frames_to_capture
from agent.lifecycle.cancel import JobCancel, Killable
from agent.lifecycle.capture import capture_calibration_set, capture_from_frames
from agent.lifecycle.job import JobResult
from agent.lifecycle.model import ModelContext
from agent.lifecycle.runner import Emit, JobRunner, LockUnavailable
from agent.lifecycle.state import ModelEngine, StateBoard
from engines.buildproc import Event, Progress
from engines.precision import Precision

# The daemon's log names the engine manager for every line of its lifecycle, jobs included.
log = logging.getLogger("agent.lifecycle.manager")


class Builds:
    def __init__(
        self,
        runner: JobRunner,
        board: StateBoard,
        adopt: Callable[[ModelEngine, str], None],
        listing: Callable[[str], tuple],
    ) -> None:
        self._runner, self._board, self._adopt, self._listing = runner, board, adopt, listing

    def rebuild(
        self, me: ModelEngine, force: bool, precision: Precision | None, reasons: list[str] | None
    ) -> bool:
        """Start a job for `me` in the background; False when one is already under way. `reasons`: why,
        for the published state (kept from before when None)."""
        if me.retired:
            return False
        requested = precision or me.ctx.cfg.precision
        with me.lock:
            if me.busy or self._runner.stop.is_set():
                return False
            me.busy = True
            me.requested = requested
            me.phases_logged = set()
        why = {} if reasons is None else {"reasons": reasons}
        self._board.set(me, state="building", progress=None, error=None, **why)
        args = (me, requested, force)
        threading.Thread(target=self._run, args=args, name=f"job-{me.name}", daemon=True).start()
        return True

    def _run(self, me: ModelEngine, requested: Precision, force: bool) -> None:
        try:
            result = self._job(me, requested, force)
        except Exception as exc:  # never leave the model `building` forever
            log.exception("model %s: engine job failed", me.name)
            result = JobResult.failed(requested, str(exc), type(exc).__name__)
        finally:
            with me.lock:
                me.job, me.busy = None, False
                me.seen = self._listing(me.name)
        if self._runner.stop.is_set() or me.retired:
            return
        if not result.ok:
            log.error(
                "model %s: engine job failed: %s (still serving %s)", me.name, result.error, me.state.backend
            )
            self._board.set(me, state="failed", error=result.error or "job failed", progress=None)
            return
        log.info("model %s: %s", me.name, result.message)
        self._board.set(
            me,
            build_s=result.build_s if result.built else me.state.build_s,
            reasons=result.reasons or me.state.reasons,
            validation=result.state_validation or me.state.validation,
            tried=result.tried,
            progress=None,
            error=None,
            origin=result.origin,
        )
        if result.key is not None:
            self._adopt(me, result.key)

    def _job(self, me: ModelEngine, requested: Precision, force: bool) -> JobResult:
        """A lock held by another process (`edge-agent rebuild`) fails the job at once, naming the holder."""
        on_event = functools.partial(publish_progress, self._board, me)
        try:
            started = functools.partial(_started, me)
            cancel = JobCancel(self._runner.stop)
            started(cancel)  # until its child starts: a reload that retires the model ends a wait
            fp = me.target.fingerprint
            return self._runner.run(me.ctx, me.target.api, requested, force, on_event, started, fp, cancel)
        except LockUnavailable as exc:
            return JobResult.failed(requested, f"model {me.name!r}: {exc.error}", type(exc.error).__name__)


def _started(me: ModelEngine, job: Killable) -> None:
    with me.lock:
        me.job = job  # killed by a reload that retires the model, or at close


def publish_progress(board: StateBoard, me: ModelEngine, ev: Event) -> None:
    """A job's progress event: published at most twice a second; each phase in the log once, as it starts
    (frame captures: a line before and one after, by PipelineFrames); every step at DEBUG."""
    if not isinstance(ev, Progress):
        return
    now = time.monotonic()
    phase = ev.phase
    with me.lock:
        first = phase not in me.phases_logged
        me.phases_logged.add(phase)
        publish = now - me.last_progress_pub >= 0.5
        if publish:
            me.last_progress_pub = now
    if first and not phase.startswith("capture"):
        log.info("model %s: %s %s/%s", me.name, phase, ev.step, ev.total)
    elif publish:
        log.debug("model %s: %s %s/%s", me.name, phase, ev.step, ev.total)
    if publish:
        board.set(me, state="building", progress=ev)


class PipelineFrames:
    """The daemon's frames for a job: from the model's running pipeline (its cameras are never opened a
    second time), or from its configured folder."""

    def __init__(
        self,
        cfg: Callable[[], AgentConfig],
        frames_for: Callable[[str], FrameTap | None],
        stop: threading.Event,
    ) -> None:
        self._cfg, self._frames_for, self._stop = cfg, frames_for, stop

    def ensure(self, ctx: ModelContext, calibration: bool, on_event: Emit) -> None:
        counts = frames_to_capture(ctx, calibration)
        if counts is None:
            return
        samples, held_out = counts
        cfg, cal = self._cfg(), ctx.cfg.calibration
        if cal.source == "folder":
            capture_calibration_set(cfg, ctx.name, samples=samples, held_out=held_out, progress=False)
            return
        tap = self._frames_for(ctx.name)
        if tap is None:
            raise CalibrationError(
                f"model {ctx.name}: no calibration set; run edge-agent calibrate --model {ctx.name}"
            )
        total = samples + held_out
        cams = max(1, sum(1 for c in cfg.cameras.values() if c.model == ctx.name and c.enabled))
        timeout = 60.0 + 3.0 * total / cams * cal.interval_s
        log.info(
            "model %s: capturing %d frames from its pipeline (%d held out for the gate)",
            ctx.name,
            total,
            held_out,
        )
        t0 = time.monotonic()
        frames = tap.frames(total, cal.interval_s, timeout, self._stop)
        cset = capture_from_frames(ctx, _counted(frames, total, on_event), samples, held_out)
        log.info(
            "model %s: captured %d of %d frames from its pipeline in %.0f s (%d held out for the gate)",
            ctx.name,
            cset.manifest["samples"] + cset.manifest["held_out_count"],
            total,
            time.monotonic() - t0,
            cset.manifest["held_out_count"],
        )


def _counted(frames: Iterator[Any], total: int, on_event: Emit) -> Iterator[Any]:
    for n, item in enumerate(frames, 1):
        on_event(Progress("capture frames", n, total))
        yield item
