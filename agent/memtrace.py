"""Opt-in memory tracing of the running agent, for tools/memtrace.py (off unless the variable is set).

    EDGE_AGENT_TRACEMALLOC=/tmp/mt edge-agent run -c agent.yaml

starts tracemalloc (25 frames) and a daemon thread that, for every file `/tmp/mt/request-<name>` that
appears, runs a full garbage collection and writes `/tmp/mt/snap-<name>.tracemalloc` (a tracemalloc
snapshot) and `/tmp/mt/snap-<name>.json` (live objects per type, threads, RSS, the largest
mappings; with `trim` in the request also the RSS after glibc's malloc_trim), then removes the request.
Why a polled folder and not a signal: a Python signal handler may run inside a lock the main thread holds
(agent.service.signals), and a snapshot takes seconds. Tracing costs CPU and memory: never in production.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

ENV = "EDGE_AGENT_TRACEMALLOC"
FRAMES = 25


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def big_mappings(top: int = 12) -> list[tuple[str, str, float]]:
    """The largest mappings by resident size: (start-end, path or "", rss MB). A new one that stays is a
    native allocation in use (an mmapped block, an arena, a library's pool)."""
    rows: list[tuple[str, str, float]] = []
    where = ("", "")
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(" ", 1)[0]
                if "-" in first and not first.endswith(":"):
                    parts = line.split()
                    where = (parts[0], parts[5] if len(parts) > 5 else "")
                elif line.startswith("Rss:"):
                    rows.append((*where, round(int(line.split()[1]) / 1024, 1)))
    except OSError:
        return []
    return sorted(rows, key=lambda r: -r[2])[:top]


def malloc_trim() -> bool:
    """glibc's malloc_trim(0): free heap pages back to the system (False where there is no glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def dump(folder: Path, name: str, trim: bool = False) -> None:
    """gc, then the snapshot and the object census of this moment (written atomically). ``trim``: also
    the RSS after malloc_trim (what glibc held free but not returned), trimming for real."""
    gc.collect()
    census = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    info = {
        "name": name,
        "time": time.time(),
        "rss_bytes": rss_bytes(),
        "rss_trimmed_bytes": rss_bytes() if trim and malloc_trim() else None,
        "traced_bytes": tracemalloc.get_traced_memory()[0],
        "threads": sorted(t.name for t in threading.enumerate()),
        "mappings": big_mappings(),
        "types": dict(census.most_common(400)),
    }
    snap = tracemalloc.take_snapshot()
    tmp = folder / f".snap-{name}.tmp"
    snap.dump(str(tmp))
    os.replace(tmp, folder / f"snap-{name}.tracemalloc")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, folder / f"snap-{name}.json")


_STOP = threading.Event()


def stop() -> None:
    """End the watch thread and tracing (tests: no thread left polling in a process that goes on)."""
    _STOP.set()
    tracemalloc.stop()


def _watch(folder: Path) -> None:
    while not _STOP.is_set():
        for req in sorted(folder.glob("request-*")):
            name = req.name.removeprefix("request-")
            try:
                dump(folder, name, trim=req.read_text().strip() == "trim")
            finally:
                req.unlink(missing_ok=True)
        time.sleep(0.2)


def install_from_env() -> bool:
    """Start tracing when EDGE_AGENT_TRACEMALLOC names a folder; True when it did."""
    where = os.environ.get(ENV)
    if not where or tracemalloc.is_tracing():
        return False
    folder = Path(where)
    folder.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(FRAMES)
    _STOP.clear()
    threading.Thread(target=_watch, args=(folder,), name="memtrace", daemon=True).start()
    return True
