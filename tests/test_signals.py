"""Bursts of SIGINT / SIGTERM / SIGHUP at the real agent: each run ends in reloads or in one clean stop.

Before agent.service.signals, the handlers set threading.Events; a handler runs between two bytecodes of
the main thread, possibly while that thread holds the same Event's lock (its wait or set), and then blocks
on it for ever: two quick Ctrl-C hung the agent in about 1 of 20 tries, and SIGTERM was ignored afterwards.
Here every run must exit 0 within 5 s of its last signal with "offline" retained on its status topic. Runs
go four at a time (agents at 2 fps on ONNX Runtime) so that enough of them fit in a minute or two of CI.
"""

from __future__ import annotations

import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from fixtures_agent import ASSETS, AgentProcess, bundled_model
from fixtures_mqtt import Broker

RUNS = 32
AT_ONCE = 4
EXIT_S = 5.0
BURSTS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}


def agent_config(tmp_path: Path, port: int, device: str) -> Path:
    cfg = {
        "device_id": device,
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "detector", "fps": 2}},
        "mqtt": {"host": "127.0.0.1", "port": port},
        "telemetry": {"interval_s": 60},
        "console": False,
    }
    path = tmp_path / f"{device}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def burst(rng: random.Random) -> list[str]:
    """2-12 signals in any order; a third of the runs start with reloads only, then stop."""
    names = [rng.choice(list(BURSTS)) for _ in range(rng.randint(2, 12))]
    if rng.random() < 0.33:
        names = ["SIGHUP"] * rng.randint(1, 4) + names
    return names


def one_run(tmp_path: Path, broker: Broker, seed: int, mqtt_subscribe) -> str | None:
    """None when the run ended as it must, else what went wrong (with the agent's log tail)."""
    rng = random.Random(seed)
    device = f"sig{seed}"
    sub = mqtt_subscribe(broker.port, f"edge-agent/{device}/status")
    agent = AgentProcess(agent_config(tmp_path, broker.port, device), tmp_path / f"{device}.log")
    try:
        deadline = time.monotonic() + 90
        while not any(json.loads(p).get("state") == "online" for _, p, _ in sub.snapshot()):
            if time.monotonic() > deadline or agent.proc.poll() is not None:
                return f"seed {seed}: never online\n{agent.text()[-2000:]}"
            time.sleep(0.05)
        names = burst(rng)
        for name in names:
            agent.proc.send_signal(BURSTS[name])
            time.sleep(rng.choice((0.0, 0.0005, 0.002, 0.01)))
        if not any(n != "SIGHUP" for n in names):
            agent.proc.send_signal(signal.SIGTERM)  # reloads only: the run still has to end
            names.append("SIGTERM")
        try:
            rc = agent.proc.wait(EXIT_S)
        except Exception:
            return f"seed {seed}: still running {EXIT_S} s after {names}\n{agent.text()[-2000:]}"
        last = json.loads(sub.snapshot()[-1][1]) if sub.snapshot() else {}
        if rc != 0:
            return f"seed {seed}: exit {rc} after {names}\n{agent.text()[-2000:]}"
        if last.get("state") != "offline":
            return f"seed {seed}: last status {last.get('state')!r} after {names}"
        if "Traceback" in agent.text():
            return f"seed {seed}: traceback after {names}\n{agent.text()[-2000:]}"
        return None
    finally:
        agent.kill()


@pytest.mark.slow
def test_signal_bursts_end_in_one_clean_stop(tmp_path: Path, mqtt_broker: Broker, mqtt_subscribe) -> None:
    seeds = list(range(RUNS))
    with ThreadPoolExecutor(AT_ONCE) as pool:
        problems = [
            p for p in pool.map(lambda s: one_run(tmp_path, mqtt_broker, s, mqtt_subscribe), seeds) if p
        ]
    assert not problems, f"{len(problems)} of {RUNS} runs did not end cleanly:\n" + "\n\n".join(problems)


def test_inbox_handler_takes_no_lock_and_wakes_the_loop() -> None:
    """The handler only flips flags and writes a byte: callable while any lock is held, and wait() returns
    at once afterwards; any number of SIGHUPs is one reload; SIGTERM wins."""
    import threading

    from agent.service.signals import SignalInbox

    inbox = SignalInbox()
    held = threading.Lock()
    with held:  # a handler interrupting a thread that holds a lock must not need it
        inbox._handle(signal.SIGHUP, None)
        inbox._handle(signal.SIGHUP, None)
    t0 = time.monotonic()
    inbox.wait(5.0)
    assert time.monotonic() - t0 < 1.0
    assert inbox.take_reload() and not inbox.take_reload()
    inbox._handle(signal.SIGTERM, None)
    assert inbox.stop
    for _ in range(100_000):  # a full pipe drops wake-ups instead of blocking the handler
        inbox.poke()
