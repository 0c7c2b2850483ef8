"""Cross-process build lock: fcntl.flock on a lock file, holder pid written inside.

flock locks die with their process (SIGKILL included), so a crashed build never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from engines.errors import BuildLockedError, StoreError


class BuildLock:
    """`with BuildLock(path, model, wait_s=0):` non-blocking by default; wait_s > 0 polls that long,
    None waits forever. Raises BuildLockedError naming the model and the holder's pid."""

    POLL_S = 0.1

    def __init__(self, path: Path, model: str, wait_s: float | None = 0.0) -> None:
        self.path = path
        self.model = model
        self.wait_s = wait_s
        self._fd: int | None = None

    def holder_pid(self) -> int | None:
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open build lock {self.path}: {e.strerror}") from e
        deadline = None if self.wait_s is None else time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    pid = self.holder_pid()
                    waited = f" (waited {self.wait_s:g} s)" if self.wait_s else ""
                    raise BuildLockedError(
                        f"another build of model {self.model!r} is running (pid {pid if pid else 'unknown'}, "
                        f"lock {self.path}){waited}",
                        pid,
                    ) from None
                time.sleep(self.POLL_S)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:  # a full disk: give the lock back rather than hold it with a leaked fd
            os.close(fd)
            raise StoreError(f"cannot write build lock {self.path}: {e.strerror}") from e
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            # Clear the pid before unlocking so nobody reads a stale holder; keep the file (unlinking a
            # flock file races with a waiter that has it open).
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
