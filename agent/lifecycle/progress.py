"""Progress of an engine job on the command line (`rebuild`, `build`): the job's phases as they come.

    progress = JobProgress("det")          # stderr; a bar on a terminal, summary lines when piped
    start_job(request, progress)           # job events: engines.buildproc.Progress
    progress.step("parse", 0, 1)           # or called directly (in-process builds)
    progress.close()

On a terminal: one bar for the phase at hand, frame by frame through the accuracy gate (FP32 reference,
candidate), batch by batch through INT8 calibration, step by step through TensorRT's own phases, with
the phase's elapsed time. Phases nest (TensorRT's run inside the job's "build"): an outer phase that took
at least `min_line_s` leaves a line when it ends ("det: accuracy gate fp16: candidate 20/20 in 3.4 s"),
above the bar on a terminal. Piped (a log, CI, systemd) there is no bar: those lines, and while an outer
phase runs on, a line every `heartbeat_s` with the inner phase at hand ("det: build 0/1 after 10 s
(Building engine 3/6)"): a few lines, never one per frame or per TensorRT step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from engines.buildproc import Event, Progress

MIN_LINE_S = 1.0
HEARTBEAT_S = 10.0
REFRESH_S = 0.1  # TensorRT reports hundreds of steps a second: the bar redraws at most this often


@dataclass
class _Phase:
    started: float
    step: int = 0
    total: int = 0
    said_at: float = 0.0  # last heartbeat
    done: bool = False
    outer: bool = True  # started while no other phase was open


class JobProgress:
    def __init__(
        self,
        name: str,
        stream: TextIO | None = None,
        tty: bool | None = None,
        min_line_s: float = MIN_LINE_S,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = name
        self._out = stream if stream is not None else sys.stderr
        self._tty = _isatty(self._out) if tty is None else tty
        self._min_line_s = min_line_s
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._phases: dict[str, _Phase] = {}
        self._open: list[str] = []  # phases started and not finished, outermost first
        self._current = ""
        self._shown = 0.0
        self._bar: Any = None
        if self._tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=1,
                desc=f"{name}: start",
                file=self._out,
                leave=False,
                bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
            )

    def __call__(self, ev: Event) -> None:
        """A job event; only progress events count."""
        if isinstance(ev, Progress):
            self.step(ev.phase, ev.step, ev.total)

    def step(self, phase: str, step: int, total: int) -> None:
        now = self._clock()
        p = self._phases.get(phase)
        if p is None or (p.done and step < p.total):  # new, or the same phase run again (another step)
            p = self._phases[phase] = _Phase(now, said_at=now, outer=not self._open)
            if step < total:
                self._open.append(phase)
        p.step, p.total = step, total
        if self._bar is not None:
            self._draw(phase, p, now)
        elif step < total:
            self._heartbeat(now)
        if step >= total and not p.done:
            p.done = True
            if phase in self._open:
                self._open.remove(phase)
            took = now - p.started
            if p.outer and took >= self._min_line_s:
                self._line(f"{self._name}: {phase} {step}/{total} in {took:.1f} s")
        self._current = phase

    def _heartbeat(self, now: float) -> None:
        """Piped: every heartbeat_s, the outermost open phase (and the innermost one, where it differs)."""
        if not self._open:
            return
        top = self._phases[self._open[0]]
        if now - top.said_at < self._heartbeat_s:
            return
        top.said_at = now
        text = f"{self._name}: {self._open[0]} {top.step}/{top.total} after {now - top.started:.0f} s"
        if len(self._open) > 1:
            inner = self._phases[self._open[-1]]
            text += f" ({self._open[-1]} {inner.step}/{inner.total})"
        self._line(text)

    def _draw(self, phase: str, p: _Phase, now: float) -> None:
        bar = self._bar
        new_phase = phase != self._current
        if new_phase:
            bar.reset(total=max(1, p.total))
            bar.set_description_str(f"{self._name}: {phase}", refresh=False)
        bar.total = max(1, p.total)
        bar.n = min(p.step, bar.total)
        if new_phase or now - self._shown >= REFRESH_S or p.step >= p.total:
            self._shown = now
            bar.refresh()

    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._out)
        else:
            print(text, file=self._out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
