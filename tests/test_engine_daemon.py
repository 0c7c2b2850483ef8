"""The daemon's engine lifecycle with a real TensorRT-RTX build (CPU, ahead of time) and real mosquitto.

Start with no engine -> ONNX Runtime serves (fallback) -> child-process build -> `ready`; detections keep
flowing throughout. Then `edge-agent rebuild` from another process and MQTT cmd/rebuild, and a failing
build that leaves ONNX Runtime serving.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_agent import AgentProcess, decoded, run_cli, wait
from fixtures_mqtt import Broker, Message, Subscriber

from engines.store import EngineStore

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
pytestmark = pytest.mark.slow


def engine_states(msgs: list[Message]) -> list[dict]:
    return decoded(msgs, "/engines/detector")


def results(msgs: list[Message], action: str) -> list[dict]:
    return decoded(msgs, f"/cmd/{action}/result")


def max_gap(ts: list[float]) -> float:
    ts = sorted(ts)
    return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)


def test_daemon_builds_engine_while_serving_and_picks_up_rebuilds(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    onnx = tmp_path / "model.onnx"
    shutil.copy(ASSETS / "nanodet-m-416.onnx", onnx)
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
device_id: eng
engine_dir: {tmp_path / "engines"}
models:
  detector:
    onnx: {onnx}
    format: nanodet
    labels: {ASSETS / "coco.names"}
    backend: tensorrt_rtx
    precision: fp32
cameras:
  street: {{url: {ASSETS / "bikes.mp4"}, model: detector, fps: 10, min_score: 0.3}}
mqtt: {{host: 127.0.0.1, port: {mqtt_broker.port}}}
telemetry: {{interval_s: 5}}
""")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/eng/#")
    agent = start_agent(config)

    # 1. No engine: ONNX Runtime serves while the child process builds, then the engine is built. No GPU
    # here: it cannot run, so the state says what serves (issue 36.2): `fallback`, ONNX Runtime, fp32, why.
    def built(m: list[Message]) -> list[dict]:
        return [s for s in engine_states(m) if s["state"] == "fallback" and s.get("plan_sha256")]

    msgs = wait(sub, built, 60, agent, "engine built")
    assert not any(s["state"] == "ready" for s in engine_states(msgs)), engine_states(msgs)
    ready = built(msgs)[0]
    assert ready["key"] and ready["build_s"] > 0 and ready["plan_sha256"]
    assert ready["fingerprint"]["trt_flavor"] == "tensorrt_rtx"
    assert ready["loaded"] is False and "no CUDA GPU" in ready["load_error"]
    assert (ready["backend"], ready["precision"]) == ("onnxruntime", "fp32"), ready
    assert "cannot run on this device" in ready["reasons"][0] and ready["key"] in ready["reasons"][0]
    assert any(s["state"] == "building" for s in engine_states(msgs))
    # Everywhere: the telemetry (Prometheus' backend_info) and `fleet status` name ONNX Runtime.
    tele = wait(sub, lambda m: bool(decoded(m, "/telemetry")), 15, agent, "telemetry")
    assert decoded(tele, "/telemetry")[-1]["backend"] == {"detector": "onnxruntime"}
    fleet = run_cli("fleet", "status", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port))
    assert fleet.returncode == 0 and "onnxruntime" in fleet.stdout, fleet.stdout + fleet.stderr
    assert "TensorRT-RTX" not in fleet.stdout, fleet.stdout
    assert "ONNX Runtime serves (fallback)" in agent.text()
    plan = tmp_path / "engines" / "detector" / f"{ready['key']}-{ready['plan_sha256'][:12]}.plan"
    assert plan.stat().st_size > 1_000_000

    # Detections kept flowing across the build: frames captured before, during and after it.
    wait(sub, lambda m: len(decoded(m, "/detections")) >= 20, 30, agent, "20 detections")
    building_ts = min(s["ts"] for s in engine_states(sub.snapshot()) if s["state"] == "building")
    time.sleep(2)
    caps = [d["ts_capture"] for d in decoded(sub.snapshot(), "/detections")]
    during = [t for t in caps if building_ts < t < ready["ts"]]
    assert during, "no frame was served while the engine was building"
    assert max(caps) > ready["ts"]
    assert max_gap(caps) < 1.5, "detections stalled during the build"

    # 2. `edge-agent rebuild --force` from another process; the daemon picks the new plan up.
    n_before = len(sub.snapshot())
    cli = run_cli("rebuild", "-c", str(config), "--force", "--wait", "30", timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "built engine" in cli.stdout
    msgs = wait(
        sub,
        lambda m: any(
            s.get("plan_sha256") not in (None, ready["plan_sha256"]) for s in engine_states(m[n_before:])
        ),
        20,
        agent,
        "daemon picking up the CLI-built engine",
    )
    picked = [s for s in engine_states(msgs[n_before:]) if s.get("plan_sha256") != ready["plan_sha256"]][-1]
    assert picked["state"] == "fallback" and picked["key"] == ready["key"]

    # 3. A second rebuild without --force has nothing to do and says so.
    cli = run_cli("rebuild", "-c", str(config), timeout=120)
    assert cli.returncode == 0 and "nothing to build" in cli.stdout, cli.stdout + cli.stderr

    # 4. MQTT cmd/rebuild: validated, answered, then built.
    sub.publish("edge-agent/eng/cmd/rebuild", json.dumps({"model": "nope", "request_id": "bad"}))
    msgs = wait(sub, lambda m: any(r["request_id"] == "bad" for r in results(m, "rebuild")), 10, agent, "bad")
    bad = next(r for r in results(msgs, "rebuild") if r["request_id"] == "bad")
    assert bad["ok"] is False and "field 'model'" in bad["error"] and bad["request_id"] == "bad"

    n_before = len(sub.snapshot())
    sub.publish("edge-agent/eng/cmd/rebuild", json.dumps({"force": True, "request_id": "r1"}))
    msgs = wait(sub, lambda m: any(r["request_id"] == "r1" for r in results(m, "rebuild")), 10, agent, "r1")
    r1 = next(r for r in results(msgs, "rebuild") if r["request_id"] == "r1")
    assert r1["ok"] is True and r1["started"] == ["detector"]
    wait(
        sub,
        lambda m: (
            [s["state"] for s in engine_states(m[n_before:])][-1:] == ["fallback"]
            and any(s["state"] == "building" for s in engine_states(m[n_before:]))
        ),
        60,
        agent,
        "rebuild via MQTT",
    )

    # 5. A build that fails (ONNX truncated on disk) reports why; ONNX Runtime keeps serving.
    last = [s for s in engine_states(sub.snapshot()) if s["state"] == "fallback"][-1]
    plan = tmp_path / "engines" / "detector" / f"{last['key']}-{last['plan_sha256'][:12]}.plan"
    onnx.write_bytes(onnx.read_bytes()[:4096])
    n_before = len(sub.snapshot())
    sub.publish("edge-agent/eng/cmd/rebuild", json.dumps({"force": True, "request_id": "r2"}))
    msgs = wait(
        sub,
        lambda m: any(s["state"] == "failed" for s in engine_states(m[n_before:])),
        60,
        agent,
        "failed build state",
    )
    failed = next(s for s in engine_states(msgs[n_before:]) if s["state"] == "failed")
    assert str(onnx) in failed["error"]
    assert failed["backend"] == "onnxruntime"
    n_dets = len(decoded(sub.snapshot(), "/detections"))
    wait(
        sub, lambda m: len(decoded(m, "/detections")) >= n_dets + 5, 15, agent, "detections after the failure"
    )
    # The previous engine (the forced rebuilds replaced the first plan) is still listed and intact.
    store = EngineStore(tmp_path / "engines", check_writable=False)
    current = store.manifest("detector", ready["key"])
    assert current is not None and len(store.read_plan("detector", ready["key"])) > 1_000_000
    assert agent.proc.poll() is None


def _config(tmp_path: Path, engine_dir: Path, onnx: Path) -> Path:
    config = tmp_path / "agent.yaml"
    config.write_text(f"""
engine_dir: {engine_dir}
models:
  detector: {{onnx: {onnx}, format: nanodet, labels: {ASSETS / "coco.names"}, backend: tensorrt_rtx,
              precision: fp32}}
cameras:
  street: {{url: {ASSETS / "bikes.mp4"}, model: detector}}
mqtt: {{enabled: false}}
""")
    return config


def test_unwritable_engine_dir_is_a_clear_start_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where engine_dir's parent should be")
    config = _config(tmp_path, blocker / "engines", ASSETS / "nanodet-m-416.onnx")
    run = run_cli("run", "-c", str(config), timeout=60)
    assert run.returncode == 2
    assert str(blocker / "engines") in run.stderr and "Traceback" not in run.stderr


def test_check_exit_codes(tmp_path: Path) -> None:
    missing_onnx = _config(tmp_path, tmp_path / "engines", tmp_path / "nope.onnx")
    run = run_cli("check", "-c", str(missing_onnx), timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "nope.onnx" in run.stdout + run.stderr
