"""The supervisor's side of one shard: its process, its pipe, its restarts.

One thread per shard reads the pipe (agent.shards.protocol): it keeps its own bookkeeping (started,
failed, answers, streamed frames) and hands every other message to the supervisor (`ShardEvents`); when the
process ends without being asked to (SIGKILL, a segfault in a decoder, out of memory), the thread says so,
waits a backoff (restart.min_s doubling up to restart.max_s; back to min_s after a shard ran STABLE_S) and
starts it again with its current part of the config.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from agent.config import AgentConfig, RestartConfig
from agent.shards.protocol import (
    Answer,
    Assign,
    Down,
    Failed,
    Frame,
    Reload,
    Snapshot,
    Started,
    Stop,
    Tap,
    Up,
)
from agent.shards.tracks import TrackEpochs

log = logging.getLogger(__name__)

_END = object()  # the end of a stream request
STABLE_S = 60.0  # a shard that ran this long starts the backoff afresh when it dies
_PKG_PARENT = str(Path(__file__).resolve().parents[2])  # where `agent` imports from, for the child


class ShardEvents(Protocol):
    def shard_started(self, k: int, pid: int) -> None: ...
    def shard_failed(self, k: int, error: str) -> None: ...
    def shard_exited(self, k: int, why: str, restart_in: float | None) -> None: ...
    def shard_message(self, k: int, msg: Up) -> None: ...


@dataclass
class _Pending:
    done: threading.Event
    ok: bool = False
    body: Any = None


def _reaped(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def exit_reason(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with status {code}"


class ShardHost:
    def __init__(
        self,
        index: int,
        gpu: int | None,
        part: AgentConfig,
        level: str,
        events: ShardEvents,
        restart: RestartConfig,
        epochs: TrackEpochs | None = None,
    ) -> None:
        self.index = index
        self.gpu = gpu
        self.part = part  # this shard's cameras and the models they use (replaced on reload)
        self._level = level
        self._events = events
        self._restart = restart
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None
        self._proc: Any = None
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[int, queue.Queue[Any]] = {}  # stream requests (tap): items, then _END
        self._ids = itertools.count(1)
        self.state = "starting"  # starting | running | restarting | failed | stopped
        self.pid: int | None = None
        self.restarts = 0
        self.starts = 0  # processes spawned: the first numbers its tracks from 1, a later one afresh
        self._epochs = epochs or TrackEpochs()  # the supervisor's, shared by its shards
        self.started_at: float | None = None
        self.last_exit: str | None = None
        self.failure: str | None = None  # why its last start failed (the shard's own words), until it runs
        self.first_outcome = threading.Event()  # the first start succeeded or failed

    # ---- life ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._life, name=f"shard-{self.index}", daemon=True)
        self._thread.start()

    def _spawn(self) -> tuple[subprocess.Popen[bytes], Connection]:
        """`python -m agent.shards.child FD` over one end of a socket pair (not multiprocessing's spawn: that
        re-imports the parent's __main__, and a launcher script without a __main__ guard then runs a whole
        second agent in every shard). The first message hands over the shard's index, config and level."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)  # READY/WATCHDOG come from the supervisor only
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)
        if self.gpu is not None:
            # pipeline.gpus counts as nvidia-smi and NVML do (PCI bus order), not CUDA's fastest-first order.
            env.update(CUDA_VISIBLE_DEVICES=str(self.gpu), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agent.shards.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # ours alone: recv() ends (EOFError) when the child's end goes with its process
        conn = Connection(ours.detach())
        assign = Assign(self.index, self.part, self._level, self._epochs.start(self.starts))
        self.starts += 1  # a start that died at once used its ids too: never handed out again
        with contextlib.suppress(OSError):  # it died at once: _life reads EOF, reaps it and says why
            conn.send(assign)
        return proc, conn

    def _life(self) -> None:
        delay = self._restart.min_s
        while not self._stopping.is_set():
            t0 = time.monotonic()
            try:
                self._proc, self._conn = self._spawn()
            except Exception as exc:  # e.g. out of processes: counts as a failed start
                log.error("shard %d: cannot start a process: %s", self.index, exc or repr(exc))
                self.last_exit = f"cannot start: {exc or repr(exc)}"
                self.failure = self.failure or self.last_exit
                self.first_outcome.set()
            else:
                self.pid = self._proc.pid
                self._read(self._conn)
                if not _reaped(self._proc, 5.0):  # its pipe closed but it lingers: make sure it is gone
                    self._proc.kill()
                    _reaped(self._proc, 5.0)
                self.last_exit = exit_reason(self._proc.returncode)
                if not self.first_outcome.is_set():  # gone before a word (an import error, a crash at init)
                    self.failure = self.failure or f"exited before it started ({self.last_exit})"
                    self.first_outcome.set()
                self._conn.close()
            self._fail_pending("shard stopped")
            if self._stopping.is_set():
                break
            if time.monotonic() - t0 >= STABLE_S:
                delay = self._restart.min_s
            self.state = "restarting"
            self.restarts += 1
            self._events.shard_exited(self.index, self.last_exit or "ended", delay)
            if self._stopping.wait(delay):
                break
            delay = min(delay * 2, self._restart.max_s)
        self.state = "stopped"
        self.first_outcome.set()

    def _read(self, conn: Connection) -> None:
        own = self.own_messages()
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # an unpicklable message: a bug in the shard, not a reason to lose it
                log.exception("shard %d: unreadable message", self.index)
                continue
            handler = own.get(type(msg))
            if handler is not None:
                handler(msg)
            else:
                self._events.shard_message(self.index, msg)

    def own_messages(self) -> dict[type, Callable[[Any], None]]:
        """The messages the host handles itself; every other goes to the supervisor (ShardEvents)."""
        return {Started: self._started, Failed: self._failed, Frame: self._frame, Answer: self._answer}

    def _started(self, msg: Started) -> None:
        self.state, self.started_at, self.failure = "running", time.monotonic(), None
        self._events.shard_started(self.index, msg.pid)
        self.first_outcome.set()

    def _failed(self, msg: Failed) -> None:
        self.state, self.failure = "failed", msg.error
        self._events.shard_failed(self.index, msg.error)
        self.first_outcome.set()

    def _frame(self, msg: Frame) -> None:
        stream = self._streams.get(msg.rid)
        if stream is not None:
            stream.put(msg.item)

    def _answer(self, msg: Answer) -> None:
        stream = self._streams.get(msg.rid)
        if stream is not None:  # the end of a stream request
            if not msg.ok:
                log.warning("shard %d: %s", self.index, msg.body)
            stream.put(_END)
            return
        pending = self._pending.pop(msg.rid, None)
        if pending is not None:
            pending.ok, pending.body = msg.ok, msg.body
            pending.done.set()

    # ---- requests --------------------------------------------------------------------------------
    def snapshot(self, camera: str, timeout: float) -> tuple[bool, Any]:
        return self.request(lambda rid: Snapshot(rid, camera), timeout)

    def reload(
        self, part: AgentConfig, timeout: float, first_ids: dict[str, int] | None = None
    ) -> tuple[bool, Any]:
        return self.request(lambda rid: Reload(rid, part, first_ids or {}), timeout)

    def request(self, make: Callable[[int], Down], timeout: float) -> tuple[bool, Any]:
        """Ask the shard (`make(rid)`: the request); (ok, body or error). Never raises: a gone shard is an
        error."""
        if self.state != "running" or self._conn is None:
            return False, f"shard {self.index} is {self.state}"
        rid = next(self._ids)
        pending = self._pending[rid] = _Pending(threading.Event())
        if not self._send(make(rid)):
            self._pending.pop(rid, None)
            return False, f"shard {self.index} is not reachable"
        if not pending.done.wait(timeout):
            self._pending.pop(rid, None)
            return False, f"shard {self.index} did not answer within {timeout:g} s"
        return pending.ok, pending.body

    def _send(self, msg: Down) -> bool:
        conn = self._conn
        if conn is None:
            return False
        with self._send_lock:
            try:
                conn.send(msg)
                return True
            except (OSError, EOFError, ValueError):
                return False

    def tap(
        self, model: str, total: int, interval_s: float, timeout_s: float, stop: threading.Event | None = None
    ) -> Iterator[Any]:
        """The model's pipeline frames (image, origin) from the shard; ends when the shard says so, stops or
        goes."""
        if self.state != "running":
            return
        rid = next(self._ids)
        items: queue.Queue[Any] = queue.Queue()
        self._streams[rid] = items
        try:
            if not self._send(Tap(rid, model, total, interval_s, timeout_s)):
                return
            while not (stop is not None and stop.is_set()):
                try:
                    item = items.get(timeout=0.5)
                except queue.Empty:
                    if self.state != "running":
                        return
                    continue
                if item is _END:
                    return
                yield item
        finally:
            self._streams.pop(rid, None)

    def _fail_pending(self, why: str) -> None:
        for items in list(self._streams.values()):
            items.put(_END)
        for rid in list(self._pending):
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending.ok, pending.body = False, f"shard {self.index}: {why}"
                pending.done.set()

    def ask_stop(self) -> None:
        self._stopping.set()
        self._send(Stop())

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the shard to stop (its cameras publish `stopped`), then make sure it is gone. The life thread
        alone joins the process: of two threads waiting for one child, the one that loses the race sees it
        alive (ECHILD) and warned, and signalled a pid already reaped."""
        self.ask_stop()
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("shard %d: did not stop within %.0f s; killing it", self.index, timeout)
            proc = self._proc
            if proc is not None:
                proc.kill()
            thread.join(10.0)  # its pipe closes: the life thread reaps the process

    def kill(self) -> None:
        """SIGKILL the process (tests, a hung shard); the life thread restarts it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
