"""The README's fleet broker set-ups, run as written: the per-device mosquitto ACL (an agent confined to its
subtree works; one that publishes outside it is refused by the broker and reports it) and the bridged
mosquitto (an agent on a site broker is listed and commanded from the central one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fixtures_agent import REPO, AgentProcess, bundled_model, run_cli, wait
from fixtures_mqtt import Broker, Message, Subscriber

PASSWD = shutil.which("mosquitto_passwd")


def readme_block(after: str) -> str:
    """The first fenced code block after the line containing `after` in the README."""
    text = (REPO / "README.md").read_text()
    i = text.index(after)
    m = re.search(r"```[a-z]*\n(.*?)```", text[i:], re.S)
    assert m is not None, after
    return m.group(1)


def agent_config(tmp_path: Path, port: int, device: str, **mqtt: object) -> Path:
    cfg = {
        "device_id": device,
        "engine_dir": str(tmp_path / f"engines-{device}"),
        "models": {"detector": bundled_model()},
        "cameras": {},
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5, "groups": ["yard"], **mqtt},
        "telemetry": {"interval_s": 1},
    }
    path = tmp_path / f"{device}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def answers(msgs: list[Message], request_id: str) -> list[dict]:
    return [
        json.loads(p)
        for t, p, _ in msgs
        if t.endswith("/result") and p and json.loads(p).get("request_id") == request_id
    ]


@pytest.mark.skipif(PASSWD is None, reason="mosquitto_passwd not installed")
def test_readme_acl_confines_each_agent_and_refusals_are_reported(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    users = {"yard-01": "pw-yard", "yard-02": "pw-yard2", "ops": "pw-ops"}
    pwfile = tmp_path / "passwd"
    pwfile.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    subprocess.run([PASSWD, "-U", str(pwfile)], check=True)
    acl = tmp_path / "acl"
    acl.write_text(readme_block("A per-device mosquitto ACL"))
    broker = Broker(tmp_path, allow_anonymous=False)
    # As root mosquitto becomes user "mosquitto", who cannot read pytest's private folders: stay root.
    root = "user root\n" if os.geteuid() == 0 else ""
    broker.conf.write_text(broker.conf.read_text() + f"password_file {pwfile}\nacl_file {acl}\n{root}")
    broker.start()
    try:
        ops = Subscriber(broker.port, "edge-agent/#", username="ops", password=users["ops"])
        try:
            for u in ("yard-01", "yard-02"):
                (tmp_path / f"{u}.pw").write_text(users[u] + "\n")
            good = start_agent(
                agent_config(
                    tmp_path,
                    broker.port,
                    "yard-01",
                    username="yard-01",
                    password_file=str(tmp_path / "yard-01.pw"),
                    shared_subscriptions=True,  # the README's ACL lets it take "one agent" commands too
                )
            )
            # A copied config: logs in as yard-02 with device_id yard-03, outside what yard-02 may write.
            stray = start_agent(
                agent_config(
                    tmp_path,
                    broker.port,
                    "yard-03",
                    username="yard-02",
                    password_file=str(tmp_path / "yard-02.pw"),
                )
            )
            wait(
                ops,
                lambda m: any(t == "edge-agent/yard-01/status" for t, _, _ in m),
                60,
                good,
                "yard-01 status",
            )
            ops.publish("edge-agent/_all/cmd/reload", json.dumps({"request_id": "acl-all"}))
            ops.publish("edge-agent/_group/yard/cmd/reload", json.dumps({"request_id": "acl-yard"}))
            ops.publish("edge-agent/_any/cmd/reload", json.dumps({"request_id": "acl-any"}))
            ops.publish("edge-agent/_group/yard/any/cmd/reload", json.dumps({"request_id": "acl-yard-any"}))
            wait(
                ops,
                lambda m: all(answers(m, r) for r in ("acl-all", "acl-yard", "acl-any", "acl-yard-any")),
                30,
                good,
                "yard-01's answers",
            )
            wait(
                ops,
                lambda m: "refused the publish to edge-agent/yard-03/status" in stray.text(),
                60,
                stray,
                "report",
            )
            time.sleep(2.0)  # telemetry of both (interval 1 s)
            msgs = ops.snapshot()
            # Nothing of yard-03 got past the broker; yard-01 answered each command once, on its own topic.
            assert not [t for t, _, _ in msgs if t.startswith("edge-agent/yard-03/")]
            assert [a["device"] for a in answers(msgs, "acl-all")] == ["yard-01"]
            for request in ("acl-yard", "acl-any", "acl-yard-any"):
                assert [a["device"] for a in answers(msgs, request)] == ["yard-01"], request
            tele = [json.loads(p) for t, p, _ in msgs if t == "edge-agent/yard-01/telemetry"]
            assert tele and tele[-1]["mqtt"]["refused"] == 0, tele[-1:]
            log = stray.text()
            assert re.search(
                r"refused the publish to edge-agent/yard-03/status: Not authorized \(0x87\)", log
            ), log
            assert log.count("refused the publish to edge-agent/yard-03/status") == 1  # once per topic
            for secret in users.values():
                assert secret not in log and secret not in good.text()
            assert good.proc.poll() is None and stray.proc.poll() is None
        finally:
            ops.close()
    finally:
        broker.stop()


def test_readme_bridge_carries_states_up_and_commands_down(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    central, site = Broker(tmp_path), Broker(tmp_path)  # own ports, so own conf and log files
    bridge = readme_block("**Bridged mosquitto**")
    lines = []
    for line in bridge.splitlines():
        if line.startswith(("bridge_cafile", "remote_username", "remote_password")):
            continue  # the test's central broker is local, anonymous and without TLS
        if line.startswith("address "):
            line = f"address 127.0.0.1:{central.port}"
        lines.append(line)
    site.conf.write_text(site.conf.read_text() + "\n".join(lines) + "\n")
    central.start()
    site.start()
    try:
        ops = Subscriber(central.port, "edge-agent/#")
        try:
            agent = start_agent(agent_config(tmp_path, site.port, "site-a-01"))
            wait(
                ops,
                lambda m: any(t == "edge-agent/site-a-01/engines/detector" for t, _, _ in m),
                60,
                agent,
                "the agent's states at the central broker",
            )
            ops.publish("edge-agent/_all/cmd/reload", json.dumps({"request_id": "bridged"}))
            wait(ops, lambda m: answers(m, "bridged"), 30, agent, "the answer through the bridge")
            proc = run_cli(
                "fleet", "status", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(central.port), "--json"
            )
            assert proc.returncode == 0, proc.stderr
            rows = json.loads(proc.stdout)
            assert [(r["device"], r["state"]) for r in rows] == [("site-a-01", "online")], rows
        finally:
            ops.close()
    finally:
        site.stop()
        central.stop()
