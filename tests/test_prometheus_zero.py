"""Issue 36.3: every counter series with a camera (zone, line, event type) label exists at 0 from the moment
its camera does, so that ``increase()`` sees its first increment (a camera's first outage); a removed
camera's series still go. Read over HTTP as Prometheus reads it, from a ``Metrics`` server and from the
real agent."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, wait_until
from fixtures_mqtt import free_port
from test_prometheus_types import ASSETS, Scrape, _cameras_in, samples

from agent.telemetry import Metrics
from agent.telemetry.fields import FIELDS

# The counters whose only label is the camera, as fields.py declares them (what must exist at 0).
CAMERA_COUNTERS = {
    f"edge_agent_{f.metric}_total"
    for f in FIELDS
    if f.kind.prometheus == "counter" and f.keys == ("camera",)
}


@pytest.fixture
def served() -> Iterator[tuple[Metrics, Scrape]]:
    m = Metrics()
    port = m.start_http(0, addr="127.0.0.1")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    try:
        yield m, scrape
    finally:
        m.stop_http()


def _row(reconnects: int = 0, crossings: int = 0) -> dict[str, Any]:
    return {
        "dropped": 0,
        "dropped_stale": 0,
        "reconnects": reconnects,
        "loops": 0,
        "decode_errors": 0,
        "decode_cpu_s": 0.0,
        "tracking": {
            "tracks_active": 0,
            "tracks_started": 0,
            "events": {"zone_enter": 0, "line_cross": 0},
            "zones": {"porch": {"person": 0}},
            "lines": {"gate": {"in": crossings, "out": 0}},
        },
    }


def test_counters_exist_at_zero_from_the_cameras_start(served: tuple[Metrics, Scrape]) -> None:
    m, scrape = served
    assert {"edge_agent_camera_reconnects_total", "edge_agent_tracks_started_total"} <= CAMERA_COUNTERS
    # "yard" is configured but has not reported yet (still starting, or its shard has not answered).
    m.update({"cameras": {"street": _row()}}, cameras=["street", "yard"])
    got = samples(scrape())
    for camera in ("street", "yard"):
        for name in CAMERA_COUNTERS:
            assert got.get((name, (("camera", camera),))) == 0, (name, camera)
    assert got[("edge_agent_events_total", (("camera", "street"), ("type", "zone_enter")))] == 0
    line = ("edge_agent_line_crossings_total", (("camera", "street"), ("direction", "in"), ("line", "gate")))
    assert got[line] == 0
    # The first outage and crossing are increments that increase() sees (0 -> 1).
    m.update({"cameras": {"street": _row(reconnects=1, crossings=1)}}, cameras=["street", "yard"])
    got = samples(scrape())
    assert got[("edge_agent_camera_reconnects_total", (("camera", "street"),))] == 1
    assert got[line] == 1
    # A removed camera's series go, zero ones included.
    m.update({"cameras": {"street": _row(1, 1)}}, cameras=["street"])
    assert _cameras_in(scrape()) == {"street"}


def test_the_running_agent_serves_a_cameras_counters_at_zero(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    port = free_port()
    cam = {
        "url": str(ASSETS / "bikes.mp4"),
        "model": "detector",
        "fps": 4,
        "zones": {"all": {"polygon": [[0, 0], [1, 0], [1, 1], [0, 1]]}},
        "lines": {"mid": {"points": [[0.5, 0], [0.5, 1]]}},
    }
    cfg = {
        "device_id": "prom-zero",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"street": cam},
        "mqtt": {"enabled": False},
        "telemetry": {"interval_s": 0.5, "prometheus_port": port},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    agent = start_agent(path)
    last: list[dict[Any, float]] = []

    def scraped() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                last.append(samples(resp.read().decode()))
        except OSError:
            return False
        return ("edge_agent_tracks_active", (("camera", "street"),)) in last[-1]

    assert wait_until(scraped, 60), agent.text()[-3000:]
    got = last[-1]
    for name in CAMERA_COUNTERS:  # a file source that never failed: reconnects, decode errors at 0
        assert (name, (("camera", "street"),)) in got, name
    assert got[("edge_agent_camera_reconnects_total", (("camera", "street"),))] == 0
    for kind in ("zone_leave", "line_cross", "end"):
        assert (("edge_agent_events_total", (("camera", "street"), ("type", kind)))) in got, kind
    for direction in ("in", "out"):
        labels = (("camera", "street"), ("direction", direction), ("line", "mid"))
        assert ("edge_agent_line_crossings_total", labels) in got, direction
