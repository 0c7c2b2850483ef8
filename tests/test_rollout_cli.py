"""`fleet deploy` / `fleet rollouts` on a real broker without agents (issue 38): bad input is refused with
one line naming the option or file and nothing sent (exit 2); an offline device fails its wave; junk
retained under `{prefix}/_fleet/rollouts/` never crashes `fleet rollouts`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from fixtures_agent import run_cli
from fixtures_mqtt import Broker, retain

from agent.deploy.signing import generate_keys, sign_document
from agent.fleet.rollout_plan import RolloutOptions
from agent.fleet.rollout_state import DEPLOYING, SOAKING, DeviceRecord
from agent.fleet.rollout_step import Goal, Observation, step

PREFIX = "edge-agent"
SHA = "0" * 64


def _document(tmp_path: Path, signed: bool = True, name: str = "doc.json", **more: Any) -> Path:
    doc: dict[str, Any] = {
        "model": "detector",
        "version": "v9",
        "format": "nanodet",
        "artifacts": {
            "onnx": {"url": "https://store.invalid/m.onnx", "sha256": SHA, "size": 10},
            "labels": {"url": "https://store.invalid/l.txt", "sha256": SHA, "size": 10},
        },
        "request_id": "r9",
        **more,
    }
    if signed:
        private, _ = generate_keys(tmp_path / "keys", "ops", force=True)
        doc = sign_document(doc, private, "ops")
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=2))
    return path


def _status(device: str, state: str = "online", groups: list[str] | None = None) -> tuple[str, bytes]:
    body = {"schema": "edge-agent/status/1", "ts": 1.0, "state": state, "groups": groups or []}
    return f"{PREFIX}/{device}/status", json.dumps(body).encode()


def _flags(broker: Broker) -> list[str]:
    return ["--mqtt-host", "127.0.0.1", "--mqtt-port", str(broker.port)]


def test_bad_input_is_refused_naming_the_option_and_nothing_is_sent(
    mqtt_broker: Broker, mqtt_subscribe: Any, tmp_path: Path
) -> None:
    retain(mqtt_broker.port, [_status("x"), _status("y", groups=["north"])])
    sub = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/#")
    doc = str(_document(tmp_path))
    cases = [
        ([str(tmp_path / "missing.json"), "--all"], "missing.json: cannot read"),
        (
            [str(_document(tmp_path, signed=False, name="u1.json")), "--all"],
            "signature: the document is not signed",
        ),
        ([str(_document(tmp_path, signed=False, name="u2.json", extra=1)), "--all"], "extra: unknown key"),
        ([doc, "--devices", "x,nobody"], "--devices: unknown device(s) nobody"),
        ([doc, "--devices", "x,,y"], "--devices"),
        ([doc, "--group", "south"], "--group south: no device"),
        ([doc], "exactly one of --devices a,b, --group G or --all"),
        ([doc, "--all", "--group", "north"], "exactly one of"),
        ([doc, "--all", "--batch", "0%"], "--batch 0%"),
        ([doc, "--all", "--canary", "3"], "--canary 3: more than the 2 target devices"),
        ([doc, "--all", "--max-failures", "-1"], "--max-failures -1"),
        ([doc, "--resume", "r-nothing-here"], "--resume r-nothing-here: no such rollout"),
        ([doc, "--resume", "bad/id"], "rollout id"),
        ([doc, "--resume", "r-x", "--all"], "--resume ID goes on with the rollout's own"),
        ([doc, "--all", "--trust", "nokey"], "--trust nokey: must be ID=PUBLIC_KEY_FILE"),
    ]
    for args, said in cases:
        run = run_cli("fleet", "deploy", *args, *_flags(mqtt_broker))
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert said in run.stderr and len(run.stderr.strip().splitlines()) == 1, (args, run.stderr)
    assert not [t for t, _, _ in sub.snapshot() if "/cmd/" in t or "/_fleet/" in t]
    down = run_cli("fleet", "deploy", doc, "--all", "--mqtt-host", "127.0.0.1", "--mqtt-port", "1")
    assert down.returncode == 2 and "not reachable" in down.stderr


def test_an_offline_device_fails_its_wave_nothing_sent_and_the_rollout_halts(
    mqtt_broker: Broker, mqtt_subscribe: Any, tmp_path: Path
) -> None:
    retain(mqtt_broker.port, [_status("x", "offline"), _status("y", "offline")])
    sub = mqtt_subscribe(mqtt_broker.port, f"{PREFIX}/#")
    args = ["--all", "--canary", "1", "--offline-timeout", "0.5", "--json", *_flags(mqtt_broker)]
    run = run_cli("fleet", "deploy", str(_document(tmp_path)), *args)
    assert run.returncode == 1, run.stdout + run.stderr
    state = json.loads(run.stdout)
    assert state["status"] == "halted" and state["waves"] == [["x"], ["y"]]
    assert state["devices"]["x"]["stage"] == "failed" and "nothing sent" in state["devices"]["x"]["reason"]
    assert state["devices"]["y"]["stage"] == "pending"
    assert not [t for t, _, _ in sub.snapshot() if "/cmd/" in t]
    # Skipped instead: the rollout is done (nobody was changed, nobody failed).
    skip = run_cli(
        "fleet", "deploy", str(_document(tmp_path)), "--all", "--skip-offline", *_flags(mqtt_broker)
    )
    assert skip.returncode == 0, skip.stdout + skip.stderr
    listed = run_cli("fleet", "rollouts", "--json", *_flags(mqtt_broker))
    statuses = sorted(r["status"] for r in json.loads(listed.stdout).values())
    assert statuses == ["done", "halted"]


def test_junk_retained_rollouts_are_listed_as_unreadable(mqtt_broker: Broker, tmp_path: Path) -> None:
    good = run_cli("fleet", "deploy", str(_document(tmp_path)), "--all", *_flags(mqtt_broker))
    assert good.returncode == 2  # no device: nothing retained by it
    rng = random.Random(3)
    junk = [
        b"\xff\xfe",
        b"[]",
        b"null",
        b"{" * 50_000,
        b'{"schema": "edge-agent/rollout/1"}',
        json.dumps({"schema": "edge-agent/rollout/1", "id": "other", "status": "done"}).encode(),
        bytes(rng.randrange(256) for _ in range(300)),
        b"\x1b[2J" * 10,
    ]
    retain(mqtt_broker.port, [(f"{PREFIX}/_fleet/rollouts/j{i}", body) for i, body in enumerate(junk)])
    listed = run_cli("fleet", "rollouts", *_flags(mqtt_broker))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 1 + len(junk) and all("unreadable" in line for line in lines[1:]), listed.stdout
    assert "\x1b" not in listed.stdout
    one = run_cli("fleet", "rollouts", "j4", *_flags(mqtt_broker))
    assert one.returncode == 1 and "unreadable" in one.stdout and "missing" in one.stdout
    as_json = run_cli("fleet", "rollouts", "--json", *_flags(mqtt_broker))
    assert json.loads(as_json.stdout)["j0"]["status"] == "unreadable"
    none = run_cli("fleet", "rollouts", "nothing", *_flags(mqtt_broker))
    assert none.returncode == 2 and "no such rollout" in none.stderr


def test_junk_device_states_never_break_a_step() -> None:
    """Every value a device's state or answer may hold (from the network), at every stage."""
    rng = random.Random(11)
    values: list[Any] = [None, True, 0, -1, 2**70, 1e308, "", "serving", "x" * 3000, [], {}, {"a": [1]}, "v9"]
    keys = ("stage", "version", "request_id", "progress", "previous", "reason", "ok", "error")
    goal, opts = Goal("detector", "v9", "r9"), RolloutOptions(soak_s=5, offline_timeout_s=5)
    for _ in range(3000):
        rec = DeviceRecord("d", 0, rng.choice([DEPLOYING, SOAKING]))
        rec.sent_at = rec.serving_at = 0.0
        state = {k: rng.choice(values) for k in keys if rng.random() < 0.7}
        answer = {k: rng.choice(values) for k in keys if rng.random() < 0.5} if rng.random() < 0.5 else None
        obs = Observation(rng.random() < 0.8, rng.choice([0.0, 10.0]), state, rng.random() < 0.5, answer)
        step(rec, obs, goal, opts, rng.choice([1.0, 100.0, 1e6]))
        assert rec.reason is None or (len(rec.reason) <= 512 and "\n" not in rec.reason)
        assert 0.0 <= rec.progress <= 1.0


def test_wait_bounds_the_drive_and_resume_goes_on_with_the_same_document(
    mqtt_broker: Broker, tmp_path: Path
) -> None:
    retain(mqtt_broker.port, [_status("x", "offline")])
    doc = str(_document(tmp_path))
    first = run_cli(
        "fleet",
        "deploy",
        doc,
        "--devices",
        "x",
        "--offline-timeout",
        "3",
        "--wait",
        "0.5",
        *_flags(mqtt_broker),
    )
    assert first.returncode == 1 and "go on with --resume" in first.stdout, first.stdout + first.stderr
    rid = first.stdout.split()[1]
    held = json.loads(run_cli("fleet", "rollouts", rid, "--json", *_flags(mqtt_broker)).stdout)
    assert held["status"] == "running" and held["devices"]["x"]["stage"] == "pending"
    other = str(_document(tmp_path, name="other.json", watch_s=0))
    wrong = run_cli("fleet", "deploy", other, "--resume", rid, *_flags(mqtt_broker))
    assert wrong.returncode == 2 and "not the document of this rollout" in wrong.stderr
    again = run_cli("fleet", "deploy", doc, "--resume", rid, "--json", *_flags(mqtt_broker))
    assert again.returncode == 1, again.stdout + again.stderr
    state = json.loads(again.stdout)
    assert state["id"] == rid and state["status"] == "halted"
    assert state["devices"]["x"]["stage"] == "failed" and "offline for 3 s" in state["devices"]["x"]["reason"]
    over = run_cli("fleet", "deploy", doc, "--resume", rid, *_flags(mqtt_broker))
    assert over.returncode == 2 and f"rollout {rid} is halted: nothing to resume" in over.stderr
