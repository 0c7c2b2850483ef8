"""The shard's end of its pipe to the supervisor (message kinds: agent.shards.child). The daemon's Agent
sends its camera, telemetry and engine news through it; apart from the daemon so that neither imports the
other."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

from engines.precision import Precision


class ShardLink:
    """The shard's end of the pipe; thread-safe sends; a lost pipe stops the shard."""

    def __init__(self, index: int, conn: Connection) -> None:
        self.index = index
        self._conn = conn
        self._lock = threading.Lock()
        self.lost = threading.Event()

    def send(self, *msg: Any) -> None:
        if self.lost.is_set():
            return
        with self._lock:
            try:
                self._conn.send(msg)
            except (OSError, EOFError, ValueError):  # the supervisor is gone: stop (main loop)
                self.lost.set()

    # ---- what the Agent calls ------------------------------------------------------------------
    def camera_state(self, camera: str, state: str, reason: str | None) -> None:
        self.send("camera", camera, state, reason)

    def telemetry(self, fields: dict[str, Any], stages: dict[str, Any]) -> None:
        self.send("telemetry", fields, stages)

    def engine_state(self, model: str, fields: dict[str, Any]) -> None:
        self.send("engine", model, fields)

    def request_rebuild(
        self, model: str, force: bool, precision: Precision | None, reasons: list[str] | None
    ) -> bool:
        self.send("rebuild", model, force, precision, reasons)
        return True  # asked: the supervisor's manager starts it, or says it is already under way
