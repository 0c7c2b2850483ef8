"""The agent as a subprocess, and waiting for what it publishes (pytest plugin, loaded by conftest)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures_mqtt import Message, Subscriber

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"


def bundled_model(**overrides: object) -> dict:
    """A `models.M` config section: the bundled NanoDet on ONNX Runtime (CPU, one intra-op thread)."""
    return {
        "onnx": str(ASSETS / "nanodet-m-416.onnx"),
        "format": "nanodet",
        "labels": str(ASSETS / "coco.names"),
        "backend": "onnxruntime",
        "precision": "fp32",
        "threads": {"intra": 1},
        **overrides,
    }


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll `cond` every 10 ms until it holds or `timeout` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class AgentProcess:
    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = log.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "-c", str(config), "--log-level", "info"],
            cwd=REPO,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def text(self) -> str:
        return self.log.read_text()

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log_file.close()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def start(config: Path, env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(config, tmp_path / f"agent-{len(agents)}.log", env)
        agents.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in agents:
            agent.kill()


def decoded(msgs: list[Message], suffix: str) -> list[dict]:
    return [json.loads(payload) for topic, payload, _ in msgs if topic.endswith(suffix)]


def wait(
    sub: Subscriber,
    predicate: Callable[[list[Message]], bool],
    timeout: float,
    agent: AgentProcess,
    what: str,
) -> list[Message]:
    """Like Subscriber.wait_for; a failure shows what was awaited and the agent's log, not every message."""
    deadline = time.monotonic() + timeout
    while True:
        msgs = sub.snapshot()
        if predicate(msgs):
            return msgs
        if time.monotonic() > deadline:
            topics = sorted({t for t, _, _ in msgs})
            pytest.fail(
                f"timed out after {timeout} s waiting for {what}; topics seen: {topics}\n"
                f"agent log:\n{agent.text()[-4000:]}"
            )
        time.sleep(0.1)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`edge-agent ARGS` in a subprocess from the repository, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
