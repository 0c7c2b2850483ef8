"""A real agent waiting for another device's build (issue 38 item 2, its loose end): the wait ends when the
model is reloaded away, when a reload replaces the engines section, and when the agent stops - it never holds
the model's build lock for `engines.claim_wait_s` (30 minutes by default) after that.

Another device's build claim on the agent's key is retained on mosquitto before the agent starts (the other
device never pushes), the registry (CNCF Distribution) is empty: the agent misses, loses the claim and waits.

- a SIGHUP that changes `engines.claim_wait_s`: the wait goes on under the new section ("up to 1700 s");
- a SIGHUP that changes the model: its job ends cancelled (nothing adopted, no plan stored) and the model's
  new job takes the build lock and waits in turn (before the fix it blocked on the lock the old wait held);
- SIGTERM while it waits: the agent stops within its normal stop time, exit code 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fixtures_agent import AgentProcess, wait_until
from fixtures_mqtt import Broker, Subscriber, retain
from fixtures_registry import DockerRegistry
from test_engine_cache_agent import config, make_keys, states, tags

from agent.config import load_config
from agent.fleet.claim_record import Claim, claim_topic
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget, engine_target
from engines.build.compat import build_spec

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow

START_S = 90  # an agent's start on 2 shared cores (TensorRT-RTX import, the first pull) with margin
STOP_S = 20  # the agent's stop (tests/test_agent_e2e.py gives it 8 s unloaded)


def key_of(path: Path) -> str:
    """The key the agent of `path` will look for: its model's fp32 engine on this machine's TensorRT-RTX."""
    cfg = load_config(path)
    ctx = ModelContext.from_config(cfg, "detector")
    target = engine_target(ctx)
    assert isinstance(target, EngineTarget), target
    return build_spec(ctx.build_settings("fp32"), target.fingerprint).key


def edit(path: Path, change: Callable[[dict], None]) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


def said(agent: AgentProcess, text: str) -> int:
    return agent.text().count(text)


def test_a_wait_for_another_devices_build_ends_with_a_reload_and_at_stop(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "waiter", "other")
    path = config(tmp_path, "waiter", mqtt_broker, registry.url("site/engines"), keys)
    edit(path, lambda d: d["engines"].update(claim_wait_s=1800, claim_ttl_s=3600))
    key = key_of(path)
    now = time.time()
    other = Claim("other", key, now - 5, now + 3600)  # claimed first: it wins, and never pushes
    retain(mqtt_broker.port, [(claim_topic("edge-agent", key, "other"), other.payload())])
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    agent = start_agent(path)

    waiting = f"other builds {key}; waiting up to"
    assert wait_until(lambda: said(agent, f"{waiting} 1800 s") == 1, START_S), agent.text()[-3000:]

    # The engines section replaced: the wait goes on under the new one (its own wait time).
    edit(path, lambda d: d["engines"].update(claim_wait_s=1700))
    agent.proc.send_signal(1)  # SIGHUP
    assert wait_until(lambda: said(agent, f"{waiting} 1700 s") == 1, 30), agent.text()[-3000:]
    assert "the engines section was replaced by a reload" in agent.text()

    # The model changed: its waiting job ends cancelled; the new lifecycle's job takes the lock and waits.
    edit(path, lambda d: d["models"]["detector"]["threads"].update(intra=2))
    agent.proc.send_signal(1)
    assert wait_until(lambda: said(agent, f"{waiting} 1700 s") == 2, 30), agent.text()[-3000:]
    assert "cancelled (the model was reloaded away)" in agent.text()
    assert "building here" not in agent.text() and "built engine" not in agent.text()
    assert not [s for s in states(sub.snapshot(), "waiter") if s.get("plan_sha256")]  # nothing adopted
    assert not list((tmp_path / "waiter" / "engines").rglob("*.plan"))
    assert tags(registry) == []

    # SIGTERM while it waits: the agent stops as it always does.
    rc, _took = agent.terminate(STOP_S)
    assert rc == 0, agent.text()[-3000:]
