"""The hand-over between a camera's reader and the scheduler: a latest-frame-wins slot."""

from __future__ import annotations

import threading
import time

from pipelines.frames import Frame


class FrameSlot:
    """A single-frame mailbox: the newest frame wins, an unread older one is dropped and counted.

    The reader never waits on the consumer and memory never grows: a slow detector sees fresh frames, not
    a backlog.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._put_at = 0.0
        self.dropped = 0  # frames replaced before anyone read them

    def put(self, frame: Frame) -> None:
        with self._cond:
            if self._frame is not None:
                self.dropped += 1
            self._frame = frame
            self._put_at = time.monotonic()
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Frame | None:
        """Take the newest frame, waiting up to ``timeout`` seconds (None: forever); None on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._frame is not None, timeout):
                return None
            frame, self._frame = self._frame, None
            return frame

    @property
    def last_put(self) -> float:
        """time.monotonic() of the latest put (0.0: never): tells a live camera from a silent one."""
        return self._put_at

    def peek_age(self) -> float | None:
        """Seconds the unread frame has been waiting in the slot, or None when the slot is empty."""
        with self._cond:
            return None if self._frame is None else time.monotonic() - self._put_at

    def __len__(self) -> int:
        with self._cond:
            return 0 if self._frame is None else 1
