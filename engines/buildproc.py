"""Engine builds in a child process, so the daemon keeps serving (ONNX Runtime) while TensorRT builds.

Parent side:
    handle = start_build_process("detector", settings, engine_dir, force=False, on_event=print,
                                 agent_version="0.1.0", lock_wait_s=0)
    handle.kill()              # SIGKILL; leaves no loadable partial plan (temp names never match)
    result = handle.wait()     # the final event as a dict (see below)

Child side: `python -m engines.buildproc` reads one JSON request on stdin
    {"model", "engine_dir", "settings": BuildSettings.to_request(), "force", "agent_version", "lock_wait_s",
     "trt_flavor"}
and prints JSON lines on stdout:
    {"event": "progress", "phase": str, "step": int, "total": int}
    {"event": "result", "ok": bool, "built": bool, "key": str|null, "plan": str|null, "manifest": dict|null,
     "build_s": float, "message": str, "reasons": [str], "error": str|null, "error_type": str|null}
It does lock -> check -> build -> store (engines.builder.build). TensorRT's log goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from engines.settings import BuildSettings

Event = dict[str, Any]
_PKG_PARENT = str(Path(__file__).resolve().parent.parent)


def failure(error: str, error_type: str) -> Event:
    """The result event of a build that did not happen."""
    return {
        "event": "result",
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


def success(result: Any, **extra: Any) -> Event:
    """The result event of a finished build (an engines.builder.BuildResult), plus `extra` fields."""
    return {
        "event": "result",
        "ok": True,
        "built": result.built,
        "key": result.key,
        "plan": str(result.plan_path),
        "manifest": result.manifest.to_dict() if result.manifest else None,
        "build_s": round(result.build_s, 3),
        "message": result.message,
        "reasons": result.reasons,
        "error": None,
        "error_type": None,
        **extra,
    }


def json_lines_stdout() -> Callable[[Event], None]:
    """An emitter of JSON lines on the real stdout, with fd 1 pointed at stderr from now on.

    Native TensorRT/CUDA code may print to fd 1; the parent reads only our JSON lines from stdout.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(event: Event) -> None:
        out.write(json.dumps(event) + "\n")

    return emit


class BuildProcess:
    """Handle of a running build child: `.pid`, `.kill()`, `.wait(timeout)` -> final result dict."""

    def __init__(self, proc: subprocess.Popen[bytes], on_event: Callable[[Event], None] | None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._on_event = on_event
        self._result: Event | None = None
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
                event = json.loads(raw)
            except ValueError:
                self._stderr.append(raw.decode(errors="replace").rstrip())
                continue
            if event.get("event") == "result":
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

    def wait(self, timeout: float | None = None) -> Event:
        """Wait for the child; return its result event, or a failure result if it died without one."""
        rc = self.proc.wait(timeout)
        self._out.join()
        self._err.join()
        if self._result is not None:
            return self._result
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        tail = " | ".join(line for line in self._stderr if line)[-2000:]
        error = f"build process {self.pid} {how} before reporting a result" + (
            f" (stderr: {tail})" if tail else ""
        )
        return failure(error, "Killed" if self._killed or rc < 0 else "Crashed")


def start_build_process(
    model: str,
    settings: BuildSettings,
    engine_dir: str | Path,
    *,
    force: bool = False,
    on_event: Callable[[Event], None] | None = None,
    agent_version: str = "unknown",
    lock_wait_s: float | None = 0.0,
    trt_flavor: str | None = None,
    python: str = sys.executable,
) -> BuildProcess:
    request = {
        "model": model,
        "engine_dir": str(engine_dir),
        "settings": settings.to_request(),
        "force": force,
        "agent_version": agent_version,
        "lock_wait_s": lock_wait_s,
        "trt_flavor": trt_flavor,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [python, "-m", "engines.buildproc"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(request).encode())
    proc.stdin.close()
    return BuildProcess(proc, on_event)


def run_build_process(*args: Any, **kwargs: Any) -> Event:
    """start_build_process(...).wait(): the blocking form for the CLI."""
    return start_build_process(*args, **kwargs).wait()


# --- child ------------------------------------------------------------------------------------
def _serve(request: dict[str, Any], emit: Callable[[Event], None]) -> Event:
    from engines.builder import build
    from engines.errors import EngineError
    from engines.store import EngineStore
    from engines.trt_api import import_trt

    model = str(request.get("model"))
    try:
        settings = BuildSettings.from_request(request["settings"])
        store = EngineStore(request["engine_dir"])
        api = import_trt(request.get("trt_flavor"))
        result = build(
            store,
            model,
            settings,
            api=api,
            force=bool(request.get("force")),
            agent_version=str(request.get("agent_version", "unknown")),
            lock_wait_s=request.get("lock_wait_s", 0.0),
            on_progress=lambda phase, step, total: emit(
                {"event": "progress", "phase": phase, "step": step, "total": total}
            ),
        )
    except (EngineError, ValueError, KeyError, OSError) as e:
        return failure(f"model {model!r}: {e}", type(e).__name__)
    return success(result)


def main() -> int:
    emit = json_lines_stdout()
    logging.basicConfig(
        level=os.environ.get("EDGE_AGENT_BUILD_LOG", "WARNING"),
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )

    try:
        request = json.loads(sys.stdin.read())
    except ValueError as e:
        emit(failure(f"bad build request on stdin: {e}", "ValueError"))
        return 2
    result = _serve(request, emit)
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
