"""MQTT contract against a real mosquitto: availability, offline queue, commands, secrets."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_agent import wait_until
from fixtures_mqtt import Broker, Subscriber, mqtt_client, publish

from agent.mqtt import MqttClient, MqttError, read_password_file
from agent.mqtt.commands import CommandError
from agent.mqtt.topics import Topics, payload

REPO = Path(__file__).resolve().parents[1]
PREFIX = "edge-agent"

MakeClient = Callable[..., MqttClient]


def body(msg: tuple[str, bytes, bool]) -> dict[str, Any]:
    return json.loads(msg[1])


def on(topic: str) -> Callable[[list[tuple[str, bytes, bool]]], list[tuple[str, bytes, bool]]]:
    return lambda msgs: [m for m in msgs if m[0] == topic]


@pytest.fixture
def make_client(request: pytest.FixtureRequest) -> Iterator[MakeClient]:
    """Factory for MqttClient on 127.0.0.1 with a device id unique to the test; closed at teardown."""
    clients: list[MqttClient] = []

    def make(port: int, device: str | None = None, start: bool = True, **kw: Any) -> MqttClient:
        device = device or request.node.name.replace("[", "-").replace("]", "")
        kw.setdefault(
            "birth",
            lambda: {
                "state": "online",
                "version": "0.1.0",
                "started_at": 1.0,
                "cameras_up": 1,
                "cameras_total": 1,
            },
        )
        c = mqtt_client(Topics(PREFIX, device), host="127.0.0.1", port=port, **kw)
        clients.append(c)
        if start:
            c.start()
        return c

    try:
        yield make
    finally:
        for c in clients:
            c.close()


# ---- topics / payloads ---------------------------------------------------------------------------
def test_topics_follow_the_contract() -> None:
    t = Topics("edge-agent", "yard-01")
    assert t.status == "edge-agent/yard-01/status"
    assert t.camera_state("gate") == "edge-agent/yard-01/cameras/gate/state"
    assert t.detections("gate") == "edge-agent/yard-01/cameras/gate/detections"
    assert t.snapshot("gate") == "edge-agent/yard-01/cameras/gate/snapshot"
    assert t.telemetry == "edge-agent/yard-01/telemetry"
    assert t.engine("detector") == "edge-agent/yard-01/engines/detector"
    assert t.cmd_filter == "edge-agent/yard-01/cmd/+"
    assert t.cmd_result("rebuild") == "edge-agent/yard-01/cmd/rebuild/result"
    assert t.action_of("edge-agent/yard-01/cmd/reload") == "reload"
    assert t.action_of("edge-agent/yard-01/cmd/reload/result") is None


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda t: t.camera_state("a/b"), "camera"),
        (lambda t: t.detections("cam+"), "camera"),
        (lambda t: t.engine("#"), "model"),
        (lambda t: t.engine(""), "model"),
        (lambda t: Topics("edge-agent", "dev/1"), "device"),
        (lambda t: Topics("a/+/b", "dev"), "prefix"),
    ],
)
def test_topic_names_are_validated(call: Callable[[Topics], Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        call(Topics("edge-agent", "dev"))


def test_payload_has_schema_ts_and_serialises_numpy() -> None:
    before = time.time()
    raw = payload(
        "detections",
        frame_id=np.int64(7),
        score=np.float32(0.5),
        box=np.array([1.0, 2.0, 3.0, 4.0]),
        ok=np.bool_(True),
    )
    d = json.loads(raw)
    assert d["schema"] == "edge-agent/detections/1"
    assert before <= d["ts"] <= time.time()
    assert d == {**d, "frame_id": 7, "score": 0.5, "box": [1.0, 2.0, 3.0, 4.0], "ok": True}
    assert b" " not in raw  # compact
    with pytest.raises(ValueError, match="schema: unknown 'detection'"):
        payload("detection")
    with pytest.raises(ValueError):
        payload("telemetry", value=float("nan"))  # JSON has no NaN


def test_password_file_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(MqttError, match=str(missing)):
        read_password_file(missing)
    f = tmp_path / "pw"
    f.write_text("s3cret pass\n")
    assert read_password_file(f) == "s3cret pass"


def test_publish_validates_in_the_callers_thread(make_client: MakeClient) -> None:
    c = make_client(1, start=False)  # never started: everything is queued, nothing is sent
    t = c.topics
    with pytest.raises(ValueError, match="kind 'state' is retained"):
        c.publish(t.status, b"{}", retain=False, kind="state")
    with pytest.raises(ValueError, match="kind 'event' is not retained"):
        c.publish(t.telemetry, b"{}", retain=True)
    with pytest.raises(ValueError, match="wildcards"):
        c.publish(f"{t.base}/cameras/+/state", b"{}")
    with pytest.raises(TypeError, match="payload must be bytes"):
        c.publish(t.telemetry, "{}")  # type: ignore[arg-type]
    c.publish(t.telemetry, b"{}")
    c.publish(t.camera_state("gate"), b"{}", kind="state")
    assert c.stats() == {**c.stats(), "connected": False, "queued": 1, "states_pending": 1}


# ---- availability --------------------------------------------------------------------------------
def test_birth_and_states_are_retained_for_a_late_subscriber(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    c = make_client(mqtt_broker.port)
    assert c.wait_connected(10)
    live = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/{c.topics.device}/#")
    c.publish(c.topics.camera_state("gate"), payload("camera-state", state="streaming"), kind="state")
    c.publish(c.topics.engine("det"), payload("engine", state="ready"), qos=1, retain=True, kind="state")
    live.wait_for(lambda m: len(m) >= 3)  # the broker has them all: now a late subscriber
    sub = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/{c.topics.device}/#")
    msgs = sub.wait_for(lambda m: len(m) >= 3)
    by_topic = {t: (json.loads(p), r) for t, p, r in msgs}
    status, retained = by_topic[c.topics.status]
    assert retained
    assert status["schema"] == "edge-agent/status/1"
    assert {k: status[k] for k in ("state", "version", "cameras_up", "cameras_total")} == {
        "state": "online",
        "version": "0.1.0",
        "cameras_up": 1,
        "cameras_total": 1,
    }
    assert by_topic[c.topics.camera_state("gate")][0]["state"] == "streaming"
    assert by_topic[c.topics.camera_state("gate")][1]
    assert by_topic[c.topics.engine("det")][1]


def test_lwt_offline_when_the_process_is_killed(
    mqtt_broker: Broker, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    script = (
        "import sys, time\n"
        "from agent.config import MqttConfig\n"
        "from agent.mqtt import MqttClient\n"
        "from agent.mqtt.topics import Topics\n"
        "cfg = MqttConfig(host='127.0.0.1', port=int(sys.argv[1]))\n"
        "c = MqttClient(cfg, Topics('edge-agent', 'lwt-dev'))\n"
        "c.start()\n"
        "sys.exit(3) if not c.wait_connected(10) else print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(mqtt_broker.port)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        sub = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/lwt-dev/status")
        sub.wait_for(lambda m: any(body(x)["state"] == "online" for x in m))
        t0 = time.monotonic()
        proc.kill()  # SIGKILL: no chance to say goodbye; the broker must publish the will
        msgs = sub.wait_for(lambda m: any(body(x)["state"] == "offline" for x in m))
        print(f"LWT delivered {1000 * (time.monotonic() - t0):.1f} ms after SIGKILL")
        offline = next(body(x) for x in msgs if body(x)["state"] == "offline")
        assert offline["schema"] == "edge-agent/status/1"
    finally:
        proc.kill()
        proc.wait()
    late = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/lwt-dev/status")
    msgs = late.wait_for(lambda m: len(m) >= 1)
    assert body(msgs[0])["state"] == "offline" and msgs[0][2], "LWT must be retained"


def test_graceful_close_publishes_offline_retained(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    c = make_client(mqtt_broker.port)
    assert c.wait_connected(10)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 3.5
    assert not c.stats()["connected"]
    late = mqtt_subscribe(mqtt_broker.port, c.topics.status)
    msgs = late.wait_for(lambda m: len(m) >= 1)
    assert body(msgs[0])["state"] == "offline" and msgs[0][2]
    c.publish(c.topics.telemetry, b"{}")  # after close: ignored, no exception


def test_abrupt_close_lets_the_broker_publish_the_will(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    c = make_client(mqtt_broker.port)
    assert c.wait_connected(10)
    sub = mqtt_subscribe(mqtt_broker.port, c.topics.status)
    sub.wait_for(lambda m: any(body(x)["state"] == "online" for x in m))
    c.close(graceful=False)
    sub.wait_for(lambda m: any(body(x)["state"] == "offline" for x in m))


def test_close_is_bounded_when_the_broker_is_gone(mqtt_broker: Broker, make_client: MakeClient) -> None:
    c = make_client(mqtt_broker.port)
    assert c.wait_connected(10)
    mqtt_broker.kill()
    assert wait_until(lambda: not c.connected, 5)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 3.5


# ---- offline behaviour ---------------------------------------------------------------------------
def _wait_failed_attempt(c: MqttClient) -> None:
    # After a failed attempt the client waits >= reconnect_min_s / 2 (jitter: 0.5 s): time to start the
    # broker and a subscriber before the client can connect, so the subscriber sees everything.
    n = c.stats()["connect_failures"]
    assert wait_until(lambda: c.stats()["connect_failures"] > n, 10)


def test_broker_down_at_start_then_everything_is_delivered_in_order(
    mqtt_broker_stopped: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    broker = mqtt_broker_stopped
    t0 = time.monotonic()
    c = make_client(broker.port, reconnect_max_s=2)  # production: 30; keeps the test short
    assert time.monotonic() - t0 < 1.0, "start() must not block on a dead broker"
    t = c.topics
    c.publish(t.camera_state("gate"), payload("camera-state", state="starting"), kind="state")
    for i in range(5):
        c.publish(t.detections("gate"), json.dumps({"i": i}).encode(), kind="event")
    c.publish(t.camera_state("gate"), payload("camera-state", state="streaming"), kind="state")
    st = c.stats()
    assert not st["connected"] and st["queued"] == 5 and st["dropped_offline"] == 0

    _wait_failed_attempt(c)
    broker.start()
    t_up = time.monotonic()
    sub = mqtt_subscribe(broker.port, f"{PREFIX}/{t.device}/#")
    assert c.wait_connected(15)
    print(f"connected {time.monotonic() - t_up:.2f} s after the broker started")
    msgs = sub.wait_for(lambda m: len(on(t.detections("gate"))(m)) == 5)
    topics = [m[0] for m in msgs]
    assert topics[0] == t.status and body(msgs[0])["state"] == "online"  # birth first
    states = on(t.camera_state("gate"))(msgs)
    assert [body(m)["state"] for m in states] == ["streaming"]  # only the latest state
    assert [body(m)["i"] for m in on(t.detections("gate"))(msgs)] == [0, 1, 2, 3, 4]
    assert topics.index(t.camera_state("gate")) < topics.index(t.detections("gate"))
    st = c.stats()
    assert st["connected"] and st["queued"] == 0 and st["reconnects"] == 0


def test_offline_queue_drops_oldest_and_counts(
    mqtt_broker_stopped: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    broker = mqtt_broker_stopped
    c = make_client(broker.port, offline_queue=5, reconnect_max_s=2)
    topic = c.topics.detections("gate")
    for i in range(12):
        c.publish(topic, json.dumps({"i": i}).encode())
    st = c.stats()
    assert (st["queued"], st["dropped_offline"]) == (5, 7)
    _wait_failed_attempt(c)
    broker.start()
    sub = mqtt_subscribe(broker.port, topic)
    assert c.wait_connected(15)
    msgs = sub.wait_for(lambda m: len(m) >= 5)
    time.sleep(0.2)  # nothing more may arrive
    assert [body(m)["i"] for m in sub.snapshot()] == [7, 8, 9, 10, 11]
    assert c.stats()["dropped_offline"] == 7 and msgs


def test_reconnect_after_broker_restart_restores_retained_states(
    mqtt_broker: Broker,
    make_client: MakeClient,
    mqtt_subscribe: Callable[..., Subscriber],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.mqtt")
    c = make_client(mqtt_broker.port, reconnect_max_s=2)
    assert c.wait_connected(10)
    c.publish(c.topics.engine("det"), payload("engine", state="ready"), kind="state")
    mqtt_broker.stop()
    assert wait_until(lambda: not c.connected, 5)
    c.publish(c.topics.detections("gate"), b'{"i":1}', qos=1)
    _wait_failed_attempt(c)
    _wait_failed_attempt(c)  # several failed retries must still log the loss only once
    mqtt_broker.start()  # persistence false: the restarted broker has forgotten every retained message
    t_up = time.monotonic()
    sub = mqtt_subscribe(mqtt_broker.port, c.topics.detections("gate"))
    assert c.wait_connected(15)
    print(f"reconnected {time.monotonic() - t_up:.2f} s after the broker restarted")
    sub.wait_for(lambda m: len(m) == 1)
    late = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/{c.topics.device}/#")
    msgs = late.wait_for(lambda m: {c.topics.status, c.topics.engine("det")} <= {x[0] for x in m})
    assert all(r for _, _, r in msgs)
    assert c.stats()["reconnects"] == 1
    ours = [r for r in caplog.records if r.name == "agent.mqtt"]
    lost = [r for r in ours if "lost" in r.getMessage()]
    restored = [r for r in ours if "restored" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING
    assert len(restored) == 1 and restored[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "retries must not log errors"


# ---- commands ------------------------------------------------------------------------------------
@pytest.fixture
def commander(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> tuple[MqttClient, Subscriber]:
    c = make_client(mqtt_broker.port)

    def snapshot(req: Any) -> dict[str, Any]:
        return {"camera": req.camera, "bytes": 1234}

    def rebuild(req: Any) -> dict[str, Any]:
        raise CommandError(f"field 'model': {req.model!r} is not configured")

    c.on_command("snapshot", snapshot)
    c.on_command("rebuild", rebuild)
    c.on_command("reload", lambda req: None)
    assert c.wait_connected(10)
    sub = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/{c.topics.device}/cmd/+/result")
    return c, sub


def _command(commander: tuple[MqttClient, Subscriber], action: str, raw: bytes) -> dict[str, Any]:
    c, sub = commander
    sub.publish(f"{PREFIX}/{c.topics.device}/cmd/{action}", raw)
    msgs = sub.wait_for(lambda m: len(m) >= 1)
    assert msgs[0][0] == c.topics.cmd_result(action) and not msgs[0][2]
    result = body(msgs[0])
    assert result["schema"] == "edge-agent/cmd-result/1"
    return result


@pytest.mark.parametrize(
    ("action", "raw", "expect"),
    [
        ("snapshot", b'{"camera": "gate", "request_id": "r1"', "is not valid JSON"),
        ("snapshot", b"[1, 2]", "must be a JSON object, got list"),
        ("snapshot", b"\xff\xfe", "payload is not UTF-8"),
        ("selfdestruct", b'{"request_id": "r2"}', "unknown action 'selfdestruct'"),
        ("rebuild", b'{"model": "ghost", "request_id": "r3"}', "field 'model': 'ghost' is not configured"),
        ("snapshot", b'{"request_id": "r4"}', "field 'camera': required field is missing"),
    ],
)
def test_bad_commands_are_answered(
    commander: tuple[MqttClient, Subscriber], action: str, raw: bytes, expect: str
) -> None:
    result = _command(commander, action, raw)
    assert result["ok"] is False
    assert expect in result["error"]
    if b"request_id" in raw and b"{" in raw and raw.endswith(b"}"):
        assert result["request_id"] == json.loads(raw)["request_id"]


def test_good_commands_run_their_handlers(commander: tuple[MqttClient, Subscriber]) -> None:
    result = _command(commander, "snapshot", b'{"camera": "gate", "request_id": 42}')
    assert result == {**result, "ok": True, "error": None, "camera": "gate", "bytes": 1234, "request_id": 42}
    sub = commander[1]
    sub.messages.clear()
    result = _command(commander, "reload", b"{}")
    assert result["ok"] is True and result["request_id"] is None


# ---- retained commands (DESIGN: ignored and deleted, never run) -----------------------------------
def _retained_on(port: int, topic: str) -> list[bytes]:
    """What the broker holds retained on `topic` now (a fresh subscriber's view)."""
    fresh = Subscriber(port, topic)
    try:
        time.sleep(0.3)
        return [p for t, p, r in fresh.snapshot() if r and p]
    finally:
        fresh.close()


def _ran(c: MqttClient, runs: list[str], sub: Subscriber, marker: str) -> list[str]:
    """Send a plain command until it is answered (the client may not be subscribed yet: wait_connected does
    not wait for the SUBACK): every message the client got before it has then been screened and, if it was
    to run, run (one network thread, one command worker, in order). The commands that ran, but snapshot."""

    def answered() -> bool:
        results = [json.loads(p) for t, p, _ in sub.snapshot() if t.endswith("/result")]
        return any(r["request_id"] == marker for r in results)

    body = json.dumps({"camera": "gate", "request_id": marker})
    for _ in range(20):
        sub.publish(f"{PREFIX}/{c.topics.device}/cmd/snapshot", body)
        if wait_until(answered, 0.5):
            break
    assert answered()
    return [r for r in runs if r != "snapshot"]


def _command_client(make_client: MakeClient, port: int, protocol: str, runs: list[str]) -> MqttClient:
    c = make_client(port, device="retained-cmd", protocol=protocol)
    c.on_command("reload", lambda req: runs.append("reload"))
    c.on_command("snapshot", lambda req: runs.append("snapshot"))
    assert c.wait_connected(10)
    return c


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_retained_command_found_at_connect_is_deleted_not_run(
    mqtt_broker: Broker,
    make_client: MakeClient,
    mqtt_subscribe: Callable[..., Subscriber],
    protocol: str,
) -> None:
    port = mqtt_broker.port
    topic = f"{PREFIX}/retained-cmd/cmd/reload"
    publish(port, topic, b"{}", retain=True)  # left by some tool: it would run at every connect
    sub = mqtt_subscribe(port, f"{PREFIX}/retained-cmd/cmd/+/result")
    runs: list[str] = []
    c = _command_client(make_client, port, protocol, runs)
    assert _ran(c, runs, sub, "m1") == []  # not run
    assert c.commands.stats()["retained_ignored"] == 1
    assert _retained_on(port, topic) == []  # deleted at the broker
    assert not [t for t, _, _ in sub.snapshot() if t.endswith("/reload/result")]  # and not answered


def test_a_retained_command_published_while_connected_is_deleted_not_run_mqtt5(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    """MQTT 5: the command filters are subscribed with retain-as-published, so a retained command that
    arrives live still carries its flag: ignored and deleted like one found at connect."""
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{PREFIX}/retained-cmd/cmd/+/result")
    runs: list[str] = []
    c = _command_client(make_client, port, "5", runs)
    assert _ran(c, runs, sub, "m1") == []  # subscribed: what follows arrives live
    topic, fleet = f"{PREFIX}/retained-cmd/cmd/reload", f"{PREFIX}/_all/cmd/reload"
    publish(port, topic, b"{}", retain=True)
    publish(port, fleet, b"{}", retain=True)
    assert _ran(c, runs, sub, "m2") == []  # neither ran
    assert c.commands.stats()["retained_ignored"] == 2
    assert _retained_on(port, topic) == []  # ours deleted
    assert _retained_on(port, fleet) == [b"{}"]  # a fleet topic is shared: left for its owner to delete
    # A plain command on the same topic still runs: only the flag decides.
    sub.publish(topic, b"{}")
    sub.wait_for(lambda m: any(t.endswith("/reload/result") for t, _, _ in m))
    assert runs.count("reload") == 1


def test_a_retained_command_published_while_connected_with_mqtt311(
    mqtt_broker: Broker, make_client: MakeClient, mqtt_subscribe: Callable[..., Subscriber]
) -> None:
    """MQTT 3.1.1 cannot keep the flag on a live delivery (no retain-as-published): such a command runs
    once, as documented, and is deleted at the next connect, where it arrives flagged."""
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{PREFIX}/retained-cmd/cmd/+/result")
    runs: list[str] = []
    c = _command_client(make_client, port, "3.1.1", runs)
    assert _ran(c, runs, sub, "m1") == []
    topic = f"{PREFIX}/retained-cmd/cmd/reload"
    publish(port, topic, b"{}", retain=True)
    assert _ran(c, runs, sub, "m2") == ["reload"]  # the broker cleared the flag: it looked live
    assert _retained_on(port, topic) == [b"{}"]
    c.close()
    runs.clear()
    again = _command_client(make_client, port, "3.1.1", runs)  # the next start (or reconnect)
    assert _ran(again, runs, sub, "m3") == []
    assert again.commands.stats()["retained_ignored"] == 1
    assert _retained_on(port, topic) == []


# ---- secrets / refused connections ---------------------------------------------------------------
def test_credentials_never_leak(
    mqtt_broker: Broker, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "pw-Zq8-very-secret"
    c = make_client(mqtt_broker.port, username="agent-user", password=secret)
    assert c.wait_connected(10)
    c.publish(c.topics.telemetry, b"{}")
    c.close()
    assert secret not in repr(c) and "agent-user" not in repr(c)
    assert caplog.records, "expected some log output to check"
    assert secret not in caplog.text


def test_refused_connection_is_not_treated_as_connected(
    tmp_path: Path, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Broker(tmp_path, allow_anonymous=False)  # no password file: every client is refused
    try:
        broker.start()
        caplog.set_level(logging.DEBUG)
        secret = "pw-refused-secret"
        c = make_client(broker.port, username="u", password=secret)
        _wait_failed_attempt(c)
        _wait_failed_attempt(c)
        assert not c.connected and not c.stats()["connected"]
        c.publish(c.topics.detections("gate"), b"{}")
        assert c.stats()["queued"] == 1
        refusals = [r for r in caplog.records if r.name == "agent.mqtt" and "refused" in r.getMessage()]
        assert len(refusals) == 1, "a refusal is logged once, not per retry"
        assert "Not authorized" in refusals[0].getMessage()
        assert secret not in caplog.text
    finally:
        broker.kill()
