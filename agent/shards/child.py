"""A shard process: the daemon's Agent over the cameras the supervisor gave it, linked by one pipe.

Messages (tuples, first item the kind; agent.shards.host reads them):
- to the supervisor: ("started", pid) | ("failed", error) once; then ("camera", name, state, reason),
  ("progress", Progress) every PROGRESS_S, ("telemetry", fields, stage samples), ("engine", model,
  fields), ("rebuild", model, force, precision, reasons), ("answer", request id, ok, body or error);
- from it: ("stop",), ("snapshot", id, camera), ("reload", id, config part), ("tap", id, (model, total,
  interval_s, timeout_s)): frames of the model's pipeline for the accuracy gate or INT8 calibration,
  answered by ("frame", id, (image, origin)) messages and then ("answer", id, ok, count).

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
from multiprocessing.connection import Connection
from typing import Any

from agent.config import AgentConfig
from agent.logs import setup_logging
from agent.shards.link import ShardLink

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


def shard_main(index: int, cfg: AgentConfig, conn: Connection, level: str) -> None:
    """The shard process (main() below): start the Agent on this shard's cameras, serve the supervisor's
    requests until told to stop, then stop it."""
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(key, None)  # READY/WATCHDOG come from the supervisor only
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # the supervisor's to act on (docstring)
        signal.signal(sig, signal.SIG_IGN)
    _logging(index, level)
    link = ShardLink(index, conn)
    from agent.daemon import Agent  # heavy imports after the signals are set

    agent = Agent(cfg, shard=link)
    try:
        agent.start()
    except Exception as exc:  # the supervisor reports it (start-up: an error; later: restarts with backoff)
        link.send("failed", str(exc) or repr(exc))
        agent.stop()
        sys.exit(EXIT_START_FAILED)
    link.send("started", os.getpid())
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
            link.send("progress", agent.progress())
        except Exception:
            log.exception("shard progress report failed")


def _serve(agent: Any, link: ShardLink, conn: Connection, stop: threading.Event) -> None:
    from agent.mqtt.commands import CommandError

    while not stop.is_set() and not link.lost.is_set():
        try:
            if not conn.poll(0.5):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the supervisor is gone
        kind = msg[0]
        if kind == "stop":
            return
        rid = msg[1]
        if kind == "tap":  # frames for a build: streamed from a thread, requests go on meanwhile
            args = (agent, link, rid, *msg[2], stop)
            threading.Thread(target=_tap, args=args, name="shard-tap", daemon=True).start()
            continue
        try:
            if kind == "snapshot":
                body: Any = agent.snapshot(msg[2])
            elif kind == "reload":
                body = agent.apply_config(msg[2])
            else:
                raise CommandError(f"shard: unknown request {kind!r}")
        except CommandError as exc:
            link.send("answer", rid, False, str(exc))
        except Exception as exc:  # a reload that failed here: the supervisor reports it
            log.exception("shard request %s failed", kind)
            link.send("answer", rid, False, f"{type(exc).__name__}: {exc}")
        else:
            link.send("answer", rid, True, body)


def _tap(
    agent: Any,
    link: ShardLink,
    rid: int,
    model: str,
    total: int,
    interval_s: float,
    timeout_s: float,
    stop: threading.Event,
) -> None:
    """The model's FrameTap (the running pipeline's frames, one per camera per interval) to the supervisor,
    where the engine job of every shard is prepared."""
    tap = agent.taps.get(model)
    if tap is None:
        link.send("answer", rid, False, f"shard {link.index}: no pipeline for model {model}")
        return
    n = 0
    try:
        for item in tap.frames(total, interval_s, timeout_s, stop):
            link.send("frame", rid, item)
            n += 1
    except Exception as exc:  # e.g. a capture already running for this model
        link.send("answer", rid, False, str(exc))
        return
    link.send("answer", rid, True, n)


def main() -> None:
    """`python -m agent.shards.child FD` (agent.shards.host): FD is this shard's end of the socket pair; the
    first message on it is ("shard", index, config part, log level)."""
    conn = Connection(int(sys.argv[1]))
    try:
        kind, index, cfg, level = conn.recv()
    except (EOFError, OSError, ValueError):
        sys.exit(2)  # the supervisor went before handing anything over
    if kind != "shard":
        sys.exit(2)
    shard_main(index, cfg, conn, level)


if __name__ == "__main__":
    main()
