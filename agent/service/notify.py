"""systemd integration: sd_notify messages, through systemd-python (journald logging: agent.service.journal).

Outside systemd (no NOTIFY_SOCKET) every message is only logged at DEBUG, so the daemon code calls the
same methods everywhere. Under systemd the module is required: a Type=notify unit whose process cannot
notify would only be killed after TimeoutStartSec with "start operation timed out", so the agent fails
at once with a message naming the missing package instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

log = logging.getLogger("agent.service")  # its lines keep the name they had (journald, greps)

MISSING_SYSTEMD = (
    "NOTIFY_SOCKET is set (systemd Type=notify) but systemd-python is not installed: "
    "pip install 'edge-agent[systemd]' (needs libsystemd-dev and pkg-config to build)"
)


class ServiceError(RuntimeError):
    """The service environment cannot be served (e.g. Type=notify without systemd-python)."""


def watchdog_interval(env: Mapping[str, str]) -> float | None:
    """WatchdogSec in seconds when systemd asked this process for pings (sd_watchdog_enabled rules)."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None  # meant for another process (inherited through a fork or exec)
    return int(usec) / 1e6


class Notifier:
    """sd_notify(3) messages. Thread-safe (each message is one datagram). `env` decides whether to notify
    and the watchdog interval; libsystemd itself takes NOTIFY_SOCKET from the process environment."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.active = bool(env.get("NOTIFY_SOCKET"))
        self.watchdog_s = watchdog_interval(env) if self.active else None
        self._notify: Callable[[str], bool] | None = None
        self._failed_logged = False
        if self.active:
            try:
                from systemd import daemon
            except ImportError:
                raise ServiceError(MISSING_SYSTEMD) from None
            self._notify = daemon.notify

    def send(self, *fields: str) -> None:
        message = "\n".join(fields)
        if self._notify is None:
            log.debug("sd_notify (not under systemd): %s", message.replace("\n", " | "))
            return
        if not self._notify(message) and not self._failed_logged:
            self._failed_logged = True  # once: the socket is gone, repeating it would flood the log
            log.warning("sd_notify failed (NOTIFY_SOCKET unreachable); systemd gets no more updates")

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={_one_line(status)}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={_one_line(status)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float, status: str) -> None:
        """Start-up or shutdown takes longer than the unit's timeout allows: ask for `seconds` more."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", f"STATUS={_one_line(status)}")

    def reloading(self) -> None:
        # MONOTONIC_USEC: systemd >= 253 matches it against the reload it asked for (Type=notify-reload).
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading configuration")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")


@contextmanager
def extending(notifier: Notifier, status: str, grant_s: float = 30.0) -> Iterator[None]:
    """While the block runs (loading and warming up an engine can take minutes on a Jetson), keep
    asking systemd for `grant_s` more start-up time, every grant_s/3 seconds."""
    if not notifier.active:
        yield
        return
    done = threading.Event()

    def keep() -> None:
        while True:
            notifier.extend_timeout(grant_s, status)
            if done.wait(grant_s / 3):
                return

    t = threading.Thread(target=keep, name="extend-timeout", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(1.0)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]
