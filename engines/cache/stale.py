"""Temp folders a pull killed mid-way leaves behind (`.NAME.pull-*` next to the destination, `.NAME.old-*` of
a replace cut short, the agent's `.cache-pull-*` in the engine store): the next pull removes those nothing
has written to for STALE_S. A live pull writes its blobs as they arrive (and the registry client's
64 KiB/s floor ends a stalled one long before), so its folder is never that old; age rather than "any
folder of the name" keeps a second process pulling the same name alive.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

STALE_S = 3600.0


def _newest_write(folder: Path) -> float:
    """The latest mtime of the folder and of anything in it (lstat: a link is not followed)."""
    newest = folder.lstat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def remove_stale(parent: Path, patterns: tuple[str, ...], older_than_s: float = STALE_S) -> list[Path]:
    """Remove the folders of `parent` matching `patterns` (globs) untouched for `older_than_s`; returns
    those removed."""
    removed: list[Path] = []
    now = time.time()
    for pattern in patterns:
        for path in parent.glob(pattern):
            try:
                if path.is_symlink() or not path.is_dir() or now - _newest_write(path) < older_than_s:
                    continue
            except OSError:  # gone meanwhile (another process cleaned it, or its pull finished)
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s: left by a pull that was stopped mid-way", path)
            removed.append(path)
    return removed


def pull_leftovers(dest: Path) -> tuple[str, ...]:
    """The globs of what a pull into `dest` leaves when it is killed."""
    name = glob.escape(dest.name)
    return (f".{name}.pull-*", f".{name}.old-*")
