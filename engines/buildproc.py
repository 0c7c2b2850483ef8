"""Child processes for engine work, so the daemon keeps serving while TensorRT builds.

    handle = start_child([sys.executable, "-m", "agent.lifecycle.job"], request, on_event=print)
    handle.kill()              # SIGKILL; leaves no loadable partial plan (engines.store writes atomically)
    result = handle.wait()     # the final event: a Result

Protocol: the parent writes one JSON request on the child's stdin and closes it; the child prints JSON
lines on stdout, progress events `{"event": "progress", "phase", "step", "total"}` and last one
`{"event": "result", "ok": bool, ...}`; its logs (and TensorRT's) go to stderr, whose tail is kept for
the error of a child that dies without a result. There is one such child: agent.lifecycle.job.
Both sides hold events as Progress and Result; the JSON form exists only on the pipe (to_wire,
event_from_wire).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

_PKG_PARENT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Progress:
    """A phase of the job at step `step` of `total` (step == total: the phase is done)."""

    phase: str
    step: int
    total: int

    def to_wire(self) -> dict[str, Any]:
        return {"event": "progress", "phase": self.phase, "step": self.step, "total": self.total}


@dataclass(frozen=True)
class Result:
    """The child's last event. `fields` are its job's result (agent.lifecycle.job.JobResult reads
    them); `ok`, `error` and `error_type` are in every result, a failure's included."""

    fields: dict[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.fields.get("ok"))

    @property
    def error(self) -> str | None:
        return self.fields.get("error")

    def to_wire(self) -> dict[str, Any]:
        return {"event": "result", **self.fields}


Event = Progress | Result


def event_from_wire(obj: Any) -> Event | None:
    """The event a JSON line carries; None for anything else (native code printing JSON-like text)."""
    if not isinstance(obj, dict):
        return None
    kind = obj.get("event")
    if kind == "progress":
        return Progress(str(obj.get("phase")), int(obj.get("step") or 0), int(obj.get("total") or 0))
    if kind == "result":
        return Result({k: v for k, v in obj.items() if k != "event"})
    return None


def failure(error: str, error_type: str) -> Result:
    """The result of a job that did not happen (or a child that died before reporting)."""
    return Result(
        {
            "ok": False,
            "built": False,
            "key": None,
            "plan": None,
            "manifest": None,
            "build_s": 0.0,
            "message": "",
            "reasons": [],
            "error": error,
            "error_type": error_type,
        }
    )


def json_lines_stdout() -> Callable[[Event], None]:
    """An emitter of JSON lines on the real stdout, with fd 1 pointed at stderr from now on.

    Native TensorRT/CUDA code may print to fd 1; the parent reads only our JSON lines from stdout.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(event: Event) -> None:
        out.write(json.dumps(event.to_wire()) + "\n")

    return emit


class ChildProcess:
    """Handle of a running child: `.pid`, `.kill()`, `.wait(timeout)` -> its Result."""

    def __init__(self, proc: subprocess.Popen[bytes], on_event: Callable[[Event], None] | None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._on_event = on_event
        self._result: Result | None = None
        self._stderr: deque[str] = deque(maxlen=40)
        self._killed = False
        assert proc.stdout is not None and proc.stderr is not None
        self._out = threading.Thread(target=self._read_stdout, args=(proc.stdout,), daemon=True)
        self._err = threading.Thread(target=self._read_stderr, args=(proc.stderr,), daemon=True)
        self._out.start()
        self._err.start()

    def _read_stdout(self, stream: IO[bytes]) -> None:
        for raw in stream:
            try:
                event = event_from_wire(json.loads(raw))
            except (ValueError, TypeError):
                event = None
            if event is None:
                self._stderr.append(raw.decode(errors="replace").rstrip())
                continue
            if isinstance(event, Result):
                self._result = event
            if self._on_event is not None:
                try:
                    self._on_event(event)
                except Exception:  # a broken callback must not stop us reading (the child would block)
                    logging.getLogger("engines.buildproc").exception("on_event callback failed")

    def _read_stderr(self, stream: IO[bytes]) -> None:
        # Drained continuously: a full stderr pipe would block the child mid-build.
        for raw in stream:
            self._stderr.append(raw.decode(errors="replace").rstrip())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self._killed = True
            self.proc.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> Result:
        """Wait for the child; return its result event, or a failure result if it died without one."""
        rc = self.proc.wait(timeout)
        self._out.join()
        self._err.join()
        if self._result is not None:
            return self._result
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        tail = " | ".join(line for line in self._stderr if line)[-2000:]
        error = f"child process {self.pid} {how} before reporting a result" + (
            f" (stderr: {tail})" if tail else ""
        )
        return failure(error, "Killed" if self._killed or rc < 0 else "Crashed")


PARENT_ENV = "EDGE_AGENT_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Child side: be killed when the parent dies, however it dies (SIGKILL included), so a killed
    daemon or `edge-agent rebuild` never leaves an orphan build holding the model's lock. Linux only
    (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    parent = os.environ.get(PARENT_ENV)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and str(os.getppid()) != parent:  # the parent died before prctl took effect
        os._exit(1)


def start_child(
    argv: list[str],
    request: dict[str, Any],
    on_event: Callable[[Event], None] | None,
    extra_env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> ChildProcess:
    """Start `argv` (a Python child speaking this protocol) and hand it `request` as JSON on stdin.
    `pass_fds`: descriptors the child inherits (the model's build lock its parent holds)."""
    env = dict(os.environ)
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    env[PARENT_ENV] = str(os.getpid())
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        pass_fds=pass_fds,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(request).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the child died at once; wait() reports it with its stderr
        pass
    return ChildProcess(proc, on_event)
