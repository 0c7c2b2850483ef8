"""Ten real agents (subprocesses: a file camera each, ONNX Runtime, 1 fps) on one mosquitto: no cross-talk,
fleet commands answered once per agent, "any one agent" commands once in all, a second agent with a taken
device id reported by both and its exit healing the retained status, `edge-agent fleet status` listing all."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from fixtures_agent import ASSETS, AgentProcess, bundled_model, run_cli, wait
from fixtures_mqtt import Broker, Message, Subscriber
from test_fleet import answers

PREFIX = "fleet10"
N = 10


def config(
    tmp_path: Path, port: int, device: str, camera: str, groups: list[str], name: str | None = None
) -> Path:
    cfg = {
        "device_id": device,
        "engine_dir": str(tmp_path / f"engines-{name or device}"),
        "models": {"detector": bundled_model()},
        "cameras": {camera: {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 1}},
        "mqtt": {
            "host": "127.0.0.1",
            "port": port,
            "keepalive": 5,
            "prefix": PREFIX,
            "groups": groups,
            "shared_subscriptions": True,
        },
        "telemetry": {"interval_s": 2},
    }
    path = tmp_path / f"{name or device}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def latest_status(msgs: list[Message], device: str) -> dict | None:
    bodies = [json.loads(p) for t, p, _ in msgs if t == f"{PREFIX}/{device}/status" and p]
    return bodies[-1] if bodies else None


def streaming(msgs: list[Message], device: str) -> bool:
    st = latest_status(msgs, device)
    return st is not None and st.get("state") == "online" and st.get("cameras_up") == 1


def test_ten_agents_share_one_broker(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{PREFIX}/#")
    devices = [f"node-{i:02d}" for i in range(N)]
    agents = {
        d: start_agent(config(tmp_path, port, d, f"cam-{i:02d}", ["even" if i % 2 == 0 else "odd"]))
        for i, d in enumerate(devices)
    }
    for d in devices:  # 2 cores in CI: ten interpreters loading OpenCV and ONNX Runtime take a while
        wait(sub, lambda m, d=d: streaming(m, d), 180, agents[d], f"{d} streaming")
    wait(
        sub,
        lambda m: {t.split("/")[1] for t, _, _ in m if t.endswith("/detections")} == set(devices),
        60,
        agents[devices[0]],
        "detections from every agent",
    )

    # Fleet-wide, group and "any one agent" commands.
    sub.publish(f"{PREFIX}/_all/cmd/reload", json.dumps({"request_id": "all"}))
    sub.publish(f"{PREFIX}/_group/even/cmd/reload", json.dumps({"request_id": "even"}))
    for k in range(6):
        sub.publish(f"{PREFIX}/_any/cmd/reload", json.dumps({"request_id": f"any-{k}"}))
    sub.publish(f"{PREFIX}/_group/odd/any/cmd/reload", json.dumps({"request_id": "odd-any"}))
    wait(sub, lambda m: len(answers(m, "all")) >= N, 60, agents[devices[0]], "an answer to _all from all ten")
    wait(sub, lambda m: len(answers(m, "even")) >= N // 2, 30, agents[devices[0]], "the even group's answers")
    time.sleep(3.0)  # duplicates, if any, would arrive by now
    msgs = sub.snapshot()
    got_all = answers(msgs, "all")
    assert sorted(b["device"] for _, b in got_all) == devices  # each exactly once
    assert all(t == f"{PREFIX}/{b['device']}/cmd/reload/result" and b["ok"] for t, b in got_all)
    assert sorted(b["device"] for _, b in answers(msgs, "even")) == devices[0::2]
    for k in range(6):
        assert len(answers(msgs, f"any-{k}")) == 1, answers(msgs, f"any-{k}")
    odd_any = answers(msgs, "odd-any")
    assert len(odd_any) == 1 and odd_any[0][1]["device"] in devices[1::2], odd_any

    # No cross-talk: each device's subtree carries only its own camera.
    cams = {(t.split("/")[1], t.split("/")[3]) for t, _, _ in msgs if "/cameras/" in t}
    assert cams == {(d, f"cam-{i:02d}") for i, d in enumerate(devices)}

    # `fleet status` lists all ten from retained messages.
    proc = run_cli(
        "fleet", "status", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(port), "--prefix", PREFIX, "--json"
    )
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    assert [r["device"] for r in table] == devices
    for r in table:
        assert r["state"] == "online" and r["cameras"] == "1/1" and r["duplicates"] == 0, r
        assert r["engines"] == {"detector": "ready"} and r["tensorrt"] == ["onnxruntime"], r
        assert r["version"] and r["last_seen"] is not None and r["last_seen"] < 30, r
    text = run_cli(
        "fleet", "status", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(port), "--prefix", PREFIX
    )
    assert text.returncode == 0 and text.stdout.count("online") == N, text.stdout
    assert text.stdout.splitlines()[0].split() == [
        "device",
        "state",
        "version",
        "cameras",
        "fps",
        "engines",
        "tensorrt",
        "last_seen",
    ]

    # A second agent with a taken device id: both report it, and the status says so.
    first = agents[devices[3]]
    twin = start_agent(config(tmp_path, port, devices[3], "cam-twin", [], name="twin"))
    wait(sub, lambda m: "another agent publishes as device id" in twin.text(), 120, twin, "the twin's report")
    wait(
        sub, lambda m: "another agent publishes as device id" in first.text(), 30, first, "the first's report"
    )
    wait(
        sub,
        lambda m: (latest_status(m, devices[3]) or {}).get("duplicates"),
        30,
        first,
        "duplicates in status",
    )
    proc = run_cli(
        "fleet", "status", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(port), "--prefix", PREFIX
    )
    assert "DUPLICATE ID: 2 agents" in proc.stdout, proc.stdout
    # The twin stops (offline on the shared status topic): the first publishes its status again.
    n_before = len(sub.snapshot())
    code, _ = twin.terminate(30)
    assert code == 0
    wait(
        sub,
        lambda m: (
            (st := latest_status(m[n_before:], devices[3])) is not None
            and st["state"] == "online"
            and "duplicates" not in st
        ),
        30,
        first,
        "the first agent's status restored after the twin left",
    )
    for d, a in agents.items():
        assert a.proc.poll() is None, d
        assert "Traceback" not in a.text(), d


def test_late_will_of_a_crashed_run_does_not_mark_the_new_run_offline(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    """The old run hangs (SIGSTOP: its socket stays open, as on a cut cable) and a new one starts at once: the
    broker publishes the old run's will 1.5 keep-alives later, over the new run's birth. The new run sees
    another instance's offline status live and publishes its own again."""
    port = mqtt_broker.port
    sub = mqtt_subscribe(port, f"{PREFIX}/+/status")
    path = config(tmp_path, port, "phoenix", "cam", [])
    old = start_agent(path)
    wait(sub, lambda m: streaming(m, "phoenix"), 120, old, "first run streaming")
    old_instance = latest_status(sub.snapshot(), "phoenix")["instance"]  # type: ignore[index]
    old.proc.send_signal(signal.SIGSTOP)
    new = start_agent(path)
    wait(
        sub,
        lambda m: (st := latest_status(m, "phoenix")) is not None and st["instance"] != old_instance,
        120,
        new,
        "the new run's birth",
    )
    # The will (keepalive 5 s: within ~8 s), then the new run's status again, online.
    wait(
        sub,
        lambda m: any(
            json.loads(p).get("instance") == old_instance and json.loads(p)["state"] == "offline"
            for _, p, _ in m
        ),
        30,
        new,
        "the old run's will",
    )
    wait(
        sub,
        lambda m: (st := latest_status(m, "phoenix")) is not None and st["instance"] != old_instance,
        15,
        new,
        "the new run's status after the will",
    )
    time.sleep(1.0)
    fresh = Subscriber(port, f"{PREFIX}/phoenix/status")  # what a dashboard starting now reads (retained)
    try:
        fresh.wait_for(lambda m: bool(m), 5)
        st = json.loads(fresh.snapshot()[-1][1])
        assert st["state"] != "offline" and st["instance"] != old_instance, st
    finally:
        fresh.close()
    assert "went offline" not in new.text()  # a will of a run it never saw alive is not a duplicate
