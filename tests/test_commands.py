"""MQTT commands under bad input: the router's decoding and validation, then the real agent (subprocess,
mosquitto, the bundled model on the bundled clip) answering every readable payload exactly once."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, wait
from fixtures_mqtt import Broker, Subscriber, publish

from agent.mqtt.commands import MAX_PAYLOAD, CommandRouter, decode

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
BASE = "edge-agent/cmd-test"

# (payload, what the answer's error must say). Every one is answered exactly once.
BAD: list[tuple[bytes, str]] = [
    (b"[" * 1000 + b"]" * 1000, "nested too deeply"),
    (b'{"a":' * 50 + b"1" + b"}" * 50, "nested too deeply"),
    (b'{"request_id": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"request_id": NaN}', "not valid JSON"),
    (b'{"force": true, "request_id": Infinity}', "not valid JSON"),
    (b'{"force": true, "request_id": -Infinity}', "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"not json", "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b"1e999", "must be a JSON object"),
    (b'"x"', "must be a JSON object"),
    (b'{"x": "' + b"A" * (MAX_PAYLOAD + 10) + b'"}', "too large"),
    (b'{"force": "yes"}', "field 'force': must be true or false"),
    (b'{"force": 1}', "field 'force': must be true or false"),
    (b'{"precision": "fp8"}', "field 'precision': must be one of"),
    (b'{"model": "../etc"}', "field 'model'"),
    (b'{"model": 5}', "field 'model'"),
    (b'{"model": "ghost"}', "field 'model': unknown or not a TensorRT model 'ghost'"),
    (b'{"request_id": {"a": 1}}', "field 'request_id'"),
    (b'{"request_id": 9007199254740993}', "field 'request_id'"),
    (b'{"request_id": "' + b"r" * 200 + b'"}', "field 'request_id'"),
    (b'{"' + b"k" * 5000 + b'": 1}', "unknown field"),
    (b'{"force": true, "bogus": 1}', "field 'bogus': unknown field"),
]


def test_decode_limits_and_what_it_names() -> None:
    for raw, expect in BAD[:13]:
        with pytest.raises(ValueError, match=expect.split("'")[0]):
            decode(raw)
    assert decode(b'{"force": true}') == {"force": True}
    with pytest.raises(ValueError) as err:
        decode(b'{"x": "' + b"s3cret" * 5000 + b'"}')
    assert "s3cret" not in str(err.value)  # never the content


def test_router_answers_once_validates_and_counts() -> None:
    router = CommandRouter(answers_per_s=1000)
    calls = []
    router.register("rebuild", lambda req: calls.append(req) or {"started": []})
    for raw, expect in BAD:
        if "unknown or not a TensorRT" in expect:
            continue  # that one is the daemon's handler's
        answer = router.handle("rebuild", raw)
        assert answer is not None and answer.ok is False, raw[:40]
        assert expect in (answer.error or ""), (raw[:40], answer)
        assert "s3cret" not in json.dumps(answer.body())
    assert calls == []
    ok = router.handle("rebuild", b'{"force": true, "request_id": "r1"}')
    assert ok is not None and ok.ok and ok.request_id == "r1" and calls[0].force is True
    assert router.handle("selfdestruct", b"{}").error.startswith("unknown action")  # type: ignore[union-attr]
    assert router.screen("rebuild", b"", retained=False) == "empty"
    assert router.screen("rebuild", b'{"force": true}', retained=True) == "retained"
    assert router.screen("x" * 100, b"{}", retained=False) == "bad action"
    stats = router.stats()
    assert stats["accepted"] == 1 and stats["retained_ignored"] == 1 and stats["rejected"] == len(BAD)


def test_unreadable_floods_are_dropped_beyond_the_answer_rate() -> None:
    router = CommandRouter(answers_per_s=5)
    answers = [router.handle("rebuild", b"garbage") for _ in range(50)]
    assert 5 <= sum(a is not None for a in answers) <= 7
    assert router.stats()["dropped"] >= 43


def test_disabled_actions_are_answered_as_such() -> None:
    router = CommandRouter(enabled=frozenset({"snapshot"}))
    router.register("rebuild", lambda req: {})
    answer = router.handle("rebuild", b'{"request_id": 7}')
    assert answer is not None and not answer.ok and answer.request_id == 7
    assert "disabled" in (answer.error or "")


# ---- the real agent ---------------------------------------------------------------------------------
def agent_config(tmp_path: Path, port: int, **mqtt: object) -> Path:
    cfg = {
        "device_id": "cmd-test",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {
            "street": {
                "url": str(ASSETS / "bikes.mp4"),
                "model": "detector",
                "fps": 4,
                "snapshot": {"on_detection": True, "min_interval_s": 2},
            }
        },
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5, **mqtt},
        "telemetry": {"interval_s": 30},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def results(msgs: list, action: str) -> list[dict]:
    return [json.loads(p) for t, p, _ in msgs if t == f"{BASE}/cmd/{action}/result"]


def test_agent_answers_every_bad_command_exactly_once_without_tracebacks(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(agent_config(tmp_path, mqtt_broker.port))
    wait(sub, lambda m: any(t.endswith("/detections") for t, _, _ in m), 40, agent, "detections")
    log_before = len(agent.text())
    for i, (raw, expect) in enumerate(BAD, 1):
        sub.publish(f"{BASE}/cmd/rebuild", raw)
        msgs = wait(sub, lambda m, i=i: len(results(m, "rebuild")) >= i, 10, agent, f"answer to bad #{i}")
        answer = results(msgs, "rebuild")[i - 1]
        assert answer["ok"] is False and expect in answer["error"], (raw[:60], answer)
    time.sleep(1.0)
    assert len(results(sub.snapshot(), "rebuild")) == len(BAD)  # exactly one answer each, none late
    # A flood of 300 x 16 KB of garbage: a bounded, rate-limited log, the agent still detecting.
    for _ in range(300):
        sub.publish(f"{BASE}/cmd/rebuild", b"\x00" * MAX_PAYLOAD)
    mark = len(sub.snapshot())
    wait(sub, lambda m: any(t.endswith("/detections") for t, _, _ in m[mark:]), 20, agent, "still detecting")
    text = agent.text()
    assert "Traceback" not in text
    assert len(text) - log_before < 20_000, len(text) - log_before
    assert "AAAA" not in text and "kkkk" not in text  # no payload content in the log
    assert agent.proc.poll() is None


def test_retained_commands_are_ignored_cleared_and_never_run(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    # Left retained by some tool before the agent starts: it would run at every connect.
    publish(mqtt_broker.port, f"{BASE}/cmd/reload", b"{}", retain=True)
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(agent_config(tmp_path, mqtt_broker.port))
    wait(sub, lambda m: any(t.endswith("/detections") for t, _, _ in m), 40, agent, "detections")
    # Cleared at the broker: a new subscriber gets no retained command.
    fresh = Subscriber(mqtt_broker.port, f"{BASE}/cmd/#")
    try:
        time.sleep(0.5)
        assert [p for t, p, r in fresh.snapshot() if r] == []
    finally:
        fresh.close()
    assert results(sub.snapshot(), "reload") == []  # never run, never answered
    assert "retained message ignored and cleared" in agent.text()
    assert "reload applied" not in agent.text()


def test_snapshot_command_and_on_detection_snapshots_are_annotated_jpegs(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(agent_config(tmp_path, mqtt_broker.port))
    snap_topic = f"{BASE}/cameras/street/snapshot"
    # on_detection, at most every 2 s: the clip has cars and people in most frames.
    msgs = wait(sub, lambda m: sum(t == snap_topic for t, _, _ in m) >= 2, 40, agent, "two snapshots")
    times = [i for i, (t, _, _) in enumerate(msgs) if t == snap_topic]
    assert len(times) >= 2
    sub.publish(f"{BASE}/cmd/snapshot", json.dumps({"camera": "street", "request_id": "s1"}))
    msgs = wait(sub, lambda m: results(m, "snapshot"), 10, agent, "snapshot answer")
    answer = results(msgs, "snapshot")[0]
    assert answer["ok"] and answer["request_id"] == "s1" and answer["bytes"] > 1000
    jpeg = [p for t, p, _ in msgs if t == snap_topic][-1]
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None and image.shape == (272, 640, 3)
    sub.publish(f"{BASE}/cmd/snapshot", json.dumps({"camera": "nope", "request_id": "s2"}))
    msgs = wait(sub, lambda m: len(results(m, "snapshot")) >= 2, 10, agent, "second answer")
    bad = results(msgs, "snapshot")[1]
    assert not bad["ok"] and "field 'camera': unknown camera 'nope'" in bad["error"]


def test_reload_command_and_disabled_commands(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = agent_config(tmp_path, mqtt_broker.port, commands=["reload"])
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(path)
    wait(sub, lambda m: any(t.endswith("/detections") for t, _, _ in m), 40, agent, "detections")
    sub.publish(f"{BASE}/cmd/rebuild", b'{"force": true, "request_id": 1}')
    msgs = wait(sub, lambda m: results(m, "rebuild"), 10, agent, "rebuild answer")
    assert "disabled" in results(msgs, "rebuild")[0]["error"]
    cfg = yaml.safe_load(path.read_text())
    cfg["cameras"]["street"]["min_score"] = 0.6
    path.write_text(yaml.safe_dump(cfg))
    sub.publish(f"{BASE}/cmd/reload", b'{"request_id": "x"}')
    msgs = wait(sub, lambda m: results(m, "reload"), 20, agent, "reload answer")
    answer = results(msgs, "reload")[0]
    assert answer["ok"] and "camera settings: street" in answer["changes"] and answer["request_id"] == "x"
    path.write_text("cameras: [")
    sub.publish(f"{BASE}/cmd/reload", b"{}")
    msgs = wait(sub, lambda m: len(results(m, "reload")) >= 2, 20, agent, "refused reload answer")
    refused = results(msgs, "reload")[1]
    assert not refused["ok"] and "invalid YAML" in refused["error"]
