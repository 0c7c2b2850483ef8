"""Other processes publishing as this device id, seen on our own status topic, and our answers to them.

Client ids are random per process: two processes with one device id (a copied config, a restart while the
old process still runs) must not take each other's session at the broker in turn forever. The `instance`
in every status tells them apart; each agent answers a new one with its own status so that the last word
on the retained topic is always a live agent's.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable

log = logging.getLogger("agent.mqtt")

_DUPLICATES_MAX = 16  # other instances remembered (and logged) at once
_DUPLICATE_LOGS_MAX = 16  # ERROR lines about new instances per process; later ones are only counted
_STATUS_MAX_BYTES = 65536  # a status on our topic larger than this is not an agent's
_INSTANCE = re.compile(r"[0-9a-f]{8}")
_ANSWER_INTERVAL_S = 1.0  # at most one status answer per second (someone may flood our status topic)


class Duplicates:
    """The other live instances using our device id: instance -> time last seen."""

    def __init__(self, device: str, instance: str) -> None:
        self._device, self._instance = device, instance
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}
        self._generation = 0  # bumped on every change: a status built before it is stale
        self._logs = 0

    def current(self) -> list[str]:
        with self._lock:
            return sorted(self._seen)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def observe(self, raw: bytes, retained: bool) -> bool:
        """A status on our own topic; True when ours must be published again (a new instance, or an offline
        status from another one, which replaced ours at the broker).

        Retained copies (sent at subscribe) are skipped: an earlier run that crashed left one that says
        online. A live agent is seen anyway: it answers our birth with its own. Each new instance is
        reported once (ERROR, and `duplicates` in our status and stats)."""
        if retained or len(raw) > _STATUS_MAX_BYTES:
            return False
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return False
        other = body.get("instance") if isinstance(body, dict) else None
        if not isinstance(other, str) or not _INSTANCE.fullmatch(other) or other == self._instance:
            return False
        offline = body.get("state") == "offline"
        new, known, tell = self._note(other, offline)
        if tell:
            log.error(
                "MQTT: another agent publishes as device id %r (its instance %s, this one %s): both share"
                " every topic, command and retained state; give each agent its own device_id",
                self._device,
                other,
                self._instance,
            )
        elif known:
            log.warning(
                "MQTT: the other agent with device id %r (instance %s) went offline", self._device, other
            )
        return new or offline

    def _note(self, other: str, offline: bool) -> tuple[bool, bool, bool]:
        """(new instance, known instance gone offline, log the new one)"""
        with self._lock:
            if offline:
                known = self._seen.pop(other, None) is not None
                new = False
                self._generation += known
            else:
                new = other not in self._seen
                if new and len(self._seen) >= _DUPLICATES_MAX:
                    self._seen.pop(min(self._seen, key=self._seen.__getitem__))
                self._seen[other] = time.monotonic()
                self._generation += new
                known = False
            tell = new and self._logs < _DUPLICATE_LOGS_MAX
            self._logs += tell
        return new, known, tell


class StatusAnswers:
    """Publish our status again, at most once per _ANSWER_INTERVAL_S: a later request within the interval
    is served once at its end (with the status of that moment, if still `live()`), so the last word is
    always ours."""

    def __init__(self, send: Callable[[], None], live: Callable[[], bool]) -> None:
        self._send, self._live = send, live
        self._lock = threading.Lock()
        self._next = 0.0
        self._timer: threading.Timer | None = None

    def request(self) -> None:
        now = time.monotonic()
        with self._lock:
            wait = self._next - now
            if wait > 0:
                if self._timer is not None:
                    return
                self._timer = timer = threading.Timer(wait, self._later)
                timer.daemon = True
            else:
                self._next = now + _ANSWER_INTERVAL_S
                timer = None
        if timer is not None:
            timer.start()
            return
        self._send()

    def _later(self) -> None:
        with self._lock:
            self._timer = None
            self._next = time.monotonic() + _ANSWER_INTERVAL_S
        if self._live():
            self._send()
