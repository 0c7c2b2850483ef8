"""The engine cache under a sharded agent (pipeline.shards 2; issue 38): the supervisor pulls the engine once,
each shard finds the plan in the store the supervisor shares and serves it; where the engine came from is
what the supervisor's job said (`cache`) in the model's engine state - for the device and for every shard -
and in `fleet status`, not `store` (what a shard alone could tell: it found the plan there).

mosquitto, CNCF Distribution (`docker-registry`), a real sharded agent on TensorRT-RTX (no GPU here: the
engine is kept and ONNX Runtime serves in each shard, `fallback`); the artifact is another device's, signed
by it, made for this machine's key (tests/test_engine_cache_agent_origin.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, run_cli, wait
from fixtures_mqtt import Broker, Subscriber
from fixtures_registry import DockerRegistry
from test_engine_cache_agent import CLIP, config, make_keys, states
from test_engine_cache_agent_origin import push_as_other

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow

START_S = 120  # a supervisor and two shard processes on 2 shared cores, with margin


def sharded(path: Path) -> Path:
    data = yaml.safe_load(path.read_text())
    data["pipeline"] = {"shards": 2}
    data["cameras"] = {c: {"url": str(CLIP), "model": "detector", "fps": 2} for c in ("c0", "c1")}
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_shard_says_the_origin_the_supervisors_job_said(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "sharded", "other")
    url = registry.url("site/engines")
    path = sharded(config(tmp_path, "sharded", mqtt_broker, url, keys))
    sha = push_as_other(tmp_path, path, url, keys["other"][0])
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    agent = start_agent(path)

    def served(m: list[Any]) -> list[dict[str, Any]]:
        """States where the supervisor kept the pulled engine and both shards serve its key."""
        return [
            s
            for s in states(m, "sharded")
            if s.get("plan_sha256") == sha
            and len(s.get("shards") or {}) == 2
            and all(v.get("key") == s["key"] for v in s["shards"].values())
        ]

    state = served(wait(sub, lambda m: bool(served(m)), START_S, agent, "both shards on the pulled plan"))[0]
    assert state["origin"] == "cache", state
    assert {k: v.get("origin") for k, v in state["shards"].items()} == {"0": "cache", "1": "cache"}, state

    broker = ("--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port))
    proc = run_cli("fleet", "status", *broker, "--json")
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["device"] == "sharded")
    assert row["origins"] == {"detector": "cache"}, row
    table = run_cli("fleet", "status", *broker)
    assert "detector:fallback (cache)" in table.stdout, table.stdout
