"""A systemd notify socket for tests: a Unix datagram socket, as systemd gives in NOTIFY_SOCKET."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path


class NotifySocket:
    """Collects every sd_notify datagram as (monotonic arrival time, {FIELD: value})."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._lock = threading.Lock()
        self._messages: list[tuple[float, dict[str, str]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self._messages.append((time.monotonic(), fields))

    @property
    def messages(self) -> list[tuple[float, dict[str, str]]]:
        with self._lock:
            return list(self._messages)

    def times(self, key: str, value: str | None = None) -> list[float]:
        return [t for t, m in self.messages if key in m and (value is None or m[key] == value)]

    def lifecycle(self) -> list[str]:
        """The lifecycle keys in arrival order (READY, RELOADING, STOPPING), without WATCHDOG/STATUS."""
        order = ("READY", "RELOADING", "STOPPING")
        return [k for _, m in self.messages for k in order if k in m]

    def wait_for(self, cond: Callable[[list[tuple[float, dict[str, str]]]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond(self.messages):
                return True
            time.sleep(0.02)
        return cond(self.messages)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(1.0)
