"""SIGHUP reload on the real agent (subprocess) with mosquitto: cameras change in place, a broken config is
refused and the old one keeps running; plus what a reload plan makes of config changes."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, wait
from fixtures_mqtt import Broker, Message, Subscriber

from agent.config import parse_config
from agent.config.reload import plan_reload

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
CLIP = str(ASSETS / "bikes.mp4")

pytestmark = pytest.mark.slow


def base(tmp_path: Path, port: int, cameras: dict[str, dict]) -> dict:
    return {
        "device_id": "hup",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {name: {"url": CLIP, "model": "detector", "fps": 4, **c} for name, c in cameras.items()},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 30},
    }


def detections(msgs: list[Message], camera: str) -> list[dict]:
    return [json.loads(p) for t, p, _ in msgs if t == f"edge-agent/hup/cameras/{camera}/detections"]


def states(msgs: list[Message], camera: str) -> list[bytes]:
    return [p for t, p, _ in msgs if t == f"edge-agent/hup/cameras/{camera}/state"]


def statuses(msgs: list[Message]) -> list[dict]:
    return [json.loads(p) for t, p, _ in msgs if t == "edge-agent/hup/status" and p]


def test_sighup_adds_and_removes_cameras_while_another_keeps_streaming(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(base(tmp_path, mqtt_broker.port, {"keep": {}, "gone": {}})))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/hup/#")
    agent = start_agent(path)
    wait(sub, lambda m: detections(m, "keep") and detections(m, "gone"), 40, agent, "both cameras detect")

    # keep stays as it is, gone goes, new comes; min_score of keep changes on its running route.
    cfg = base(tmp_path, mqtt_broker.port, {"keep": {"min_score": 0.5}, "new": {}})
    path.write_text(yaml.safe_dump(cfg))
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub,
        lambda m: len(detections(m[mark:], "new")) >= 3 and len(detections(m[mark:], "keep")) >= 3,
        40,
        agent,
        "detections of new and keep after the reload",
    )
    after = msgs[mark:]
    # The removed camera's retained state is deleted (empty retained payload), so nobody sees it streaming.
    assert b"" in states(after, "gone")
    cleared = next(i for i, (t, p, _) in enumerate(after) if t.endswith("/gone/state") and p == b"")
    assert detections(after[cleared + 1 :], "gone") == []
    # keep's reader was never restarted: its frame ids go on from where they were, no "starting" state.
    before_ids = [d["frame_id"] for d in detections(msgs[:mark], "keep")]
    after_ids = [d["frame_id"] for d in detections(after, "keep")]
    assert min(after_ids) > min(before_ids) and after_ids == sorted(after_ids)
    assert all(json.loads(p)["state"] != "starting" for p in states(after, "keep"))
    # The new min_score applies to keep's detections published after the reload took effect.
    last = detections(after, "keep")[-3:]
    assert all(d["score"] >= 0.5 for p in last for d in p["detections"])
    status = statuses(after)[-1]
    assert status["last_reload"]["ok"] is True
    assert "cameras added: new" in status["last_reload"]["changes"]
    assert "cameras removed: gone" in status["last_reload"]["changes"]
    assert status["cameras_total"] == 2
    assert "reload applied" in agent.text()


def test_broken_config_on_reload_keeps_the_old_one_running(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = tmp_path / "agent.yaml"
    good = base(tmp_path, mqtt_broker.port, {"cam": {}})
    path.write_text(yaml.safe_dump(good))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/hup/#")
    agent = start_agent(path)
    wait(sub, lambda m: detections(m, "cam"), 40, agent, "detections")

    bad_cases = [
        "cameras: {cam: {url: x, model: detector}\n",  # YAML syntax
        yaml.safe_dump({**good, "cameras": {"cam": {"url": CLIP, "model": "nope"}}}),  # unknown model
        yaml.safe_dump({**good, "cameras": {"cam": {"url": CLIP, "model": "detector", "fsp": 3}}}),
        yaml.safe_dump({**good, "cameras": {"cam": {"url": CLIP, "model": "detector", "classes": ["cat5"]}}}),
        yaml.safe_dump({**good, "models": {"detector": {**good["models"]["detector"], "onnx": "/no.onnx"}}}),
    ]
    expected = ["invalid YAML", "cameras.cam.model", "cameras.cam.fsp", "cat5", "/no.onnx"]
    for text, what in zip(bad_cases, expected, strict=True):
        path.write_text(text)
        mark = len(sub.snapshot())
        agent.proc.send_signal(signal.SIGHUP)
        msgs = wait(
            sub,
            lambda m, mark=mark: any("last_reload" in s for s in statuses(m[mark:])),
            20,
            agent,
            f"reload outcome for {what}",
        )
        outcome = [s for s in statuses(msgs[mark:]) if "last_reload" in s][-1]["last_reload"]
        assert outcome["ok"] is False and what in outcome["error"], outcome
        # Still detecting on the old config.
        mark = len(sub.snapshot())
        wait(sub, lambda m, mark=mark: len(detections(m[mark:], "cam")) >= 2, 20, agent, "old config runs")
    assert agent.proc.poll() is None
    assert "Traceback" not in agent.text()
    assert agent.text().count("reload refused, still running the previous config") == len(bad_cases)

    # Fixed: the next SIGHUP applies it.
    path.write_text(yaml.safe_dump(base(tmp_path, mqtt_broker.port, {"cam": {"fps": 2}})))
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub,
        lambda m: any(s.get("last_reload", {}).get("ok") for s in statuses(m[mark:])),
        20,
        agent,
        "applied reload",
    )
    assert "cameras restarted: cam" in statuses(msgs[mark:])[-1]["last_reload"]["changes"]


def test_sighup_moves_the_agent_to_new_mqtt_settings(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    path = tmp_path / "agent.yaml"
    cfg = base(tmp_path, mqtt_broker.port, {"cam": {}})
    path.write_text(yaml.safe_dump(cfg))
    old = mqtt_subscribe(mqtt_broker.port, "edge-agent/hup/#")
    new = mqtt_subscribe(mqtt_broker.port, "site-b/hup/#")
    agent = start_agent(path)
    wait(old, lambda m: detections(m, "cam"), 40, agent, "detections on the old prefix")
    cfg["mqtt"]["prefix"] = "site-b"
    path.write_text(yaml.safe_dump(cfg))
    agent.proc.send_signal(signal.SIGHUP)
    wait(
        new,
        lambda m: (
            any(t == "site-b/hup/cameras/cam/detections" for t, _, _ in m)
            and any(t == "site-b/hup/cameras/cam/state" for t, _, _ in m)
        ),
        30,
        agent,
        "detections and camera state on the new prefix",
    )
    # The old status topic was left saying offline (gracefully), not online forever.
    assert statuses(old.snapshot())[-1]["state"] == "offline"


def camera_states(msgs: list[Message], camera: str) -> list[dict]:
    return [json.loads(p) for p in states(msgs, camera) if p]


def reloaded(sub: Subscriber, agent: AgentProcess, path: Path, cfg: dict, what: str) -> int:
    """Write `cfg` and SIGHUP; once the reload is applied, where its messages start in `sub`."""
    path.write_text(yaml.safe_dump(cfg))
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub, lambda m: any("last_reload" in s for s in statuses(m[mark:])), 30, agent, f"reload of {what}"
    )
    outcome = [s for s in statuses(msgs[mark:]) if "last_reload" in s][-1]["last_reload"]
    assert outcome["ok"] is True, outcome
    return mark


def changes_since(sub: Subscriber, mark: int) -> str:
    return [s for s in statuses(sub.snapshot()[mark:]) if "last_reload" in s][-1]["last_reload"]["changes"]


def test_sighup_changing_decoder_latency_and_decoder_restarts_the_camera_with_them(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    """They were in no list of the planner: a SIGHUP said "no changes" and the old reader kept decoding."""
    path = tmp_path / "agent.yaml"
    cfg = base(tmp_path, mqtt_broker.port, {"cam": {}})  # decoder auto, decoder_latency low
    path.write_text(yaml.safe_dump(cfg))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/hup/#")
    agent = start_agent(path)
    msgs = wait(sub, lambda m: detections(m, "cam"), 40, agent, "detections")
    first = camera_states(msgs, "cam")[-1]
    # auto: NVDEC where the host has it, else the CPU with the reason in the state.
    assert first["decoder"] == "nvdec" or first["decoder_reason"], first

    def streaming_again(mark: int) -> list[dict]:
        wait(
            sub,
            lambda m: any(s["state"] == "streaming" for s in camera_states(m[mark:], "cam")),
            40,
            agent,
            "the camera streaming again",
        )
        return camera_states(sub.snapshot()[mark:], "cam")

    cfg["cameras"]["cam"]["decoder_latency"] = "native"
    mark = reloaded(sub, agent, path, cfg, "decoder_latency")
    after = streaming_again(mark)
    assert after[0]["state"] == "starting", after  # a new reader (a kept one would only stream on)
    assert "cameras restarted: cam" in changes_since(sub, mark)

    cfg["cameras"]["cam"]["decoder"] = "cpu"
    mark = reloaded(sub, agent, path, cfg, "decoder")
    now = [s for s in streaming_again(mark) if s["state"] == "streaming"][-1]
    assert now["decoder"] == "cpu" and now["decoder_reason"] is None, now  # cpu as asked: no reason to give
    assert "cameras restarted: cam" in changes_since(sub, mark)


def test_sighup_changing_snapshot_settings_reaches_the_running_camera(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    """`snapshot` was in no list of the planner: the running camera kept the old settings."""
    path = tmp_path / "agent.yaml"
    cfg = base(tmp_path, mqtt_broker.port, {"cam": {}})  # snapshot.on_detection false
    path.write_text(yaml.safe_dump(cfg))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/hup/#")
    agent = start_agent(path)
    wait(sub, lambda m: len(detections(m, "cam")) >= 3, 40, agent, "detections")
    topic = "edge-agent/hup/cameras/cam/snapshot"
    assert not [t for t, _, _ in sub.snapshot() if t == topic]

    cfg["cameras"]["cam"]["snapshot"] = {"on_detection": True, "min_interval_s": 1.0, "quality": 50}
    mark = reloaded(sub, agent, path, cfg, "snapshot")
    msgs = wait(sub, lambda m: any(t == topic for t, _, _ in m[mark:]), 30, agent, "a snapshot on detection")
    assert "camera live settings: cam" in changes_since(sub, mark)
    jpeg = next(p for t, p, _ in msgs[mark:] if t == topic)
    assert jpeg[:2] == b"\xff\xd8"
    # The same reader streams on: no restart for a snapshot setting.
    assert all(s["state"] != "starting" for s in camera_states(msgs[mark:], "cam"))


def cfg_of(cameras: dict[str, dict], **top: object) -> object:
    data = {
        "models": {"m": {"onnx": "m.onnx"}, "n": {"onnx": "n.onnx"}},
        "cameras": {name: {"url": "rtsp://h/x", "model": "m", **c} for name, c in cameras.items()},
        **top,
    }
    return parse_config(data)


def test_reload_plan_sorts_each_change_into_what_it_needs() -> None:
    old = cfg_of({"same": {}, "src": {}, "route": {}, "move": {}, "gone": {}, "off": {}})
    new = cfg_of(
        {
            "same": {},
            "src": {"url": "rtsp://h/y"},
            "route": {"min_score": 0.7, "classes": ["car"]},
            "move": {"model": "n"},
            "off": {"enabled": False},
            "added": {},
        },
        log_level="debug",
    )
    plan = plan_reload(old, new)
    assert plan.cameras_added == ["added"]
    assert sorted(plan.cameras_removed) == ["gone", "off"]
    assert sorted(plan.cameras_restarted) == ["move", "src"]
    assert plan.cameras_rerouted == ["route"]
    assert plan.models_changed == [] and plan.models_added == [] and plan.models_removed == []
    assert plan.log_level and not plan.mqtt and not plan.needs_restart
    assert plan_reload(old, old).empty


def test_reload_plan_reopens_changed_models_with_their_cameras_and_flags_restart_only_keys() -> None:
    old = cfg_of({"a": {}, "b": {"model": "n"}})
    data = {
        "models": {
            "m": {"onnx": "m.onnx", "iou_threshold": 0.6},
            "n": {"onnx": "n.onnx"},
            "o": {"onnx": "o.onnx"},
        },
        "cameras": {"a": {"url": "rtsp://h/x", "model": "m"}, "b": {"url": "rtsp://h/x", "model": "n"}},
        "engine_dir": "/elsewhere",
        "telemetry": {"prometheus_port": 9999},
        "mqtt": {"host": "broker2"},
    }
    plan = plan_reload(old, parse_config(data))
    assert plan.models_changed == ["m"] and plan.models_added == ["o"]
    assert plan.cameras_restarted == ["a"]  # its model is reopened; b's model is unchanged
    assert plan.mqtt
    assert plan.needs_restart == ["engine_dir", "telemetry.prometheus_port"]
    assert "needs a restart (kept): engine_dir, telemetry.prometheus_port" in plan.summary()
