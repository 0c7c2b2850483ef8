"""What is kept for the broker while it is away: the latest retained state per topic and queued events.

- While not connected, "state" messages (retained) are kept as the latest value per topic, "event"
  messages in one bounded deque shared by all event topics (oldest dropped first, counted in
  ``dropped_offline``).
- On every (re)connect, after the birth, the latest value of every retained state topic goes out (the
  present, so consumers see current camera/engine states before old events), then the queued events in
  the order they were published. Callers keep queueing while this flush runs and the client only counts
  as connected once the queue is empty, so order is preserved without holding a lock during the flush.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

_FLUSH_BATCH = 64  # events taken from the offline queue per lock acquisition during a flush

Send = Callable[[str, bytes, int, bool], None]  # (topic, body, qos, retain)


class Outbox:
    """The offline queue and the retained states, and whether messages may go straight to the broker."""

    def __init__(self, limit: int, status_topic: str) -> None:
        self._status_topic = status_topic  # the birth's job at each connect, not a state to re-publish
        self._lock = threading.Lock()
        self.connected = False  # the link is up and the flush is done: publish() sends directly
        self.connected_event = threading.Event()
        self._states: dict[str, tuple[bytes, int]] = {}  # latest retained payload per topic
        self._pending_states: dict[str, tuple[bytes, int]] = {}  # changed while offline, not yet sent
        self._events: collections.deque[tuple[str, bytes, int]] = collections.deque(maxlen=limit)
        self.dropped = 0

    @property
    def states(self) -> int:
        """Retained state topics kept for the next connect."""
        with self._lock:
            return len(self._states)

    @property
    def limit(self) -> int:
        return self._events.maxlen or 0

    def keep(self, topic: str, body: bytes, qos: int, state: bool) -> bool:
        """Record a publish; True when it is to be sent now, False when it was kept for the next connect."""
        with self._lock:
            if state and body:
                self._states[topic] = (body, qos)
            elif state:  # a deletion (a removed camera, zone, entity): sent, then nothing left to keep
                self._states.pop(topic, None)
            if self.connected:
                return True
            if state:
                self._pending_states[topic] = (body, qos)
            else:
                self._enqueue_locked(topic, body, qos)
            return False

    def requeue(self, topic: str, body: bytes, qos: int) -> None:
        """An event that paho could not send after all (the link dropped meanwhile)."""
        with self._lock:
            self._enqueue_locked(topic, body, qos)

    def _enqueue_locked(self, topic: str, body: bytes, qos: int) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1  # deque(maxlen) drops the oldest on append
        self._events.append((topic, body, qos))

    def reclaim(self, events: Iterable[tuple[str, bytes, int]]) -> None:
        """Events of the previous connection that the broker never acknowledged: ahead of everything queued
        since (they were published before it)."""
        events = list(events)
        if not events:
            return
        with self._lock:
            merged = events + list(self._events)
            overflow = max(0, len(merged) - (self._events.maxlen or len(merged)))
            self.dropped += overflow
            self._events.clear()
            self._events.extend(merged[overflow:])

    def flush(self, send: Send) -> None:
        """Send states then queued events; mark connected once nothing is left (see the module doc)."""
        with self._lock:
            # Every retained state, not only those changed while offline: the broker may have lost
            # them (restart without persistence).
            self._pending_states = {**self._states, **self._pending_states}
            self._pending_states.pop(self._status_topic, None)
        while True:
            with self._lock:
                if self._pending_states:
                    states = list(self._pending_states.items())
                    self._pending_states.clear()
                    batch: list[tuple[str, bytes, int, bool]] = [(t, b, q, True) for t, (b, q) in states]
                elif self._events:
                    n = min(_FLUSH_BATCH, len(self._events))
                    batch = [(*self._events.popleft(), False) for _ in range(n)]
                else:
                    self._set_connected_locked(True)
                    return
            for topic, body, qos, retain in batch:
                send(topic, body, qos, retain)

    def set_connected(self, connected: bool) -> None:
        with self._lock:
            self._set_connected_locked(connected)

    def _set_connected_locked(self, connected: bool) -> None:
        self.connected = connected
        if connected:
            self.connected_event.set()
        else:
            self.connected_event.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "queued": len(self._events),
                "states_pending": len(self._pending_states),
                "dropped_offline": self.dropped,
            }
