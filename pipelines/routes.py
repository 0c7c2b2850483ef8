"""The cameras a model serves (pipelines.scheduler): each camera's route and the fair take of their frames.

Fairness: a take starts after the camera served last, whichever cameras had no frame, so every live camera
gets an equal share whatever the order or number of dead ones. Each camera gives at most one frame per
take: its slot holds only its latest frame.

Stale frames: a frame older than the max age when taken (a camera that stalled with a frame in its slot,
or the pipeline itself stalled) is dropped before preprocessing and counted on its route
(``CameraRoute.stale``) and in ``Routes.stale``. A frame waiting in a slot is always that camera's newest,
so steady overload alone does not make frames stale; it drops more of them in the slot.

Thread-safe: routes are added and removed from any thread while the batcher takes frames.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipelines.analytics import Analysis
from pipelines.frames import Detections, Frame
from pipelines.sources import FrameSlot

log = logging.getLogger("pipelines.scheduler")  # the journal's name for the scheduler's lines

_LIVE_S = 1.0  # a camera that put a frame within this long counts as live (worth waiting for)
_STALE_LOG_S = 10.0  # at most one "dropped stale frames" warning per model per this long

# A camera's analytics (agent.events.CameraEvents): the frame and its detections (class filter applied,
# scores >= the route's min_score) -> Analysis, whose `detections` the result carries instead.
AnalyticsHook = Callable[[Frame, Detections], Analysis]


class NotifyingSlot(FrameSlot):
    """A FrameSlot that also wakes the scheduler that reads it."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._wake = wake

    def put(self, frame: Frame) -> None:
        super().put(frame)
        self._wake.set()


@dataclass
class CameraRoute:
    name: str
    slot: FrameSlot
    class_mask: np.ndarray | None  # bool per class id; None keeps every class
    min_score: float  # with analytics: the tracker's floor (the analytics narrows to what is reported)
    stale: int = 0  # frames dropped unprocessed: older than the model's max age when taken
    analytics: AnalyticsHook | None = None


class Routes:
    """The routes of one model's cameras, by name, and the round robin over them."""

    def __init__(self, model: str, max_age_ms: float = 0.0) -> None:
        """``max_age_ms``: frames older than this when taken are dropped (0: never)."""
        self.model = model
        self._max_age_s = max_age_ms / 1000.0
        self._routes: dict[str, CameraRoute] = {}
        self._lock = threading.Lock()
        self._last_served: str | None = None  # the next take starts after this camera
        self._rr_pos = 0  # ... or at this position, if that camera was removed
        self._stale_logged_at = -math.inf
        self.stale = 0  # frames dropped as too old, all routes together (monotonic)

    def add(self, route: CameraRoute) -> None:
        with self._lock:
            self._routes[route.name] = route

    def remove(self, name: str) -> None:
        with self._lock:
            self._routes.pop(name, None)

    def get(self, name: str) -> CameraRoute | None:
        with self._lock:
            return self._routes.get(name)

    def current(self) -> dict[str, CameraRoute]:
        """A copy of the routes now: a route missing from it (or replaced) was removed meanwhile."""
        with self._lock:
            return dict(self._routes)

    def take(self, limit: int, exclude: frozenset[str] = frozenset()) -> list[tuple[CameraRoute, Frame]]:
        """At most one frame per camera, at most `limit`, in round-robin order starting after the camera
        served last; frames older than the max age are dropped and counted."""
        routes = list(self.current().values())
        n = len(routes)
        if not n or limit <= 0:
            return []
        names = [r.name for r in routes]
        start = names.index(self._last_served) + 1 if self._last_served in names else self._rr_pos
        now = time.monotonic()
        items: list[tuple[CameraRoute, Frame]] = []
        stale: list[str] = []
        for i in range(n):
            route = routes[(start + i) % n]
            if route.name in exclude:
                continue
            frame = route.slot.get(timeout=0)
            if frame is None:
                continue
            if self._max_age_s and now - frame.stamps.get("captured", now) > self._max_age_s:
                route.stale += 1
                stale.append(route.name)
                continue
            items.append((route, frame))
            if len(items) >= limit:
                break
        if items:
            self._last_served = items[-1][0].name
            self._rr_pos = (names.index(self._last_served) + 1) % n
        if stale:
            self._note_stale(stale, now)
        return items

    def live(self) -> int:
        """The cameras that put a frame lately: those worth waiting for to fill a batch."""
        since = time.monotonic() - _LIVE_S
        return sum(1 for r in self.current().values() if r.slot.last_put >= since)

    def _note_stale(self, cameras: list[str], now: float) -> None:
        self.stale += len(cameras)
        if now - self._stale_logged_at >= _STALE_LOG_S:
            self._stale_logged_at = now
            log.warning(
                "model %s: dropping frames older than %.0f ms (cameras %s; %d so far)",
                self.model,
                self._max_age_s * 1000.0,
                ", ".join(sorted(set(cameras))),
                self.stale,
            )
