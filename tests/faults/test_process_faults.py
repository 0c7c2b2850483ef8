"""Agent process faults: SIGKILL (the broker publishes the last will), SIGTERM (graceful offline, cameras
`stopped`, exit 0 within 5 s), a SIGHUP storm (the agent keeps running and serving).

The last will and the graceful offline status must carry the same fields (OFFLINE_FIELDS), with true
values: a dashboard cannot tell from a missing field whether the agent died or stopped.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_agent import AgentProcess, wait
from fixtures_mqtt import Broker

from agent import __version__
from faults.harness import (
    CLIP,
    OFFLINE_FIELDS,
    LiveSubscriber,
    assert_clean_log,
    bodies,
    config_dict,
    detections,
    last_state,
    retained_now,
    write_config,
)

pytestmark = pytest.mark.slow

DEVICE = "faults-proc"
BASE = f"edge-agent/{DEVICE}"
KEEPALIVE_S = 5
CAMERAS = ("a", "b")


def start(tmp_path: Path, broker: Broker, start_agent: Callable[..., AgentProcess]) -> AgentProcess:
    cfg = config_dict(
        tmp_path,
        broker.port,
        {cam: {"url": str(CLIP)} for cam in CAMERAS},
        device=DEVICE,
        keepalive=KEEPALIVE_S,
    )
    return start_agent(write_config(tmp_path, cfg))


def running(msgs: list) -> bool:
    statuses = bodies(msgs, "/status")
    return (
        bool(statuses)
        and statuses[-1]["state"] == "online"
        and all(last_state(msgs, cam) == "streaming" and detections(msgs, cam) for cam in CAMERAS)
    )


def offline(msgs: list) -> list[dict]:
    return [s for s in bodies(msgs, "/status") if s["state"] == "offline"]


def assert_offline_fields(status: dict, birth: dict, what: str) -> None:
    assert set(status) == OFFLINE_FIELDS, (
        f"{what}: fields {sorted(status)}, expected {sorted(OFFLINE_FIELDS)}"
    )
    assert status["schema"] == "edge-agent/status/1"
    assert status["state"] == "offline"
    assert isinstance(status["reason"], str) and status["reason"], status
    assert status["version"] == __version__ == birth["version"], (status, birth)
    assert status["started_at"] == birth["started_at"], (status, birth)
    assert status["instance"] == birth["instance"], (status, birth)  # the same process said both
    assert status["cameras_up"] == 0, status
    assert status["cameras_total"] == len(CAMERAS), f"{what}: cameras_total {status['cameras_total']}"


def test_sigkill_last_will_carries_the_offline_fields(
    tmp_path: Path,
    mqtt_broker: Broker,
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        agent = start(tmp_path, mqtt_broker, start_agent)
        msgs = wait(sub, running, 60, agent, "online with both cameras streaming")
        birth = bodies(msgs, "/status")[-1]
        assert offline(msgs) == []

        agent.proc.kill()
        killed = time.monotonic()
        agent.proc.wait(5)
        bound = KEEPALIVE_S * 1.5
        msgs = wait(sub, lambda m: bool(offline(m)), bound + 1, agent, "the last will (status offline)")
        arrived = next(t for t, topic, p, _ in sub.timed() if topic == f"{BASE}/status" and b"offline" in p)
        record_recovery("agent SIGKILL", arrived - killed, bound, "kill -> last will on the status topic")
        assert arrived - killed <= bound
        lwt = offline(msgs)[-1]
        assert_offline_fields(lwt, birth, "last will")
        held = json.loads(retained_now(mqtt_broker.port, f"{BASE}/status")[f"{BASE}/status"])
        assert held == lwt  # retained: a dashboard that connects later sees it too
    finally:
        sub.close()


def test_sigterm_graceful_offline_cameras_stopped_exit_0_within_5s(
    tmp_path: Path,
    mqtt_broker: Broker,
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        agent = start(tmp_path, mqtt_broker, start_agent)
        msgs = wait(sub, running, 60, agent, "online with both cameras streaming")
        birth = bodies(msgs, "/status")[-1]

        rc, took = agent.terminate(timeout=10)
        record_recovery("agent SIGTERM", took, 5.0, "SIGTERM -> process exited (offline published)")
        assert rc == 0, agent.text()[-3000:]
        assert took < 5.0, f"exit took {took:.2f} s"
        msgs = wait(sub, lambda m: bool(offline(m)), 3, agent, "graceful offline status")
        status = offline(msgs)[-1]
        assert_offline_fields(status, birth, "graceful offline")
        assert "stop" in status["reason"], status
        # What stays at the broker: offline, and every camera `stopped` (never `streaming` after exit).
        held = retained_now(mqtt_broker.port, f"{BASE}/#")
        assert json.loads(held[f"{BASE}/status"])["state"] == "offline"
        for cam in CAMERAS:
            state = json.loads(held[f"{BASE}/cameras/{cam}/state"])
            assert state["state"] == "stopped", (cam, state)
        assert_clean_log(agent)
    finally:
        sub.close()


def test_sighup_storm_leaves_it_running_and_serving(
    tmp_path: Path,
    mqtt_broker: Broker,
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        agent = start(tmp_path, mqtt_broker, start_agent)
        wait(sub, running, 60, agent, "online with both cameras streaming")
        storm = time.monotonic()
        for _ in range(20):  # 20 SIGHUPs in 1 s, the config unchanged
            agent.proc.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        assert agent.proc.poll() is None, agent.text()[-3000:]
        mark = len(sub.timed())
        wait(
            sub,
            lambda m: all(len(detections(m[mark:], cam)) >= 4 for cam in CAMERAS),
            30,
            agent,
            "detections from both cameras after the storm",
        )
        # The longest silence of a camera's detections from just before the storm to now.
        gap_bound = 10.0
        for cam in CAMERAS:
            times = [
                t
                for t, topic, _, _ in sub.timed()
                if topic == f"{BASE}/cameras/{cam}/detections" and t > storm - 1
            ]
            gap = max(b - a for a, b in itertools.pairwise(times))
            record_recovery("20 x SIGHUP in 1 s", gap, gap_bound, f"longest detection gap of camera {cam}")
            assert gap <= gap_bound, f"camera {cam} published nothing for {gap:.1f} s around the storm"
        time.sleep(2.0)  # reloads still queued would show up now
        msgs = sub.snapshot()
        assert agent.proc.poll() is None, agent.text()[-3000:]
        statuses = bodies(msgs, "/status")
        assert statuses[-1]["state"] == "online", statuses[-1]
        refused = [s["last_reload"] for s in statuses if s.get("last_reload", {}).get("ok") is False]
        assert refused == [], refused
        # Unchanged config: no camera restarted (a reload would keep them streaming in place).
        for cam in CAMERAS:
            assert all(s["state"] == "streaming" for s in bodies(msgs[mark:], f"/cameras/{cam}/state")), cam
        text = agent.text()
        assert 1 <= text.count("reload applied") <= 20, text.count("reload applied")
        rc, took = agent.terminate(timeout=10)
        assert rc == 0 and took < 5.0, (rc, took, agent.text()[-3000:])
        assert_clean_log(agent)
    finally:
        sub.close()
