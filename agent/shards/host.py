"""The supervisor's side of one shard: its process, its pipe, its restarts.

One thread per shard reads the pipe and hands each message to the supervisor (`ShardEvents`); when the
process ends without being asked to (SIGKILL, a segfault in a decoder, out of memory), the thread says so,
waits a backoff (restart.min_s doubling up to restart.max_s; back to min_s after a shard ran STABLE_S) and
starts it again with its current part of the config.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from agent.config import AgentConfig, RestartConfig
from agent.shards.child import shard_main

log = logging.getLogger(__name__)

_END = object()  # the end of a stream request
STABLE_S = 60.0  # a shard that ran this long starts the backoff afresh when it dies
_ENV_LOCK = threading.Lock()  # CUDA_VISIBLE_DEVICES is set around a spawn (the child copies the environment)


class ShardEvents(Protocol):
    def shard_started(self, k: int, pid: int) -> None: ...
    def shard_failed(self, k: int, error: str) -> None: ...
    def shard_exited(self, k: int, why: str, restart_in: float | None) -> None: ...
    def shard_message(self, k: int, msg: tuple) -> None: ...


@dataclass
class _Pending:
    done: threading.Event
    ok: bool = False
    body: Any = None


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
        spawn: Callable[..., Any] | None = None,
    ) -> None:
        self.index = index
        self.gpu = gpu
        self.part = part  # this shard's cameras and the models they use (replaced on reload)
        self._level = level
        self._events = events
        self._restart = restart
        self._ctx = mp.get_context("spawn")  # never fork: the supervisor holds threads (MQTT, builds)
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
        self.started_at: float | None = None
        self.last_exit: str | None = None
        self.failure: str | None = None  # why its last start failed (the shard's own words), until it runs
        self.first_outcome = threading.Event()  # the first start succeeded or failed

    # ---- life ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._life, name=f"shard-{self.index}", daemon=True)
        self._thread.start()

    def _spawn(self) -> tuple[Any, Connection]:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=shard_main,
            args=(self.index, self.part, child, self._level),
            name=f"edge-agent-shard{self.index}",
        )
        # pipeline.gpus counts as nvidia-smi and NVML do (PCI bus order), not CUDA's fastest-first order.
        pinned = (
            {"CUDA_VISIBLE_DEVICES": str(self.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            if self.gpu is not None
            else {}
        )
        with _ENV_LOCK:
            old = {k: os.environ.get(k) for k in pinned}
            os.environ.update(pinned)
            try:
                proc.start()
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        child.close()  # ours closed: recv() ends (EOFError) when the child's end goes with its process
        return proc, parent

    def _life(self) -> None:
        delay = self._restart.min_s
        while not self._stopping.is_set():
            t0 = time.monotonic()
            try:
                self._proc, self._conn = self._spawn()
            except Exception as exc:  # e.g. out of processes: counts as a failed start
                log.error("shard %d: cannot start a process: %s", self.index, exc)
                self.last_exit = f"cannot start: {exc}"
            else:
                self.pid = self._proc.pid
                self._read(self._conn)
                self._proc.join(5.0)
                if self._proc.is_alive():  # its pipe closed but it lingers: make sure it is gone
                    self._proc.kill()
                    self._proc.join(5.0)
                self.last_exit = exit_reason(self._proc.exitcode)
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
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # an unpicklable message: a bug in the shard, not a reason to lose it
                log.exception("shard %d: unreadable message", self.index)
                continue
            kind = msg[0]
            if kind == "started":
                self.state, self.started_at, self.failure = "running", time.monotonic(), None
                self._events.shard_started(self.index, msg[1])
                self.first_outcome.set()
            elif kind == "failed":
                self.state, self.failure = "failed", msg[1]
                self._events.shard_failed(self.index, msg[1])
                self.first_outcome.set()
            elif kind == "frame":
                stream = self._streams.get(msg[1])
                if stream is not None:
                    stream.put(msg[2])
            elif kind == "answer" and msg[1] in self._streams:
                if not msg[2]:
                    log.warning("shard %d: %s", self.index, msg[3])
                self._streams[msg[1]].put(_END)
            elif kind == "answer":
                pending = self._pending.pop(msg[1], None)
                if pending is not None:
                    pending.ok, pending.body = msg[2], msg[3]
                    pending.done.set()
            else:
                self._events.shard_message(self.index, msg)

    # ---- requests --------------------------------------------------------------------------------
    def request(self, kind: str, arg: Any, timeout: float) -> tuple[bool, Any]:
        """Ask the shard (snapshot, reload); (ok, body or error). Never raises: a gone shard is an error."""
        if self.state != "running" or self._conn is None:
            return False, f"shard {self.index} is {self.state}"
        rid = next(self._ids)
        pending = self._pending[rid] = _Pending(threading.Event())
        if not self._send(kind, rid, arg):
            self._pending.pop(rid, None)
            return False, f"shard {self.index} is not reachable"
        if not pending.done.wait(timeout):
            self._pending.pop(rid, None)
            return False, f"shard {self.index} did not answer within {timeout:g} s"
        return pending.ok, pending.body

    def _send(self, *msg: Any) -> bool:
        conn = self._conn
        if conn is None:
            return False
        with self._send_lock:
            try:
                conn.send(msg)
                return True
            except (OSError, EOFError, ValueError):
                return False

    def stream(self, kind: str, arg: Any, stop: threading.Event | None = None) -> Iterator[Any]:
        """A request answered by many items (tap: frames); ends when the shard says so, stops or goes."""
        if self.state != "running":
            return
        rid = next(self._ids)
        items: queue.Queue[Any] = queue.Queue()
        self._streams[rid] = items
        try:
            if not self._send(kind, rid, arg):
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
        self._send("stop")

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
        if proc is not None and proc.is_alive():
            proc.kill()
