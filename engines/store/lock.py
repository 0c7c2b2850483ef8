"""Cross-process build lock: fcntl.flock on a lock file, the holder written inside.

flock locks die with their process (SIGKILL included), so a crashed build never leaves a stale lock.
The file says who holds it: the pid on the first line (what older versions wrote and read), then one
JSON line {pid, started_at, command}, so a refused or waiting build can name the holder:

    another build of model 'det' is running (pid 4242, started 2026-01-05T10:00:02+00:00, 12 s ago,
    command: edge-agent rebuild -c agent.yaml --force; lock /var/lib/edge-agent/engines/det/.build.lock)

The lock is held by an open file description: a child started with the descriptor (pass_fds) holds it
with its parent, and it stays held until both have closed it (or died). `BuildLock.inherited(fd)` is that
child's side; it never unlocks (that would release the parent's lock too).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from engines.errors import BuildLockedError, StoreError

COMMAND_MAX = 300  # characters of the holder's command line kept in the lock file


def process_command() -> str:
    """This process's command line (from /proc, else sys.argv), shortened for the lock file."""
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    except OSError:
        import sys

        argv = [sys.executable, *sys.argv]
    text = shlex.join(argv)
    return text if len(text) <= COMMAND_MAX else text[: COMMAND_MAX - 3] + "..."


def describe_holder(info: dict[str, Any] | None, pid: int | None) -> str:
    """ "pid 4242, started 2026-...+00:00, 12 s ago, command: edge-agent rebuild ..." (what is known)."""
    parts = [f"pid {pid if pid else 'unknown'}"]
    info = info or {}
    started = info.get("started_at")
    if isinstance(started, str):
        parts.append(f"started {started}")
        try:
            age = _dt.datetime.now(_dt.timezone.utc) - _dt.datetime.fromisoformat(started)
            parts.append(f"{max(0, round(age.total_seconds()))} s ago")
        except ValueError:
            pass
    command = info.get("command")
    if isinstance(command, str) and command:
        parts.append(f"command: {command}")
    return ", ".join(parts)


class BuildLock:
    """`with BuildLock(path, model, wait_s=0):` non-blocking by default; wait_s > 0 polls that long,
    None waits forever. Raises BuildLockedError naming the model and the holder (pid, start, command).

    `command`: what this holder is doing, for others' messages (default: this process's command line).
    `on_wait(holder)`: called once, with describe_holder's text, when the lock is busy and we wait."""

    POLL_S = 0.1

    def __init__(
        self,
        path: Path,
        model: str,
        wait_s: float | None = 0.0,
        command: str | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.model = model
        self.wait_s = wait_s
        self.command = command
        self.on_wait = on_wait
        self._fd: int | None = None
        self._owner = True  # False: inherited from the parent, which unlocks

    @classmethod
    def inherited(cls, path: Path, model: str, fd: int) -> BuildLock:
        """The lock a parent holds and handed down as `fd`; StoreError when `fd` is not that lock."""
        lock = cls(path, model)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: a no-op that must succeed
            else:
                raise StoreError(f"descriptor {fd} handed down is not the build lock {path}")
        except OSError as e:
            raise StoreError(f"build lock {path} was not handed down on descriptor {fd}: {e}") from e
        lock._fd, lock._owner = fd, False
        return lock

    @property
    def fd(self) -> int | None:
        """The locked descriptor while held (hand it to a child with pass_fds)."""
        return self._fd

    def holder(self) -> tuple[int | None, dict[str, Any] | None]:
        """(pid, {pid, started_at, command}) as the lock file says; (None, None) when it says nothing."""
        try:
            text = self.path.read_text()
        except OSError:
            return None, None
        lines = text.splitlines()
        pid = int(lines[0]) if lines and lines[0].strip().isdigit() else None
        info = None
        if len(lines) > 1:
            try:
                parsed = json.loads(lines[1])
                info = parsed if isinstance(parsed, dict) else None
            except ValueError:
                info = None
        return pid, info

    def holder_pid(self) -> int | None:
        return self.holder()[0]

    def _busy(self, waited: float | None) -> BuildLockedError:
        pid, info = self.holder()
        after = f" (waited {waited:g} s)" if waited else ""
        return BuildLockedError(
            f"another build of model {self.model!r} is running ({describe_holder(info, pid)}; "
            f"lock {self.path}){after}",
            pid,
        )

    def held_elsewhere(self) -> str | None:
        """Who holds the lock now (describe_holder's text), or None; creates and writes nothing (a dry
        run asks this)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None  # every holder creates the file first: nobody holds it
        except OSError as e:
            raise StoreError(f"cannot open build lock {self.path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, info = self.holder()
            return describe_holder(info, pid)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open build lock {self.path}: {e.strerror}") from e
        deadline = None if self.wait_s is None else time.monotonic() + self.wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    raise self._busy(self.wait_s) from None
                if not told and self.on_wait is not None:
                    told = True
                    pid, info = self.holder()
                    self.on_wait(describe_holder(info, pid))
                time.sleep(self.POLL_S)
        record = {
            "pid": os.getpid(),
            "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": self.command if self.command is not None else process_command(),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{json.dumps(record)}\n".encode(), 0)
        except OSError as e:  # a full disk: give the lock back rather than hold it with a leaked fd
            os.close(fd)
            raise StoreError(f"cannot write build lock {self.path}: {e.strerror}") from e
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        if self._owner:
            # Clear the holder before unlocking so nobody reads a stale one; keep the file (unlinking a
            # flock file races with a waiter that has it open).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> BuildLock:
        if self._fd is None:
            self.acquire()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
