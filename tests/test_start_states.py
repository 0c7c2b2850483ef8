"""Issue 36.17 on the real agent (subprocess) and mosquitto, at start: retained states of a camera removed
from the config while the agent was stopped are cleared (its camera, zone and line states), and the status
is ``starting``, never ``degraded``, until each camera's first open attempt settles; a camera whose first
attempt failed then makes it ``degraded``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_mqtt import Broker, Subscriber, free_port, publish

from agent.health import STARTING_GRACE_S, agent_state

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
BASE = "edge-agent/boot"
pytestmark = pytest.mark.slow


def config(path: Path, port: int, cameras: dict) -> Path:
    cfg = {
        "device_id": "boot",
        "engine_dir": str(path.parent / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": cameras,
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 1},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ghost_states_of_a_removed_camera_are_cleared_at_start(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    # What an earlier run left for camera "gone", which the config no longer has.
    ghosts = [f"{BASE}/cameras/gone/{what}" for what in ("state", "zones/door", "lines/gate")]
    for topic in ghosts:
        publish(port, topic, json.dumps({"state": "streaming"}).encode(), retain=True)
    street = {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 4}
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config(tmp_path / "agent.yaml", port, {"street": street}))
    wait(
        sub,
        lambda m: all(any(t == g and not p for t, p, _ in m) for g in ghosts),
        30,
        agent,
        "the ghost camera's states deleted",
    )
    # What stays retained: the configured camera's state only.
    probe = Subscriber(port, f"{BASE}/cameras/#")
    try:
        msgs = wait(probe, lambda m: any(t.endswith("/street/state") for t, _, _ in m), 10, agent, "street")
        retained = {t for t, p, r in msgs if r and p}
    finally:
        probe.close()
    assert retained == {f"{BASE}/cameras/street/state"}, retained
    assert "deleting stale camera/zone/line state" in agent.text()


def test_the_status_is_starting_not_degraded_until_the_cameras_first_attempts_settle(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{BASE}/status")
    clip = {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 4}
    agent = start_agent(config(tmp_path / "agent.yaml", port, {"a": clip, "b": clip}))
    msgs = wait(
        sub, lambda m: any(s["state"] == "online" for s in decoded(m, "/status")), 60, agent, "online"
    )
    states = [s["state"] for s in decoded(msgs, "/status")]
    assert "degraded" not in states, states
    agent.terminate(timeout=10)

    # A camera nobody serves: its first attempt fails (connection refused), then the agent is degraded.
    dead = {"url": f"rtsp://127.0.0.1:{free_port()}/x", "model": "detector", "open_timeout_s": 2}
    sub2 = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config(tmp_path / "agent2.yaml", port, {"a": clip, "dead": dead}))
    msgs = wait(
        sub2, lambda m: any(s["state"] == "degraded" for s in decoded(m, "/status")), 60, agent, "degraded"
    )
    # (Its state may reach the broker after the status: the status goes first at each connect.)
    msgs = wait(
        sub2,
        lambda m: any(t.endswith("/dead/state") and b"reconnecting" in p for t, p, _ in m),
        10,
        agent,
        "the dead camera reconnecting",
    )
    degraded = next(s for s in decoded(msgs, "/status") if s["state"] == "degraded")
    assert degraded["cameras_up"] < degraded["cameras_total"] == 2, degraded


def test_the_starting_grace_is_bounded() -> None:
    assert agent_state(["starting", "streaming"], 2, False, 1.0, 5.0) == "starting"
    assert agent_state(["starting"], 2, False, 1.0, 5.0) == "starting"  # one not reported yet
    assert agent_state(["starting", "streaming"], 2, False, 5.0 + STARTING_GRACE_S, 5.0) == "degraded"
    assert agent_state(["reconnecting", "starting"], 2, False, 1.0, 5.0) == "degraded"
    assert agent_state(["streaming", "ended"], 2, False, 1.0, 5.0) == "online"
    assert agent_state(["streaming"], 1, True, 1.0, 5.0) == "offline"
