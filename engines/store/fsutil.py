"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

Temp names start with "." and contain ".tmp-", so they never match a plan or `{key}.json` and
a reader never sees a half-written file; `remove_stale_temps` deletes what a killed writer left.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TMP_MARK = ".tmp-"


def temp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX within one filesystem (same dir guarantees that)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temp files left by killed writers. Call only while holding the directory's build lock."""
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(".") and TMP_MARK in p.name and p.is_file():
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed
