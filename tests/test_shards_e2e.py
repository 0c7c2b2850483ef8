"""Pipeline shards on the real agent (subprocess) over mosquitto: two shard processes under one supervisor,
one status with the shards, telemetry naming each shard's pid and cameras; a shard killed with SIGKILL is
restarted while the other shard's cameras keep publishing; cmd/snapshot is routed to the owning shard and
answered once; SIGHUP adds a camera without restarting the others; SIGTERM stops everything."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait, wait_until
from fixtures_mqtt import Broker, Message, Subscriber

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
DEVICE = "shards"
BASE = f"edge-agent/{DEVICE}"
pytestmark = pytest.mark.slow


def write(path: Path, port: int, cameras: list[str]) -> Path:
    cfg = {
        "device_id": DEVICE,
        "engine_dir": str(path.parent / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {
            name: {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 5} for name in cameras
        },
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": 1},
        "pipeline": {"shards": 2, "restart": {"min_s": 0.5, "max_s": 2}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def states(msgs: list[Message], camera: str) -> list[dict[str, Any]]:
    return [json.loads(p) for t, p, _ in msgs if t == f"{BASE}/cameras/{camera}/state" and p]


def detections(msgs: list[Message], camera: str) -> list[dict[str, Any]]:
    return decoded(msgs, f"/cameras/{camera}/detections")


def statuses(msgs: list[Message]) -> list[dict[str, Any]]:
    return [json.loads(p) for t, p, _ in msgs if t == f"{BASE}/status" and p]


def telemetry(msgs: list[Message]) -> list[dict[str, Any]]:
    return decoded(msgs, f"{BASE}/telemetry")


def state_at(msgs: list[Message], start: int, camera: str, state: str) -> int | None:
    """The index of the first state message of `camera` at or after `start` that says `state`."""
    topic = f"{BASE}/cameras/{camera}/state"
    for i in range(start, len(msgs)):
        t, body, _ = msgs[i]
        if t == topic and body and json.loads(body)["state"] == state:
            return i
    return None


def retained_now(port: int, topic_filter: str) -> dict[str, Any]:
    """What a client subscribing now receives retained (non-empty JSON)."""
    sub = Subscriber(port, topic_filter)
    try:
        time.sleep(0.7)
        return {t: json.loads(p) for t, p, r in sub.snapshot() if r and p}
    finally:
        sub.close()


def shards_in(tele: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["shard"]: row for row in tele["shards"]}


def summary(status: dict[str, Any]) -> tuple[int, int, int]:
    """The status' shards: count, running, restarts."""
    s = status["shards"]
    return s["count"], s["running"], s["restarts"]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_shards_status_kill_snapshot_reload_and_stop(
    tmp_path: Path,
    mqtt_broker: Broker,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[..., AgentProcess],
) -> None:
    port = mqtt_broker.port
    cams = ["a", "b", "c"]
    config = write(tmp_path / "agent.yaml", port, cams)
    sub = mqtt_subscribe(port, f"{BASE}/#")
    agent = start_agent(config)

    # ---- start: every camera streams in one of two shards; one status, one telemetry ----------------------
    def running(m: list[Message]) -> bool:
        return all(any(s["state"] == "streaming" for s in states(m, c)) for c in cams) and any(
            s["shards"]["running"] == 2 and s["cameras_up"] == 3 for s in statuses(m)
        )

    wait(sub, running, 90, agent, "3 cameras streaming in 2 running shards")
    status = retained_now(port, f"{BASE}/status")[f"{BASE}/status"]
    assert status["state"] == "online" and status["cameras_total"] == 3 and status["cameras_up"] == 3
    assert summary(status) == (2, 2, 0)

    def full_telemetry(m: list[Message]) -> bool:
        t = telemetry(m)
        return bool(t) and all(row.get("process") and row["pid"] for row in t[-1]["shards"])

    msgs = wait(sub, full_telemetry, 20, agent, "telemetry with both shards")
    tele = telemetry(msgs)[-1]
    shards = shards_in(tele)
    assert sorted(shards) == [0, 1]
    assert sorted(shards[0]["cameras"] + shards[1]["cameras"]) == cams
    assert shards[0]["cameras"] and shards[1]["cameras"]
    pids = {k: row["pid"] for k, row in shards.items()}
    for row in shards.values():
        assert row["state"] == "running" and row["restarts"] == 0 and row["last_exit"] is None
        proc = psutil.Process(row["pid"])
        assert proc.ppid() == agent.proc.pid  # the shards are the agent's children
    assert sorted(tele["cameras"]) == cams and tele["process"]["processes"] == 3
    wait(sub, lambda m: all(detections(m, c) for c in cams), 30, agent, "detections on every camera")

    # ---- cmd/snapshot for a camera of shard 1: routed there, answered once --------------------------------
    target = shards[1]["cameras"][0]
    mark = len(sub.snapshot())
    sub.publish(f"{BASE}/cmd/snapshot", json.dumps({"camera": target, "request_id": "snap-1"}))
    msgs = wait(
        sub,
        lambda m: (
            any(t == f"{BASE}/cameras/{target}/snapshot" for t, _, _ in m[mark:])
            and decoded(m[mark:], "/cmd/snapshot/result")
        ),
        20,
        agent,
        "the snapshot and its answer",
    )
    time.sleep(1.5)  # a second answer or picture would have come by now
    after = sub.snapshot()[mark:]
    answers = decoded(after, "/cmd/snapshot/result")
    assert len(answers) == 1, answers
    answer = answers[0]
    assert answer["ok"] is True and answer["error"] is None, answer
    assert answer["shard"] == 1 and answer["camera"] == target and answer["request_id"] == "snap-1"
    assert answer["device"] == DEVICE
    pictures = [(t, p) for t, p, _ in after if t.startswith(f"{BASE}/cameras/") and t.endswith("/snapshot")]
    assert [t for t, _ in pictures] == [f"{BASE}/cameras/{target}/snapshot"]
    jpeg = pictures[0][1]
    assert jpeg[:2] == b"\xff\xd8" and len(jpeg) == answer["bytes"]

    # ---- SIGKILL of shard 0: restarted; its cameras reconnect; shard 1 keeps publishing --------------------
    victims, others = shards[0]["cameras"], shards[1]["cameras"]
    mark = len(sub.snapshot())
    os.kill(pids[0], signal.SIGKILL)

    def recovery(m: list[Message]) -> tuple[int, int] | None:
        """Where the first victim went down and where the last came back (reconnecting, then streaming)."""
        downs, ups = [], []
        for cam in victims:
            down = state_at(m, mark, cam, "reconnecting")
            up = None if down is None else state_at(m, down, cam, "streaming")
            if up is None:
                return None
            downs.append(down)
            ups.append(up)
        return min(downs), max(ups)

    msgs = wait(sub, lambda m: recovery(m) is not None, 60, agent, "the killed shard's cameras back")
    first_down, up_again = recovery(msgs) or (0, 0)
    gap = msgs[first_down:up_again]
    for cam in victims:
        down = next(s for s in states(msgs[mark:], cam) if s["state"] == "reconnecting")
        assert "shard 0 killed by SIGKILL" in down["last_error"], down
        assert not detections(gap, cam)  # nothing from a dead process
    for cam in others:  # the other shard never noticed
        assert len(detections(gap, cam)) >= 3, (len(gap), [t for t, _, _ in gap][:50])
        assert all(s["state"] == "streaming" for s in states(msgs[mark:], cam))
    assert "shard 0: killed by SIGKILL; restarting in 0.5 s" in agent.text()
    assert agent.proc.poll() is None
    msgs = wait(
        sub,
        lambda m: any(summary(s) == (2, 2, 1) and s["cameras_up"] == 3 for s in statuses(m[mark:])),
        20,
        agent,
        "the status: both shards running again after one restart",
    )
    assert any(s["shards"]["running"] == 1 and s["state"] == "degraded" for s in statuses(msgs[mark:]))
    for cam in cams:
        assert retained_now(port, f"{BASE}/cameras/{cam}/state")[f"{BASE}/cameras/{cam}/state"]["state"] == (
            "streaming"
        )
    msgs = wait(
        sub,
        lambda m: any(
            shards_in(t)[0]["restarts"] == 1
            and shards_in(t)[0]["state"] == "running"
            and "process" in shards_in(t)[0]
            for t in telemetry(m[mark:])
        ),
        20,
        agent,
        "telemetry of the restarted shard",
    )
    row = next(
        shards_in(t)[0]
        for t in reversed(telemetry(msgs[mark:]))
        if shards_in(t)[0]["restarts"] == 1 and "process" in shards_in(t)[0]
    )
    assert row["pid"] != pids[0] and row["last_exit"] == "killed by SIGKILL" and row["cameras"] == victims
    assert not alive(pids[0])
    pids[0] = row["pid"]
    wait(
        sub,
        lambda m: all(len(detections(m[mark:], c)) >= 1 for c in victims),
        20,
        agent,
        "detections from the restarted shard",
    )

    # ---- SIGHUP with a fourth camera: it streams; the others are not restarted -----------------------------
    write(config, port, [*cams, "d"])
    mark = len(sub.snapshot())
    agent.proc.send_signal(signal.SIGHUP)
    msgs = wait(
        sub,
        lambda m: (
            any(s.get("last_reload") for s in statuses(m[mark:]))
            and any(s["state"] == "streaming" for s in states(m[mark:], "d"))
            and len(detections(m[mark:], "d")) >= 2
        ),
        40,
        agent,
        "the reload applied and camera d streaming",
    )
    reload = [s for s in statuses(msgs[mark:]) if s.get("last_reload")][-1]["last_reload"]
    assert reload["ok"] is True and reload["changes"] == "cameras added: d", reload
    msgs = wait(
        sub,
        lambda m: any(s["cameras_total"] == 4 and s["cameras_up"] == 4 for s in statuses(m[mark:])),
        20,
        agent,
        "4 cameras up",
    )
    for cam in cams:
        assert all(s["state"] == "streaming" for s in states(msgs[mark:], cam)), states(msgs[mark:], cam)
    msgs = wait(
        sub,
        lambda m: any("d" in tele["cameras"] for tele in telemetry(m[mark:])),
        20,
        agent,
        "telemetry with camera d",
    )
    tele = [t for t in telemetry(msgs[mark:]) if "d" in t["cameras"]][-1]
    shards = shards_in(tele)
    assert {k: row["pid"] for k, row in shards.items()} == pids  # no shard restarted
    assert sorted(shards[0]["cameras"] + shards[1]["cameras"]) == [*cams, "d"]
    assert set(victims) <= set(shards[0]["cameras"])
    assert set(others) <= set(shards[1]["cameras"])  # nobody moved

    # ---- a SIGTERM to a shard alone is ignored (systemd sends it to the whole cgroup; the supervisor stops
    # its shards through their pipes, so none exits early and gets reported `reconnecting`) -----------------
    os.kill(pids[1], signal.SIGTERM)
    time.sleep(1.0)
    assert alive(pids[1])

    # ---- SIGTERM: a clean exit, `offline`, no shard left --------------------------------------------------
    rc, took = agent.terminate(timeout=20)
    assert took < 15, took
    assert rc == 0, agent.text()[-3000:]
    assert statuses(sub.snapshot())[-1]["state"] == "offline"
    assert retained_now(port, f"{BASE}/status")[f"{BASE}/status"]["state"] == "offline"
    assert wait_until(lambda: not any(alive(p) for p in pids.values()), 5), pids
    # Each shard said its cameras stopped before it went (retained: not left `streaming`).
    retained = retained_now(port, f"{BASE}/cameras/+/state")
    assert {t: b["state"] for t, b in retained.items()} == {
        f"{BASE}/cameras/{cam}/state": "stopped" for cam in [*cams, "d"]
    }
    assert "Traceback" not in agent.text() and "did not stop" not in agent.text()
