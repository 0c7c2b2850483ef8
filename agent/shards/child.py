"""A shard process: the daemon's Agent over the cameras the supervisor gave it, linked by one pipe.

Messages: agent.shards.protocol. The supervisor's first is `Assign` (index, config part, log level, first
track id); the shard answers `Started` or `Failed` once, then sends camera states, a progress report every
PROGRESS_S, telemetry, engine states, rebuild requests, copies of its object and zone events and of its
zone/line states (so the supervisor can close them if this process dies), and the answers to the
supervisor's `Snapshot`, `Reload` and `Tap` requests (a tap streams `Frame`s before its `Answer`).

The shard never talks to systemd (NOTIFY_SOCKET is removed from its environment) and ignores SIGINT,
SIGHUP and SIGTERM: `systemctl stop` sends SIGTERM to the whole cgroup, and a shard that exited on its own
would race the supervisor (which would report its cameras `reconnecting` and restart it). The supervisor
stops it through the pipe, its cameras publish `stopped`; a shard also stops when the pipe closes (the
supervisor is gone, even by SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from agent.logs import setup_logging
from agent.shards.link import ShardLink
from agent.shards.protocol import (
    Answer,
    Assign,
    Failed,
    Frame,
    ProgressReport,
    Reload,
    Snapshot,
    Started,
    Stop,
    Tap,
)

log = logging.getLogger(__name__)

PROGRESS_S = 1.0
EXIT_START_FAILED = 3


class ShardFields(logging.Filter):
    """SHARD= on every record (journald field; `journalctl -u edge-agent SHARD=2`)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = str(index)

    def filter(self, record: logging.LogRecord) -> bool:
        record.SHARD = self.index
        return True


def _logging(index: int, level: str) -> None:
    setup_logging(level)
    for handler in logging.getLogger().handlers:
        handler.addFilter(ShardFields(index))
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout):
            fmt = f"%(asctime)s %(levelname)-7s shard{index} %(name)s: %(message)s"
            handler.setFormatter(logging.Formatter(fmt))


def shard_main(assign: Assign, conn: Connection) -> None:
    """The shard process (main() below): start the Agent on this shard's cameras, serve the supervisor's
    requests until told to stop, then stop it."""
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(key, None)  # READY/WATCHDOG come from the supervisor only
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # the supervisor's to act on (docstring)
        signal.signal(sig, signal.SIG_IGN)
    _logging(assign.index, assign.level)
    link = ShardLink(assign.index, conn)
    from agent.daemon import Agent  # heavy imports after the signals are set

    agent = Agent(assign.part, shard=link, first_id=assign.first_id)
    try:
        agent.start()
    except Exception as exc:  # the supervisor reports it (start-up: an error; later: restarts with backoff)
        link.send(Failed(str(exc) or repr(exc)))
        agent.stop()
        sys.exit(EXIT_START_FAILED)
    link.send(Started(os.getpid()))
    reporter = threading.Thread(target=_report, args=(agent, link, stop), name="shard-progress", daemon=True)
    reporter.start()
    try:
        _serve(agent, link, conn, stop)
    finally:
        stop.set()
        agent.stop()


def _report(agent: Any, link: ShardLink, stop: threading.Event) -> None:
    while not stop.wait(PROGRESS_S):
        try:
            link.send(ProgressReport(agent.progress()))
        except Exception:
            log.exception("shard progress report failed")


class _Requests:
    """The shard's side of the protocol: one handler per request type (`table`); each answers once."""

    def __init__(self, agent: Any, link: ShardLink, stop: threading.Event) -> None:
        self.agent, self.link, self.stop = agent, link, stop
        self.table: dict[type, Callable[[Any], None]] = {
            Snapshot: lambda m: self._answer(m.rid, "snapshot", lambda: agent.snapshot(m.camera)),
            Reload: lambda m: self._answer(m.rid, "reload", lambda: agent.apply_config(m.part)),
            Tap: self._tap,
        }

    def _answer(self, rid: int, what: str, work: Callable[[], Any]) -> None:
        from agent.mqtt.commands import CommandError

        try:
            body = work()
        except CommandError as exc:
            self.link.send(Answer(rid, False, str(exc)))
        except Exception as exc:  # a reload that failed here: the supervisor reports it
            log.exception("shard request %s failed", what)
            self.link.send(Answer(rid, False, f"{type(exc).__name__}: {exc}"))
        else:
            self.link.send(Answer(rid, True, body))

    def _tap(self, req: Tap) -> None:
        """Frames for a build: streamed from a thread, requests go on meanwhile."""
        args = (self.agent, self.link, req, self.stop)
        threading.Thread(target=_tap, args=args, name="shard-tap", daemon=True).start()


def _serve(agent: Any, link: ShardLink, conn: Connection, stop: threading.Event) -> None:
    requests = _Requests(agent, link, stop)
    while not stop.is_set() and not link.lost.is_set():
        try:
            if not conn.poll(0.5):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the supervisor is gone
        if isinstance(msg, Stop):
            return
        handler = requests.table.get(type(msg))
        if handler is None:
            log.warning("shard %d: unknown request %r", link.index, type(msg).__name__)
            continue
        handler(msg)


def _tap(agent: Any, link: ShardLink, req: Tap, stop: threading.Event) -> None:
    """The model's FrameTap (the running pipeline's frames, one per camera per interval) to the supervisor,
    where the engine job of every shard is prepared."""
    tap = agent.taps.get(req.model)
    if tap is None:
        link.send(Answer(req.rid, False, f"shard {link.index}: no pipeline for model {req.model}"))
        return
    n = 0
    try:
        for item in tap.frames(req.total, req.interval_s, req.timeout_s, stop):
            link.send(Frame(req.rid, item))
            n += 1
    except Exception as exc:  # e.g. a capture already running for this model
        link.send(Answer(req.rid, False, str(exc)))
        return
    link.send(Answer(req.rid, True, n))


def main() -> None:
    """`python -m agent.shards.child FD` (agent.shards.host): FD is this shard's end of the socket pair; the
    first message on it is an `Assign`."""
    conn = Connection(int(sys.argv[1]))
    try:
        assign = conn.recv()
    except (EOFError, OSError, ValueError):
        sys.exit(2)  # the supervisor went before handing anything over
    if not isinstance(assign, Assign):
        sys.exit(2)
    shard_main(assign, conn)


if __name__ == "__main__":
    main()
