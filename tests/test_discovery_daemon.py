"""Home Assistant discovery from the real agent (subprocess) on mosquitto: configs at start, deleted when
a camera goes on reload, and stale configs of a camera removed while the agent was stopped deleted at
start."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import yaml
from fixtures_agent import AgentProcess, bundled_model, wait
from fixtures_mqtt import Broker, Subscriber
from test_discovery import render

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"


def config(tmp_path: Path, port: int, cameras: list[str]) -> Path:
    cfg = {
        "device_id": "ha-test",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {c: {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 2} for c in cameras},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "homeassistant": {"enabled": True},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def retained_configs(port: int) -> dict[str, dict]:
    """What a Home Assistant connecting now receives: retained, non-empty configs."""
    import time

    sub = Subscriber(port, "homeassistant/#")
    try:
        # Retained messages arrive in a burst: until none came for 0.5 s (at least 0.7 s, at most 5 s); a
        # fixed 0.7 s missed some on a loaded machine.
        time.sleep(0.7)
        deadline, seen = time.monotonic() + 5.0, -1
        while time.monotonic() < deadline and len(sub.snapshot()) != seen:
            seen = len(sub.snapshot())
            time.sleep(0.5)
        return {t: json.loads(p) for t, p, r in sub.snapshot() if r and p}
    finally:
        sub.close()


def test_agent_publishes_and_deletes_discovery_configs(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    sub = mqtt_subscribe(mqtt_broker.port, "#")
    path = config(tmp_path, mqtt_broker.port, ["gate", "yard"])
    agent = start_agent(path)
    wait(sub, lambda m: any("yard" in t and t.endswith("/config") for t, _, _ in m), 30, agent, "configs")
    wait(sub, lambda m: any(t.endswith("/detections") for t, _, _ in m), 40, agent, "detections")
    configs = retained_configs(mqtt_broker.port)
    cams = {c["name"].split()[0] for c in configs.values()}
    assert cams == {"gate", "yard"}, configs.keys()
    status = "edge-agent/ha-test/status"
    assert all(c["availability"][0]["topic"] == status for c in configs.values())
    # Per camera an image of its snapshots and a "detected" binary sensor per counted label (person, car).
    for cam in ("gate", "yard"):
        image = configs[f"homeassistant/image/edge-agent_ha-test/{cam}_snapshot/config"]
        assert image["image_topic"] == f"edge-agent/ha-test/cameras/{cam}/snapshot"
        assert image["content_type"] == "image/jpeg"
        for label in ("person", "car"):
            detected = configs[
                f"homeassistant/binary_sensor/edge-agent_ha-test/{cam}_{label}_detected/config"
            ]
            assert detected["state_topic"] == f"edge-agent/ha-test/cameras/{cam}/detections"
    # On the agent's real detections: ON exactly when the frame has the label (the count sensor > 0).
    person = configs["homeassistant/binary_sensor/edge-agent_ha-test/gate_person_detected/config"]
    count = configs["homeassistant/sensor/edge-agent_ha-test/gate_person_count/config"]
    frames = wait(
        sub,
        lambda m: len([p for t, p, _ in m if t == person["state_topic"]]) >= 4,
        40,
        agent,
        "gate detections",
    )
    states = set()
    for t, p, _ in frames:
        if t == person["state_topic"]:
            on = render(person["value_template"], p)
            assert on == ("ON" if int(render(count["value_template"], p)) > 0 else "OFF"), p
            states.add(on)
    assert states <= {"ON", "OFF"} and states

    # Reload without yard: its entities are deleted.
    path = config(tmp_path, mqtt_broker.port, ["gate"])
    agent.proc.send_signal(signal.SIGHUP)
    wait(
        sub,
        lambda m: any(t.startswith("homeassistant/") and "yard" in t and p == b"" for t, p, _ in m),
        20,
        agent,
        "yard configs deleted",
    )
    configs = retained_configs(mqtt_broker.port)
    assert configs and all("yard" not in t for t in configs)
    deleted = {t for t, p, _ in sub.snapshot() if t.startswith("homeassistant/") and p == b""}
    assert "homeassistant/image/edge-agent_ha-test/yard_snapshot/config" in deleted
    assert "homeassistant/binary_sensor/edge-agent_ha-test/yard_person_detected/config" in deleted

    # Stopped, then started with a config that lost gate too (a new camera instead): gate's configs,
    # left retained from the previous run, are found and deleted at start.
    agent.terminate(10)
    config(tmp_path, mqtt_broker.port, ["door"])
    agent2 = start_agent(path)
    wait(
        sub, lambda m: any("door" in t and t.endswith("/config") for t, _, _ in m), 30, agent2, "door configs"
    )
    wait(
        sub,
        lambda m: sum(1 for t, p, _ in m if "gate" in t and t.startswith("homeassistant/") and p == b"") >= 1,
        20,
        agent2,
        "gate configs deleted at start",
    )
    configs = retained_configs(mqtt_broker.port)
    assert configs and {c["name"].split()[0] for c in configs.values()} == {"door"}


def test_home_assistant_shows_the_display_names_while_topics_keep_the_ids(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = config(tmp_path, mqtt_broker.port, ["gate"])
    cfg = yaml.safe_load(path.read_text())
    square = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    cfg["cameras"]["gate"]["name"] = "Einfahrt Süd 🚗"
    cfg["cameras"]["gate"]["zones"] = {"drive": {"polygon": square, "name": "Zufahrt"}}
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    sub = mqtt_subscribe(mqtt_broker.port, "homeassistant/#")
    agent = start_agent(path)
    wait(sub, lambda m: any("drive" in t and t.endswith("/config") for t, _, _ in m), 30, agent, "configs")
    configs = retained_configs(mqtt_broker.port)
    fps = configs["homeassistant/sensor/edge-agent_ha-test/gate_fps/config"]
    assert fps["name"] == "Einfahrt Süd 🚗 fps"
    assert fps["state_topic"] == "edge-agent/ha-test/cameras/gate/state"
    occupancy = next(c for t, c in configs.items() if "drive" in t and "occupancy" in t)
    assert occupancy["name"] == "Einfahrt Süd 🚗 Zufahrt occupancy"
    assert occupancy["state_topic"] == "edge-agent/ha-test/cameras/gate/zones/drive"
