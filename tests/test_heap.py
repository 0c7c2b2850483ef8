"""agent.service.heap: freed heap memory given back (malloc_trim) after camera reconnects and reloads, the
native part of the RSS steps a chaos soak showed (issue 36.19; tools/memtrace.py measures it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import ASSETS, bundled_model, wait_until

from agent.service.heap import HEAP, HeapTrimmer


def counter() -> tuple[list[int], HeapTrimmer]:
    calls: list[int] = []
    return calls, HeapTrimmer(min_interval_s=0.0, every_s=1e9, trim=lambda: calls.append(1))


def test_a_request_trims_and_a_tick_without_one_does_not() -> None:
    calls, heap = counter()
    assert heap.tick() is False and calls == []
    assert heap.request() is True and heap.request() is True
    assert calls == [1, 1] and heap.trims == 2


def test_a_request_within_the_minimum_interval_waits_for_the_next_tick() -> None:
    calls: list[int] = []
    heap = HeapTrimmer(min_interval_s=1e9, every_s=1e9, trim=lambda: calls.append(1))
    assert heap.request() is False and heap.request() is False  # a burst: nothing now
    assert calls == [] and heap._pending
    heap._min_interval_s = 0.0  # the interval has passed
    assert heap.tick() is True and calls == [1]
    assert heap.tick() is False and calls == [1]  # one deferred trim, not one per request


def test_the_periodic_trim_runs_without_requests() -> None:
    calls: list[int] = []
    heap = HeapTrimmer(min_interval_s=1e9, every_s=0.0, trim=lambda: calls.append(1))
    assert heap.tick() is True and calls == [1]


def test_a_failing_trim_is_not_fatal() -> None:
    def boom() -> None:
        raise OSError("no")

    heap = HeapTrimmer(min_interval_s=0.0, trim=boom)
    assert heap.request() is True and heap.trims == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_glibc_s_malloc_trim_is_found_and_runs() -> None:
    heap = HeapTrimmer(min_interval_s=0.0)
    assert heap.available
    assert heap.request() is True


def test_the_running_agent_trims_when_a_camera_streams_and_after_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.cli.daemon import local_device
    from agent.config import load_config

    monkeypatch.setattr(HEAP, "_min_interval_s", 0.0)
    data: dict[str, Any] = {
        "device_id": "heap",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {
            "street": {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 2, "loop": True}
        },
        "mqtt": {"enabled": False},
        "console": False,
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    agent = local_device(load_config(path), console=False, config_path=path)
    before = HEAP.trims
    try:
        agent.start()
        assert wait_until(lambda: agent.runtime.cameras["street"].state == "streaming", 60)
        assert wait_until(lambda: HEAP.trims > before, 10), "no trim when the camera started streaming"
        after_stream = HEAP.trims
        data["cameras"]["street"]["fps"] = 3
        path.write_text(yaml.safe_dump(data))
        assert agent.reload()
        assert HEAP.trims > after_stream, "no trim after the reload"
    finally:
        agent.stop()
