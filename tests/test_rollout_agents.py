"""Fleet rollouts against real agents (issue 38): four agents (subprocesses) on one mosquitto, the bundled
NanoDet on ONNX Runtime, artifacts from nginx (tests/fixtures_deploy.py). The tests of this module run in
order on the same four agents (a version a test leaves serving is the next one's starting point):

1. canary 1 + batches of 2, soak 2 s: every device serves, the retained rollout is `done`;
2. a broken version (labels shuffled: fails the gate): halted after the canary, the other devices untouched;
3. a device offline in its wave: a failure after --offline-timeout, the halt rolls back the promoted canary;
4. the same with --skip-offline: skipped, the rollout done;
5. the CLI killed (SIGKILL) mid-rollout: --resume ID completes it without deploying a device twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import REPO, AgentProcess, run_cli, wait_until
from fixtures_deploy import (
    MODEL,
    DeployKit,
    agent_config,
    deploy_kit,  # noqa: F401 (the fixture: the module's artifact store)
)
from fixtures_mqtt import MOSQUITTO, Broker, Subscriber

from agent.fleet.rollout import Broker as Bus
from agent.fleet.rollout import RolloutOptions, Targets, parse_batch, read_rollouts, run_rollout
from agent.fleet.rollout_state import Rollout

DEVICES = ("ra", "rb", "rc", "rd")
PREFIX = "edge-agent"
WAIT = 600.0  # a deployment on this shared 2-core machine: tens of seconds each, several at once


@dataclass
class Fleet:
    broker: Broker
    kit: DeployKit
    configs: dict[str, Path]
    tmp: Path
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    sub: Subscriber | None = None

    def start(self, device: str) -> None:
        n = sum(1 for p in self.tmp.glob(f"{device}-*.log"))
        self.agents[device] = AgentProcess(self.configs[device], self.tmp / f"{device}-{n}.log")

    def stop(self, device: str) -> None:
        agent = self.agents.pop(device)
        agent.terminate(20)
        agent.kill()

    def status(self, device: str) -> dict[str, Any]:
        return _latest(self._sub(), f"{PREFIX}/{device}/status")

    def deployment(self, device: str) -> dict[str, Any]:
        return _latest(self._sub(), f"{PREFIX}/{device}/deployments/{MODEL}")

    def deployments(self, device: str) -> list[dict[str, Any]]:
        topic = f"{PREFIX}/{device}/deployments/{MODEL}"
        return [json.loads(p) for t, p, _ in self._sub().snapshot() if t == topic and p]

    def online(self, device: str) -> bool:
        return self.status(device).get("state") in ("online", "degraded")

    def wait_online(self, *devices: str) -> None:
        ok = wait_until(lambda: all(self.online(d) for d in devices), 120)
        assert ok, {d: self.status(d) for d in devices} | {"log": self.log(devices[0])}

    def log(self, device: str) -> str:
        agent = self.agents.get(device)
        return agent.text()[-3000:] if agent is not None else "(stopped)"

    def broker_of(self) -> Bus:
        return Bus(host="127.0.0.1", port=self.broker.port, prefix=PREFIX)

    def _sub(self) -> Subscriber:
        assert self.sub is not None
        return self.sub


def _latest(sub: Subscriber, topic: str) -> dict[str, Any]:
    for t, p, _ in reversed(sub.snapshot()):
        if t == topic:
            return json.loads(p) if p else {}
    return {}


@pytest.fixture(scope="module")
def fleet(deploy_kit: DeployKit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:  # noqa: F811
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    tmp = tmp_path_factory.mktemp("fleet")
    broker = Broker(tmp)
    broker.start()
    configs = {}
    for i, device in enumerate(DEVICES):
        folder = tmp / device
        folder.mkdir()
        path = agent_config(folder, broker.port, deploy_kit, cameras=1, fps=2, telemetry_s=5)
        cfg = yaml.safe_load(path.read_text())
        cfg["device_id"] = device
        cfg["mqtt"]["groups"] = ["north"] if i < 2 else ["south"]
        path.write_text(yaml.safe_dump(cfg))
        configs[device] = path
    f = Fleet(broker, deploy_kit, configs, tmp)
    f.sub = Subscriber(broker.port, f"{PREFIX}/#")
    try:
        for device in DEVICES:
            f.start(device)
        f.wait_online(*DEVICES)
        yield f
    finally:
        for agent in f.agents.values():
            agent.kill()
        with contextlib.suppress(Exception):
            f.sub.close()
        broker.kill()


def _doc(fleet: Fleet, name: str, version: str, **kw: Any) -> bytes:
    path = fleet.tmp / name
    path.write_text(json.dumps(fleet.kit.make_document(version, **kw)))
    return path.read_bytes()


def _doc_file(fleet: Fleet, version: str, **kw: Any) -> Path:
    _doc(fleet, f"{version}.json", version, **kw)
    return fleet.tmp / f"{version}.json"


def _cli(fleet: Fleet, *args: str) -> list[str]:
    return [*args, "--mqtt-host", "127.0.0.1", "--mqtt-port", str(fleet.broker.port)]


def _serving(fleet: Fleet, device: str, version: str) -> bool:
    st = fleet.deployment(device)
    return st.get("stage") == "serving" and st.get("version") == version


# ---- 1 ----------------------------------------------------------------------------------------------------
def test_canary_then_batches_every_device_serves(fleet: Fleet) -> None:
    changes: list[tuple[str, str]] = []
    final = run_rollout(
        _doc(fleet, "v2.json", "v2"),
        fleet.broker_of(),
        targets=Targets(all=True),
        options=RolloutOptions(canary=1, batch=parse_batch("2"), soak_s=2.0, device_timeout_s=WAIT),
        on_change=lambda r, rec: changes.append((rec.device, rec.stage)) if rec is not None else None,
    )
    assert final.status == "done", final.fields()
    assert final.waves == [["ra"], ["rb", "rc"], ["rd"]]
    assert all(rec.stage == "done" and rec.promoted for rec in final.devices.values()), final.fields()
    assert all(_serving(fleet, d, "v2") for d in DEVICES)
    # The batch started only once the canary had soaked: rb was sent after ra was done.
    assert changes.index(("ra", "done")) < changes.index(("rb", "deploying"))
    # The retained state, read back as another machine would (and through the CLI).
    back = read_rollouts(fleet.broker_of(), final.id)[final.id]
    assert isinstance(back, Rollout) and back.status == "done" and back.fields() == final.fields()
    listed = run_cli("fleet", "rollouts", *_cli(fleet))
    assert listed.returncode == 0 and final.id in listed.stdout and "done" in listed.stdout, listed.stderr
    one = run_cli("fleet", "rollouts", final.id, "--json", *_cli(fleet))
    assert one.returncode == 0 and json.loads(one.stdout)["devices"]["rd"]["stage"] == "done"


# ---- 2 ----------------------------------------------------------------------------------------------------
def test_a_broken_version_halts_after_the_canary_and_leaves_the_others_untouched(fleet: Fleet) -> None:
    before = {d: len(fleet.deployments(d)) for d in DEVICES}
    doc = _doc_file(fleet, "v3-broken", onnx="v3.onnx", labels="shuffled.names")
    run = run_cli(
        "fleet",
        "deploy",
        str(doc),
        "--all",
        "--canary",
        "1",
        "--batch",
        "2",
        "--soak",
        "2",
        "--rollback-on-halt",
        "--json",
        *_cli(fleet),
        timeout=WAIT,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    state = json.loads(run.stdout)
    assert state["status"] == "rolled_back" and "more than --max-failures 0" in state["halted_reason"]
    canary = state["devices"]["ra"]
    assert canary["stage"] == "failed" and canary["reason"].startswith("rejected: gate: agreement"), canary
    assert not canary["promoted"]  # rejected at the gate: v2 still serves there, nothing to roll back
    for d in ("rb", "rc", "rd"):
        assert state["devices"][d]["stage"] == "pending" and state["devices"][d]["sent_at"] is None
        later = fleet.deployments(d)[before[d] :]
        assert not [st for st in later if st.get("version") == "v3-broken"], later  # nothing of it there
        assert _serving(fleet, d, "v2")
    assert fleet.deployment("ra").get("stage") == "rejected"
    assert run.stderr.startswith(f"rollout {state['id']}")


# ---- 3 ----------------------------------------------------------------------------------------------------
def test_an_offline_device_fails_after_the_timeout_and_the_halt_rolls_back_the_canary(fleet: Fleet) -> None:
    fleet.stop("rb")
    assert wait_until(lambda: fleet.status("rb").get("state") == "offline", 30)
    try:
        seen: dict[tuple[str, str], float] = {}
        final = run_rollout(
            _doc(fleet, "v3.json", "v3", onnx="v3.onnx"),
            fleet.broker_of(),
            targets=Targets(group="north"),
            options=RolloutOptions(
                canary=1,
                batch=parse_batch("1"),
                soak_s=1.0,
                rollback_on_halt=True,
                offline_timeout_s=4.0,
                device_timeout_s=WAIT,
            ),
            on_change=lambda r, rec: seen.setdefault((rec.device, rec.stage), time.time()) if rec else None,
        )
        assert final.targets == ["ra", "rb"]
        rb = final.devices["rb"]
        assert rb.stage == "failed" and rb.reason is not None and "offline for" in rb.reason, final.fields()
        ra = final.devices["ra"]
        assert seen[("rb", "failed")] - seen[("ra", "done")] >= 4.0  # its wave began when the canary was done
        assert ra.promoted and ra.previous == "v2" and ra.stage == "rolled_back", final.fields()
        assert final.status == "rolled_back"
        st = fleet.deployment("ra")
        assert st.get("stage") == "rolled_back" and st.get("version") == "v2", st  # v2 serves again
        assert all(_serving(fleet, d, "v2") for d in ("rc", "rd"))  # not targets: untouched
    finally:
        fleet.start("rb")
        fleet.wait_online("rb")


# ---- 4 ----------------------------------------------------------------------------------------------------
def test_skip_offline_skips_the_device_and_the_rollout_is_done(fleet: Fleet) -> None:
    fleet.stop("rd")
    assert wait_until(lambda: fleet.status("rd").get("state") == "offline", 30)
    try:
        doc = _doc_file(fleet, "v3b", onnx="v3.onnx")
        run = run_cli(
            "fleet",
            "deploy",
            str(doc),
            "--devices",
            "rc,rd",
            "--canary",
            "0",
            "--batch",
            "100%",
            "--soak",
            "1",
            "--skip-offline",
            *_cli(fleet),
            timeout=WAIT,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert lines[0].startswith("rollout r-")
        assert any("rd: skipped" in line for line in lines), run.stdout
        assert any(line.startswith("1     rc      done") for line in lines), run.stdout
        assert _serving(fleet, "rc", "v3b")
    finally:
        fleet.start("rd")
        fleet.wait_online("rd")


# ---- 5 ----------------------------------------------------------------------------------------------------
def _retained(fleet: Fleet, rid: str) -> dict[str, Any]:
    return _latest(fleet._sub(), f"{PREFIX}/_fleet/rollouts/{rid}")


def test_the_cli_killed_mid_rollout_resumes_without_deploying_twice(fleet: Fleet) -> None:
    doc = _doc_file(fleet, "v4", onnx="v2.onnx")
    cmd = [
        sys.executable,
        "-m",
        "agent.cli",
        "fleet",
        "deploy",
        str(doc),
        "--devices",
        "ra,rb,rc",
        "--canary",
        "1",
        "--batch",
        "2",
        "--soak",
        "2",
        *_cli(fleet),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[0] == "rollout", first
        rid = first[1]
        # Killed once the second wave is under way (the canary soaked, rb and rc sent).
        ok = wait_until(
            lambda: (
                _retained(fleet, rid).get("wave") == 1
                and all(_retained(fleet, rid)["devices"][d]["stage"] == "deploying" for d in ("rb", "rc"))
            ),
            WAIT,
        )
        assert ok, _retained(fleet, rid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    killed = Rollout.from_payload(json.dumps(_retained(fleet, rid)).encode())
    assert killed.status == "running" and killed.devices["ra"].stage == "done"

    run = run_cli("fleet", "deploy", str(doc), "--resume", rid, *_cli(fleet), timeout=WAIT)
    assert run.returncode == 0, run.stdout + run.stderr
    final = _retained(fleet, rid)
    assert final["status"] == "done" and all(
        final["devices"][d]["stage"] == "done" for d in ("ra", "rb", "rc")
    )
    for d in ("ra", "rb", "rc"):
        accepted = [
            s for s in fleet.deployments(d) if s.get("version") == "v4" and s.get("stage") == "accepted"
        ]
        assert len(accepted) == 1, (d, fleet.deployments(d)[-6:])  # sent once: the resume waited for it
        assert _serving(fleet, d, "v4")
    # Options with --resume are refused: the rollout keeps its own.
    bad = run_cli("fleet", "deploy", str(doc), "--resume", rid, "--canary", "2", *_cli(fleet))
    assert bad.returncode == 2 and "--resume" in bad.stderr
