"""agent.memtrace (EDGE_AGENT_TRACEMALLOC, used by tools/memtrace.py): off unless set; a request file
becomes a tracemalloc snapshot and a census."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from agent import memtrace


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memtrace.ENV, raising=False)
    assert memtrace.install_from_env() is False


def test_a_request_becomes_a_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc already on in this process")
    monkeypatch.setenv(memtrace.ENV, str(tmp_path))
    try:
        assert memtrace.install_from_env() is True
        (tmp_path / "request-a").write_text("trim")
        deadline = time.monotonic() + 60
        while not (tmp_path / "snap-a.json").exists():
            assert time.monotonic() < deadline, "no snapshot written"
            time.sleep(0.1)
    finally:
        memtrace.stop()
    info = json.loads((tmp_path / "snap-a.json").read_text())
    assert info["name"] == "a" and info["traced_bytes"] > 0 and "memtrace" in info["threads"]
    assert info["types"]["dict"] > 0
    assert not (tmp_path / "request-a").exists()
    snap = tracemalloc.Snapshot.load(str(tmp_path / "snap-a.tracemalloc"))
    assert snap.traceback_limit == memtrace.FRAMES
