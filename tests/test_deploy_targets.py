"""Issue 37's targets on the real agent (mosquitto, nginx, two cameras, the bundled NanoDet on ONNX Runtime):
broken second versions made by tools/deploy_variants.py are stopped where they must be, and the model that
serves never stops meanwhile.

- labels shuffled: rejected at the gate, its agreement in the state (below gate.min_agreement);
- slow (the same outputs + side-branch MatMuls, ~5x): rejected in shadow at the default max_latency_ratio,
  its latency ratio in the state;
- night_blind (the same outputs on daylight frames; the engine fails on dark frames): passes gate and
  shadow on the clip's frames, is promoted; then camera cam2's scene turns dark (its RTSP source restarts
  as a black test pattern) and the watch rolls the version back by itself within watch_s, reason published.
  The failure is the version's (the old model processes the dark frames without an error); the dark scene
  is the test's doing, as a nightfall after a daytime promotion would be.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess
from fixtures_deploy import (
    BASE,
    MODEL,
    DeployKit,
    agent_config,
    deploy,
    deploy_kit,  # noqa: F401  (a fixture)
    telemetry,
    wait_stage,
)
from fixtures_mqtt import Broker, Subscriber
from fixtures_rtsp import RtspServer, gst_rtsp_missing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import deploy_variants  # noqa: E402


@pytest.fixture(scope="module")
def kit(deploy_kit: DeployKit) -> DeployKit:  # noqa: F811  (the imported fixture)
    """The module's artifact store with the target variants added."""
    deploy_kit.add("slow.onnx", deploy_variants.slow)
    deploy_kit.add("night_blind.onnx", deploy_variants.night_blind)
    return deploy_kit


def frames_by_camera(sub: Subscriber) -> list[dict[str, int]]:
    """Per telemetry message: each camera's frames processed since start (cumulative frames_out)."""
    return [
        {cam: int(c.get("frames_out") or 0) for cam, c in (t.get("cameras") or {}).items()}
        for t in telemetry(sub)
    ]


