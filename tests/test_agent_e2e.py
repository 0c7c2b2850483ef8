"""End to end on real components: GStreamer RTSP cameras -> the agent (a subprocess) -> mosquitto."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_agent import AgentProcess, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber
from fixtures_rtsp import RtspServer

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
LABELS = [n for n in (ASSETS / "coco.names").read_text().splitlines() if n.strip()]

pytestmark = pytest.mark.slow


def write_config(
    tmp_path: Path,
    broker_port: int,
    cameras: dict[str, str],
    interval_s: float = 2.0,
    classes: dict[str, list[str]] | None = None,
) -> Path:
    classes = classes or {}
    cams = "\n".join(
        f"  {name}:\n    url: {url}\n    model: detector\n    fps: 5\n    min_score: 0.35\n"
        f"    read_timeout_s: 1\n    open_timeout_s: 2"
        + (f"\n    classes: [{', '.join(classes[name])}]" if name in classes else "")
        for name, url in cameras.items()
    )
    text = f"""
device_id: e2e
engine_dir: {tmp_path / "engines"}
models:
  detector:
    onnx: {ASSETS / "nanodet-m-416.onnx"}
    format: nanodet
    labels: {ASSETS / "coco.names"}
    backend: onnxruntime
    precision: fp32
cameras:
{cams}
mqtt: {{host: 127.0.0.1, port: {broker_port}, keepalive: 5}}
telemetry: {{interval_s: {interval_s}}}
"""
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def detections_of(msgs: list[Message], camera: str) -> list[dict]:
    return decoded(msgs, f"/cameras/{camera}/detections")


def last_state(msgs: list[Message], camera: str) -> str | None:
    states = decoded(msgs, f"/cameras/{camera}/state")
    return states[-1]["state"] if states else None


def has_label(payloads: list[dict], labels: set[str]) -> bool:
    return any(d["label"] in labels for p in payloads for d in p["detections"])


def test_two_cameras_detect_publish_and_survive_a_camera_outage(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    server_a = make_rtsp_server(mounts=("/cam",))
    server_b = make_rtsp_server(mounts=("/cam",))
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/e2e/#")
    config = write_config(
        tmp_path,
        mqtt_broker.port,
        {"gate": server_a.url(), "yard": server_b.url()},
        classes={"yard": ["car"]},
    )
    agent = start_agent(config)

    # 1. Detections of the clip's cars / people from both cameras, within 30 s.
    wanted = {"car", "person"}
    msgs = wait(
        sub,
        lambda m: (
            has_label(detections_of(m, "gate"), {"person"}) and has_label(detections_of(m, "yard"), wanted)
        ),
        30,
        agent,
        "car/person detections from both cameras",
    )
    for payload in detections_of(msgs, "gate") + detections_of(msgs, "yard"):
        assert payload["schema"] == "edge-agent/detections/1"
        assert payload["image"] == {"w": 640, "h": 272}
        assert payload["engine"] == {"backend": "onnxruntime", "precision": "fp32"}
        lat = payload["latency_ms"]
        assert lat["infer"] > 0 and lat["total"] >= lat["infer"]
        for det in payload["detections"]:
            x1, y1, x2, y2 = det["box"]
            assert 0 <= x1 < x2 <= 640 and 0 <= y1 < y2 <= 272, det
            assert 0.35 <= det["score"] <= 1.0
            assert LABELS[det["class_id"]] == det["label"]
    # Per-camera class filter: yard only reports cars, gate (no filter) reports people too.
    assert {d["label"] for p in detections_of(msgs, "yard") for d in p["detections"]} == {"car"}

    # 2. Telemetry with per-stage latencies and both cameras.
    msgs = wait(
        sub,
        lambda m: any("infer" in t["stages"] for t in decoded(m, "/telemetry")),
        15,
        agent,
        "telemetry with stage latencies",
    )
    tele = [t for t in decoded(msgs, "/telemetry") if "infer" in t["stages"]][-1]
    assert tele["stages"]["infer"]["p50"] > 0
    assert tele["stages"]["infer"]["p95"] >= tele["stages"]["infer"]["p50"]
    assert set(tele["cameras"]) == {"gate", "yard"}
    assert tele["process"]["rss_mb"] > 0
    assert 0 <= tele["cameras"]["gate"]["frame_age_ms"] < 5000
    assert decoded(msgs, "/status")[-1]["state"] == "online"

    # 3. Camera gate's server dies: gate goes reconnecting, yard keeps publishing.
    server_a.kill()
    killed_at = len(sub.snapshot())
    wait(sub, lambda m: last_state(m, "gate") == "reconnecting", 15, agent, "gate reconnecting")
    wait(
        sub,
        lambda m: len(detections_of(m[killed_at:], "yard")) >= 5,
        15,
        agent,
        "yard detections during outage",
    )
    assert decoded(sub.snapshot(), "/status")[-1]["state"] == "degraded"

    # 4. It comes back on the same port: gate streams and publishes again.
    server_a.restart()
    restarted_at = len(sub.snapshot())
    wait(
        sub, lambda m: last_state(m[restarted_at:], "gate") == "streaming", 40, agent, "gate streaming again"
    )
    wait(sub, lambda m: len(detections_of(m[restarted_at:], "gate")) >= 3, 20, agent, "gate detections again")
    msgs = sub.snapshot()
    gate_state = decoded(msgs, "/cameras/gate/state")[-1]
    assert gate_state["reconnects"] >= 1
    assert decoded(msgs, "/status")[-1]["state"] == "online"


def test_broker_late_then_sigterm_publishes_offline_within_5s(
    tmp_path: Path,
    mqtt_broker_stopped: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    server = make_rtsp_server(mounts=("/cam",))
    config = write_config(tmp_path, mqtt_broker_stopped.port, {"gate": server.url()})
    agent = start_agent(config)
    time.sleep(3)  # the agent runs with no broker...
    assert agent.proc.poll() is None, agent.text()
    mqtt_broker_stopped.start()  # ...and connects once one answers
    sub = mqtt_subscribe(mqtt_broker_stopped.port, "edge-agent/e2e/#")
    wait(sub, lambda m: len(detections_of(m, "gate")) >= 3, 40, agent, "detections after the broker came")

    rc, took = agent.terminate(timeout=8)
    assert rc == 0, agent.text()[-3000:]
    assert took < 5.0
    msgs = wait(
        sub, lambda m: any(s["state"] == "offline" for s in decoded(m, "/status")), 5, agent, "offline"
    )
    assert decoded(msgs, "/status")[-1]["state"] == "offline"
    assert "stopped" in agent.text()
