"""Broker faults: mosquitto stopped and restarted, or killed with SIGKILL, under a running agent.

mosquitto runs without persistence, so a restarted broker has lost every retained message: the agent must
publish its birth and every retained state again, then the events it queued while the broker was away, in
order. Bounds follow the configured reconnect backoff (`mqtt.reconnect_max_s`) plus slack for a loaded
2-core CI box; the measured times are recorded (conftest) for the README table.
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

from faults.harness import (
    CLIP,
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

DEVICE = "faults-broker"
BASE = f"edge-agent/{DEVICE}"
RECONNECT_MAX_S = 2.0  # mqtt.reconnect_max_s in these configs: a broker that is back is found within it
SLACK_S = 10.0  # connect + flush on a loaded shared box
FPS = 4


def start(
    tmp_path: Path, broker: Broker, start_agent: Callable[..., AgentProcess], **mqtt: object
) -> AgentProcess:
    cfg = config_dict(
        tmp_path,
        broker.port,
        {"a": {"url": str(CLIP), "fps": FPS}, "b": {"url": str(CLIP), "fps": FPS}},
        device=DEVICE,
        mqtt={"reconnect_min_s": 0.5, "reconnect_max_s": RECONNECT_MAX_S, **mqtt},
    )
    return start_agent(write_config(tmp_path, cfg))


def both_streaming(msgs: list) -> bool:
    return (
        last_state(msgs, "a") == "streaming"
        and last_state(msgs, "b") == "streaming"
        and len(detections(msgs, "a")) >= 3
        and len(detections(msgs, "b")) >= 3
    )


def assert_frame_ids_increase(msgs: list, camera: str) -> None:
    ids = [d["frame_id"] for d in detections(msgs, camera)]
    bad = [(x, y) for x, y in itertools.pairwise(ids) if y <= x]
    assert not bad, f"camera {camera}: detections out of order or duplicated at {bad[:5]} (ids {ids})"


def test_broker_restart_birth_retained_states_and_queued_events_in_order(
    tmp_path: Path,
    mqtt_broker: Broker,
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        agent = start(tmp_path, mqtt_broker, start_agent)
        wait(sub, both_streaming, 60, agent, "both cameras streaming and detecting")
        started_at = bodies(sub.snapshot(), "/status")[-1]["started_at"]

        mqtt_broker.stop()  # SIGTERM: mosquitto closes every connection; retained messages are gone
        down_wall = time.time()
        time.sleep(4.0)  # the agent keeps detecting and queues its events
        assert agent.proc.poll() is None, agent.text()[-3000:]

        # Freeze the agent for the instant this test's own subscriber needs to reconnect, so that the
        # subscriber is there before the agent's first packet and sees everything the agent sends.
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            mqtt_broker.start()
            up = time.monotonic()
            up_wall = time.time()
            assert sub.wait_subscribed(5), "test subscriber did not reconnect"
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        mark = len(sub.timed())

        msgs = wait(
            sub,
            lambda m: len(detections(m[mark:], "a")) >= 10 and len(detections(m[mark:], "b")) >= 10,
            RECONNECT_MAX_S + SLACK_S + 10,
            agent,
            "detections after the broker restart",
        )
        after = sub.timed()[mark:]
        first = min(t for t, topic, _, _ in after if topic.startswith(BASE + "/"))
        recovery = first - up
        bound = RECONNECT_MAX_S + SLACK_S
        record_recovery("broker restart (SIGTERM, 4 s down)", recovery, bound, "broker up -> first message")
        assert recovery <= bound, f"first message {recovery:.1f} s after the broker came back"

        # 1. The birth comes first, and tells the present.
        first_topic, first_body = next((t, p) for _, t, p, _ in after if t.startswith(BASE + "/"))
        assert first_topic == f"{BASE}/status", f"first message after reconnect on {first_topic}"
        birth = json.loads(first_body)
        assert birth["state"] == "online" and birth["cameras_up"] == 2 and birth["cameras_total"] == 2
        assert birth["started_at"] == started_at  # the same process, not a restart
        # 2. Retained states again at the broker (it had lost them all).
        held = retained_now(mqtt_broker.port, f"{BASE}/#")
        assert json.loads(held[f"{BASE}/status"])["state"] == "online", held.keys()
        for cam in ("a", "b"):
            assert json.loads(held[f"{BASE}/cameras/{cam}/state"])["state"] == "streaming", held.keys()
        # 3. Events queued during the outage were delivered, and every camera's detections stay in order.
        for cam in ("a", "b"):
            queued = [d for d in detections(msgs[mark:], cam) if down_wall + 0.5 < d["ts_capture"] < up_wall]
            assert len(queued) >= 4, f"camera {cam}: only {len(queued)} detections from the outage delivered"
            assert_frame_ids_increase(msgs, cam)
        assert agent.proc.poll() is None
        assert "restored" in agent.text()
        assert_clean_log(agent)
    finally:
        sub.close()


def test_broker_sigkill_bounded_queue_then_recovery(
    tmp_path: Path,
    mqtt_broker: Broker,
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    queue = 10  # mqtt.offline_queue: far fewer than the events of the outage
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        agent = start(tmp_path, mqtt_broker, start_agent, offline_queue=queue)
        wait(sub, both_streaming, 60, agent, "both cameras streaming and detecting")

        mqtt_broker.kill()  # SIGKILL: no goodbye to anyone
        down_wall = time.time()
        time.sleep(8.0)  # longer than the keep-alive (5 s); ~64 detections + telemetry for a queue of 10
        assert agent.proc.poll() is None, agent.text()[-3000:]

        mqtt_broker.start()
        up = time.monotonic()
        up_wall = time.time()
        msgs = wait(
            sub,
            lambda m: any(d["ts_capture"] > up_wall for d in detections(m, "a") + detections(m, "b")),
            RECONNECT_MAX_S + SLACK_S + 10,
            agent,
            "a live detection after the broker came back",
        )
        live = next(
            t
            for t, topic, p, _ in sub.timed()
            if topic.endswith("/detections") and json.loads(p)["ts_capture"] > up_wall
        )
        recovery = live - up
        bound = RECONNECT_MAX_S + SLACK_S
        record_recovery("broker SIGKILL (8 s down)", recovery, bound, "broker up -> first live detection")
        assert recovery <= bound, f"first live detection {recovery:.1f} s after the broker came back"

        held = retained_now(mqtt_broker.port, f"{BASE}/#")
        assert json.loads(held[f"{BASE}/status"])["state"] == "online"
        for cam in ("a", "b"):
            assert json.loads(held[f"{BASE}/cameras/{cam}/state"])["state"] == "streaming"
        # The queue stayed bounded: at most `queue` events of the outage were kept (the newest), the rest
        # dropped and counted in telemetry.
        outage = [
            d
            for d in detections(msgs, "a") + detections(msgs, "b")
            if down_wall + 0.5 < d["ts_capture"] < up_wall
        ]
        assert len(outage) <= queue, f"{len(outage)} outage detections delivered with offline_queue {queue}"
        msgs = wait(
            sub,
            lambda m: any(t["mqtt"]["dropped_offline"] > 0 for t in bodies(m, "/telemetry")),
            20,
            agent,
            "telemetry counting dropped_offline",
        )
        dropped = max(t["mqtt"]["dropped_offline"] for t in bodies(msgs, "/telemetry"))
        assert dropped >= 20, dropped
        for cam in ("a", "b"):
            assert_frame_ids_increase(msgs, cam)
        assert agent.proc.poll() is None
        assert_clean_log(agent)
    finally:
        sub.close()
