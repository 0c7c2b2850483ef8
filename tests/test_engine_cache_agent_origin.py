"""`origin` of an engine a real agent pulled, after the agent restarts (issue 38; docs/DESIGN.md "The engine
cache in the agent"): the pull says `cache`; the next start finds that engine in its store and says `store`
(found at start: a manifest does not record how it got there) - and pulls nothing again.

mosquitto, CNCF Distribution (`docker-registry`) and a real agent on TensorRT-RTX (no GPU here: the engine is
kept and ONNX Runtime serves, `fallback`); the artifact in the registry is another device's, signed by it,
made for this machine's key (its plan is never run here, so it need not be a real one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fake_tensorrt
import pytest
from engine_fixtures import store_engine
from fixtures_agent import AgentProcess, wait
from fixtures_mqtt import Broker, Subscriber
from fixtures_registry import DockerRegistry
from test_engine_cache_agent import config, make_keys, states
from test_engine_cache_agent_wait import key_of

from agent.config import load_config
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget, engine_target
from engines.cache.client import EngineCache
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner
from engines.store import EngineStore

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow

START_S = 90


def push_as_other(tmp_path: Path, path: Path, url: str, signing_key: Path) -> str:
    """Another device's engine of the agent's key in the registry; its plan's sha256."""
    cfg = load_config(path)
    ctx = ModelContext.from_config(cfg, "detector")
    target = engine_target(ctx)
    assert isinstance(target, EngineTarget), target
    store = EngineStore(tmp_path / "other-engines")
    key = key_of(path)
    m = store_engine(
        store, "detector", ctx.build_settings("fp32"), target.fingerprint,
        plan=fake_tensorrt.PLAN_MAGIC + b"other's plan", key=key,
    )
    assert m.path is not None
    signer = PlanSigner.from_file(signing_key, "other")
    plan = store.plan_path_for("detector", m)
    pushed = EngineCache(parse_cache_url(url)).push(key, plan, m.path, None, signer, "other")
    assert pushed is not None
    return m.build.plan_sha256


def kept(sub: Subscriber, agent: AgentProcess, what: str, after: int = 0) -> dict[str, Any]:
    """The first state with a plan among `device`'s states after the first `after` of them."""

    def found(m: list[Any]) -> list[dict[str, Any]]:
        return [s for s in states(m, "origin-a")[after:] if s.get("plan_sha256") and s["state"] == "fallback"]

    return found(wait(sub, lambda m: bool(found(m)), START_S, agent, what))[0]


def test_an_engine_pulled_earlier_is_origin_store_at_the_next_start(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "origin-a", "other")
    url = registry.url("site/engines")
    path = config(tmp_path, "origin-a", mqtt_broker, url, keys)
    sha = push_as_other(tmp_path, path, url, keys["other"][0])
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")

    first = start_agent(path)
    pulled = kept(sub, first, "the pulled engine")
    assert pulled["origin"] == "cache" and pulled["plan_sha256"] == sha
    assert first.terminate(20)[0] == 0

    seen = len(states(sub.snapshot(), "origin-a"))
    again = start_agent(path)
    found = kept(sub, again, "the engine found at start", after=seen)
    assert found["origin"] == "store" and found["plan_sha256"] == sha and found["key"] == pulled["key"]
    assert "pulled from the engine cache" not in again.text()  # found, not pulled again