def wait_frames(
    sub: Subscriber, cams: tuple[str, ...], more_than: dict[str, int], agent: AgentProcess
) -> None:
    """Wait (60 s at most) until every camera in `cams` has processed more frames than `more_than` says."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = frames_by_camera(sub)
        if rows and all(rows[-1].get(c, 0) > more_than.get(c, 0) for c in cams):
            return
        time.sleep(0.2)
    pytest.fail(f"cameras {cams} processed no frames beyond {more_than}; agent log:\n{agent.text()[-3000:]}")


def latest(sub: Subscriber) -> dict[str, int]:
    rows = frames_by_camera(sub)
    return rows[-1] if rows else {}


Started = tuple[AgentProcess, Subscriber]


@pytest.fixture
def running(
    tmp_path: Path,
    mqtt_broker: Broker,
    kit: DeployKit,
    start_agent: Callable[..., AgentProcess],
    mqtt_subscribe: Callable[..., Subscriber],
) -> Callable[..., tuple[AgentProcess, Subscriber]]:
    def start(config: Path) -> tuple[AgentProcess, Subscriber]:
        sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
        agent = start_agent(config)
        wait_frames(sub, ("cam1", "cam2"), {}, agent)
        return agent, sub

    return start


def _ended(
    sub: Subscriber, agent: AgentProcess, doc: dict[str, Any], stage: str
) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """Deploy `doc` and wait for its `stage`; (the state, frames per camera before, frames at the end)."""
    before = latest(sub)
    answer = deploy(sub, doc, agent=agent)
    assert answer["ok"] is True, answer
    state = wait_stage(sub, MODEL, stage, version=doc["version"], agent=agent)
    return state, before, latest(sub)


def test_labels_shuffled_are_rejected_at_the_gate(
    tmp_path: Path, mqtt_broker: Broker, kit: DeployKit, running: Callable[..., Started]
) -> None:
    agent, sub = running(agent_config(tmp_path, mqtt_broker.port, kit))
    doc = kit.make_document("shuffled", onnx="v2.onnx", labels="shuffled.names")
    state, before, end = _ended(sub, agent, doc, "rejected")
    assert state["stage"] == "rejected", state
    assert state["reason"].startswith("gate: agreement with the serving model"), state
    gate = state["checks"]["gate"]
    assert gate["agreement"] < gate["threshold"] == 0.6, gate
    assert "shadow" not in state["checks"]
    # The serving model never stopped: both cameras processed frames through the deployment and after it.
    wait_frames(sub, ("cam1", "cam2"), end, agent)
    assert all(end[c] > before[c] for c in ("cam1", "cam2")), (before, end)


def test_slow_version_is_rejected_in_shadow(
    tmp_path: Path, mqtt_broker: Broker, kit: DeployKit, running: Callable[..., Started]
) -> None:
    agent, sub = running(agent_config(tmp_path, mqtt_broker.port, kit))
    # The config's default limit (deploy.shadow.max_latency_ratio 2.0); 20 interleaved frames for the p95.
    doc = kit.make_document("slow", onnx="slow.onnx", shadow={"frames": 20})
    state, before, end = _ended(sub, agent, doc, "rejected")
    assert state["stage"] == "rejected", state
    assert state["checks"]["gate"]["agreement"] >= 0.99, state["checks"]  # its outputs are the model's
    shadow = state["checks"]["shadow"]
    assert shadow["latency_ratio"] > 2.0, shadow
    assert state["reason"].startswith("shadow: latency p95"), state
    assert f"{shadow['latency_ratio']:.2f}x" in state["reason"]
    wait_frames(sub, ("cam1", "cam2"), end, agent)
    assert all(end[c] > before[c] for c in ("cam1", "cam2")), (before, end)


@pytest.fixture
def camera_source() -> Iterator[RtspServer]:
    why = gst_rtsp_missing()
    if why is not None:
        pytest.skip(why)
    server = RtspServer(mounts=["/cam2"]).start()
    try:
        yield server
    finally:
        server.close()


def rtsp_cam2(config: Path, url: str) -> Path:
    """`config` with camera cam2 reading `url` (the fixture's cameras are files)."""
    cfg = yaml.safe_load(config.read_text())
    cfg["cameras"]["cam2"] = {"url": url, "model": MODEL, "read_timeout_s": 5}
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_a_version_that_fails_a_camera_after_promotion_is_rolled_back_by_itself(
    tmp_path: Path,
    mqtt_broker: Broker,
    kit: DeployKit,
    running: Callable[..., tuple[AgentProcess, Subscriber]],
    camera_source: RtspServer,
) -> None:
    # Only the watch rules that a camera's scene change cannot trip by itself: the source's restart stalls
    # cam2 for a moment (frame age) and a dark scene has fewer detections.
    watch = {"age_p95_factor": 100.0, "detections_collapse_ratio": 0.0}
    config = agent_config(tmp_path, mqtt_broker.port, kit, deploy={"watch": watch})
    agent, sub = running(rtsp_cam2(config, camera_source.url("/cam2")))
    watch_s = 120
    doc = kit.make_document("night", onnx="night_blind.onnx", watch_s=watch_s)
    before = latest(sub)
    assert deploy(sub, doc, agent=agent)["ok"] is True
    watching = wait_stage(sub, MODEL, "watching", version="night", agent=agent)
    assert watching["checks"]["gate"]["agreement"] >= 0.99  # daylight: the same outputs as the model
    camera_source.pattern = True  # nightfall: cam2's source now sends a black test pattern
    camera_source.restart()
    state = wait_stage(sub, MODEL, ("rolled_back", "serving"), agent=agent, timeout=watch_s + 60)
    assert state["stage"] == "rolled_back", state
    assert state["version"] == "night"
    # The model's engine errors are counted per model (its worker), so the rule names its first camera.
    assert state["reason"].startswith("watch: engine errors on camera cam"), state
    assert state["reason"].endswith("the config model serves again"), state
    # rolled_back (not serving): within watch_s; the journal says it too
    assert f"deployment {MODEL} night: rolled_back: watch: engine errors on camera cam" in agent.text()
    # The model serves both cameras again, the dark one included: the old model runs the dark frames.
    end = latest(sub)
    wait_frames(sub, ("cam1", "cam2"), end, agent)
    assert all(end[c] > before.get(c, 0) for c in ("cam1",)), (before, end)
