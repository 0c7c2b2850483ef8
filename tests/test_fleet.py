"""Fleet on one MQTT fabric: two real agents (subprocesses, the bundled model, no cameras) on one mosquitto.
Commands on `{prefix}/_all` and `{prefix}/_group/<g>` go through each agent's own CommandRouter and are
answered once per agent on its own `{prefix}/{device}/cmd/<action>/result`; device commands stay private."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from fixtures_agent import AgentProcess, bundled_model, run_cli, wait
from fixtures_mqtt import Broker, Message, Subscriber, publish

from agent.config import ConfigError, MqttConfig, parse_config
from agent.mqtt import MqttClient
from agent.mqtt.topics import Topics

PREFIX = "fleet-test"


def fleet_config(tmp_path: Path, port: int, device: str, groups: list[str]) -> Path:
    cfg = {
        "device_id": device,
        "engine_dir": str(tmp_path / f"engines-{device}"),
        "models": {"detector": bundled_model()},
        "cameras": {},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5, "prefix": PREFIX, "groups": groups},
        "telemetry": {"interval_s": 30},
    }
    path = tmp_path / f"{device}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def answers(msgs: list[Message], request_id: str) -> list[tuple[str, dict]]:
    """(topic, body) of every command result carrying `request_id`."""
    out = []
    for topic, raw, _ in msgs:
        if topic.endswith("/result") and "/cmd/" in topic:
            body = json.loads(raw)
            if body.get("request_id") == request_id:
                out.append((topic, body))
    return out


def online(msgs: list[Message], device: str) -> bool:
    return any(t == f"{PREFIX}/{device}/status" and json.loads(p)["state"] != "offline" for t, p, _ in msgs)


def test_fleet_commands_are_answered_once_per_member_on_its_own_topic(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    # Left retained on a shared topic before the agents start: ignored, and not deleted (not theirs).
    publish(port, f"{PREFIX}/_all/cmd/rebuild", b'{"request_id": "retained"}', retain=True)
    sub = mqtt_subscribe(port, f"{PREFIX}/#")
    a = start_agent(fleet_config(tmp_path, port, "yard-a", ["yard"]))
    b = start_agent(fleet_config(tmp_path, port, "dock-b", ["dock"]))
    wait(sub, lambda m: online(m, "yard-a"), 40, a, "yard-a online")
    wait(sub, lambda m: online(m, "dock-b"), 40, b, "dock-b online")

    # _all: exactly one answer from each agent, each on its own result topic, request_id echoed.
    sub.publish(f"{PREFIX}/_all/cmd/rebuild", json.dumps({"request_id": "all-1"}))
    wait(sub, lambda m: len(answers(m, "all-1")) >= 2, 15, a, "both answers to _all")
    time.sleep(1.0)
    got = answers(sub.snapshot(), "all-1")
    assert sorted(t for t, _ in got) == [
        f"{PREFIX}/dock-b/cmd/rebuild/result",
        f"{PREFIX}/yard-a/cmd/rebuild/result",
    ]
    for topic, body in got:
        assert body["ok"] is True and body["action"] == "rebuild", body
        assert topic == f"{PREFIX}/{body['device']}/cmd/rebuild/result"

    # _group/yard: only the member answers; a group nobody is in: nobody.
    sub.publish(f"{PREFIX}/_group/yard/cmd/rebuild", json.dumps({"request_id": "g-1"}))
    sub.publish(f"{PREFIX}/_group/nobody/cmd/rebuild", json.dumps({"request_id": "g-none"}))
    wait(sub, lambda m: answers(m, "g-1"), 15, a, "the yard group's answer")
    # A device command to dock-b: dock-b only (no cross-talk).
    sub.publish(f"{PREFIX}/dock-b/cmd/rebuild", json.dumps({"request_id": "d-1"}))
    wait(sub, lambda m: answers(m, "d-1"), 15, b, "dock-b's answer")
    # Same validation and allow-list as device commands: a bad field on _all is answered as an error.
    sub.publish(f"{PREFIX}/_all/cmd/rebuild", json.dumps({"request_id": "bad", "force": "yes"}))
    wait(sub, lambda m: len(answers(m, "bad")) >= 2, 15, a, "both errors")
    time.sleep(1.0)
    msgs = sub.snapshot()
    assert [t for t, _ in answers(msgs, "g-1")] == [f"{PREFIX}/yard-a/cmd/rebuild/result"]
    assert [t for t, _ in answers(msgs, "d-1")] == [f"{PREFIX}/dock-b/cmd/rebuild/result"]
    assert answers(msgs, "g-none") == []
    bad = answers(msgs, "bad")
    assert len(bad) == 2 and all("field 'force'" in body["error"] for _, body in bad)
    assert answers(msgs, "retained") == []  # never run

    # The retained shared command is still at the broker: agents do not delete what is not theirs.
    fresh = Subscriber(port, f"{PREFIX}/_all/cmd/#")
    try:
        time.sleep(0.5)
        assert [p for t, p, r in fresh.snapshot() if r] == [b'{"request_id": "retained"}']
    finally:
        fresh.close()
    for agent in (a, b):
        text = agent.text()
        assert "Traceback" not in text and "left on the shared fleet topic" in text
        assert agent.proc.poll() is None


def test_client_ids_are_unique_per_process() -> None:
    topics = Topics(PREFIX, "yard-a")
    ids = {MqttClient(MqttConfig(), topics).client_id for _ in range(5)}
    assert len(ids) == 5 and all(i.startswith(f"{PREFIX}-yard-a-") for i in ids)


def test_reserved_device_ids_and_group_names_are_refused(tmp_path: Path) -> None:
    path = fleet_config(tmp_path, 1883, "_all", [])
    proc = run_cli("run", "-c", str(path), "--check-config", timeout=60)
    assert proc.returncode == 2, proc
    assert f"{path}: device_id: must not start with '_'" in proc.stderr + proc.stdout
    base = {"models": {"m": {"onnx": "m.onnx"}}, "cameras": {}}
    for mqtt, expect in (
        ({"groups": ["_group"]}, "mqtt.groups: entry 1: must not start with '_'"),
        ({"groups": ["a/b"]}, "mqtt.groups: entry 1: may only hold"),
        ({"groups": [f"g{i}" for i in range(33)]}, "mqtt.groups: at most 32 entries"),
        ({"groups": ["a", "a"]}, "mqtt.groups: names must be unique"),
    ):
        try:
            parse_config({**base, "mqtt": mqtt}, "fleet.yaml")
        except ConfigError as exc:
            assert f"fleet.yaml: {expect}" in str(exc), exc
        else:
            raise AssertionError(f"accepted {mqtt}")
    assert parse_config({**base, "mqtt": {"groups": ["yard", "dock"]}}).mqtt.groups == ["yard", "dock"]
