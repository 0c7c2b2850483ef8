"""A shard process: a LocalRuntime over the cameras the supervisor gave it, linked by one pipe.

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

from agent.config import AgentConfig
from agent.service.heap import HEAP
from agent.service.logs import setup_logging
from agent.shards.link import ShardLink, ShardOutlet
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
    """The shard process (main() below): a LocalRuntime on this shard's cameras, publishing through its own
    MQTT client and the pipe; serves the supervisor's requests until told to stop, then stops it."""
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(key, None)  # READY/WATCHDOG come from the supervisor only
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # the supervisor's to act on (docstring)
        signal.signal(sig, signal.SIG_IGN)
    _logging(assign.index, assign.level)
    link = ShardLink(assign.index, conn)
    from agent.lifecycle.roles import ShardRole  # heavy imports after the signals are set
    from agent.runtime.local import LocalRuntime
    from agent.telemetry import process_stats

    outlet = ShardOutlet(link, assign.part)
    runtime = LocalRuntime(assign.part, role=ShardRole(link.request_rebuild), first_id=assign.first_id)
    runtime.attach(outlet)
    try:
        runtime.open()
        if outlet.mqtt is not None:
            outlet.mqtt.start()
        runtime.start()
    except Exception as exc:  # the supervisor reports it (start-up: an error; later: restarts with backoff)
        link.send(Failed(str(exc) or repr(exc)))
        runtime.stop()
        outlet.close()
        sys.exit(EXIT_START_FAILED)
    process_stats()  # primes psutil's CPU counter so the first telemetry has a real value
    link.send(Started(os.getpid()))
    shard = _Shard(runtime, outlet, stop)
    for target, name in ((shard.report, "shard-progress"), (shard.telemetry, "telemetry")):
        threading.Thread(target=target, name=name, daemon=True).start()
    try:
        _serve(shard, link, conn, stop)
    finally:
        stop.set()
        runtime.stop()
        outlet.close()


class _Shard:
    """This process's runtime and outlet, as the pipe's requests and the report threads use them."""

    def __init__(self, runtime: Any, outlet: ShardOutlet, stop: threading.Event) -> None:
        self.runtime, self.outlet, self.stop = runtime, outlet, stop

    @property
    def taps(self) -> Any:
        return self.runtime.taps

    def snapshot(self, camera: str) -> dict[str, Any]:
        return dict(self.runtime.snapshot(camera))

    def apply_config(self, new: AgentConfig, first_ids: dict[str, int]) -> str:
        """A reload: the supervisor read, checked and placed the config; this applies this shard's part in
        place (plan -> prepare -> commit, as a device does) and says what changed. `first_ids`: where the
        track ids of the cameras handed to this shard start (agent.shards.tracks)."""
        from agent.config.reload import plan_reload

        runtime, outlet = self.runtime, self.outlet
        runtime.pipeline.raise_first_ids(first_ids)
        plan = plan_reload(runtime.cfg, new)
        prepared = runtime.prepare(new, plan)
        try:
            client = outlet.make_mqtt(new) if plan.mqtt else None
        except Exception:
            prepared.rollback()
            raise

        def switch() -> None:
            if plan.mqtt:
                outlet.replace_mqtt(client, new)
            if plan.log_level:
                logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))

        changes = str(prepared.commit(switch))
        HEAP.request()  # a shard's reload frees what it replaced, as a device's (agent.service.heap)
        return changes

    def report(self) -> None:
        """The progress every PROGRESS_S (the supervisor's READY, STATUS, WATCHDOG and hang check)."""
        while not self.stop.wait(PROGRESS_S):
            try:
                self.outlet.link.send(ProgressReport(self.runtime.progress()))
            except Exception:
                log.exception("shard progress report failed")

    def telemetry(self) -> None:
        """Every telemetry.interval_s: the fields and the stage samples to the supervisor, which publishes
        one payload for every shard; the camera states again on this shard's client."""
        while not self.stop.wait(self.runtime.cfg.telemetry.interval_s):
            try:
                mqtt = self.outlet.mqtt.stats() if self.outlet.mqtt is not None else None
                runtime = self.runtime
                self.outlet.link.telemetry(runtime.telemetry_fields(mqtt), runtime.stages.drain())
                runtime.after_telemetry()
            except Exception:  # the line and its logger name as a device's (agent.device)
                logging.getLogger("agent.owner").exception("telemetry failed")
            HEAP.tick()


class _Requests:
    """The shard's side of the protocol: one handler per request type (`table`); each answers once."""

    def __init__(self, agent: Any, link: ShardLink, stop: threading.Event) -> None:
        self.agent, self.link, self.stop = agent, link, stop
        self.table: dict[type, Callable[[Any], None]] = {
            Snapshot: lambda m: self._answer(m.rid, "snapshot", lambda: agent.snapshot(m.camera)),
            Reload: lambda m: self._answer(m.rid, "reload", lambda: agent.apply_config(m.part, m.first_ids)),
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
