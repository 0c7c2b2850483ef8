"""Best-detection snapshots of a camera's tracks (``events.snapshot``): a crop of each track's best box,
kept while the track lives; an ended track's goes out as JPEG after its ``end`` on
``cameras/{camera}/tracks/{track_id}/snapshot``, at most one per ``min_interval_s`` per camera and only
while connected."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from agent.config import EventsConfig
from agent.events import pictures
from pipelines.analytics import Analysis
from pipelines.frames import Frame, host_image
from pipelines.tracking import BEST_BOX

_CROP_MARGIN = 0.15  # snapshot crops: the best box grown by this fraction of its size on each side


class TrackSnapshots:
    """Crops of each track's best detection (aligned with the tracker's tracks); the camera's rate limit."""

    def __init__(self) -> None:
        self.crops = np.empty(0, object)  # HxWx3 uint8 crops (None until one is taken)
        self.last_sent = -math.inf

    def follow(self, kept: np.ndarray, src: np.ndarray, n: int, enabled: bool) -> None:
        """Realign with the tracker's `n` tracks: row i keeps old row src[k] where kept[i] (k-th kept)."""
        if enabled or self.crops.size:
            crops = np.empty(n, object)
            crops[kept] = self.crops.take(src) if self.crops.size else None
            self.crops = crops

    def crop(self, a: Analysis, frame: Frame) -> None:
        """Crops of the tracks whose best detection improved in this frame."""
        image = host_image(frame.image)
        h, w = image.shape[:2]
        for row in a.step.improved.tolist():
            x1, y1, x2, y2 = a.table[BEST_BOX, row]
            mx, my = (x2 - x1) * _CROP_MARGIN, (y2 - y1) * _CROP_MARGIN
            left, top = max(0, int(x1 - mx)), max(0, int(y1 - my))
            right, bottom = min(w, math.ceil(x2 + mx)), min(h, math.ceil(y2 + my))
            if right > left and bottom > top:
                self.crops[row] = image[top:bottom, left:right].copy()

    def due(self, row: int, cfg: EventsConfig, connected: Callable[[], bool]) -> bool:
        """Whether the track at `row` (ending) gets its snapshot now; counts it against the rate limit."""
        crops = self.crops
        if not cfg.snapshot.enabled or row >= crops.size or crops[row] is None:
            return False
        now = time.monotonic()
        if now - self.last_sent < cfg.snapshot.min_interval_s or not connected():
            return False
        self.last_sent = now
        return True

    def jpeg(self, row: int, quality: int) -> bytes:
        return pictures.jpeg(self.crops[row], quality)

    def drop(self, rows: np.ndarray) -> None:
        crops = self.crops
        for row in rows.tolist():
            if row < crops.size:
                crops[row] = None
