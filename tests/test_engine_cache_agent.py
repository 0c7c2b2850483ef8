"""The shared engine cache with real agents (issue 38 items 1 and 4): mosquitto, CNCF Distribution
(`docker-registry`), agents of one device kind building real TensorRT-RTX plans on this CPU (same key on every
agent of the machine; no GPU: a plan, built or pulled, cannot run here, so the state is `fallback` and ONNX
Runtime serves - the same path for both).

- A builds (its claim won), its gate needs none (fp32), it pushes; B, with an empty store, pulls the same
  plan instead of building (`origin: cache`, no build in its log); C finds the artifact tampered with in the
  registry: it builds here and pushes nothing over it. Telemetry and Prometheus count it all.
- the registry down at start: both build here, each says so once, nothing counted as pushed;
- `engines.push: false`: built, nothing pushed.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_mqtt import Broker, Message, Subscriber, free_port
from fixtures_registry import DockerRegistry

from agent.deploy.signing import generate_keys
from engines.cache import artifact

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLIP = REPO / "agent" / "assets" / "bikes.mp4"
BUILD_S = 240  # an RTX build of the bundled NanoDet on 2 shared cores, with margin


def config(
    tmp_path: Path,
    device: str,
    broker: Broker,
    cache: str,
    keys: dict[str, tuple[Path, Path]],
    *,
    push: bool = True,
    prometheus: int | None = None,
) -> Path:
    """Agent `device`: the bundled NanoDet on TensorRT-RTX fp32 (no gate), one file camera at 2 fps, its own
    engine store, the cache at `cache` signed with its own key (when pushing), every key of `keys` trusted."""
    engines: dict[str, Any] = {
        "cache": cache,
        "push": push,
        "trusted_keys": {k: str(pub) for k, (_, pub) in keys.items()},
        "timeout_s": 5,
        "claim_ttl_s": 60,
        "claim_wait_s": 300,
    }
    if push:
        engines.update(signing_key=str(keys[device][0]), signing_key_id=device)
    cfg = {
        "device_id": device,
        "engine_dir": str(tmp_path / device / "engines"),
        "models": {"detector": bundled_model(backend="tensorrt_rtx")},
        "cameras": {"cam": {"url": str(CLIP), "model": "detector", "fps": 2}},
        "mqtt": {"host": "127.0.0.1", "port": broker.port, "keepalive": 5},
        "telemetry": {"interval_s": 1, **({"prometheus_port": prometheus} if prometheus else {})},
        "engines": engines,
    }
    path = tmp_path / f"{device}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def make_keys(tmp_path: Path, *devices: str) -> dict[str, tuple[Path, Path]]:
    return {d: generate_keys(tmp_path / "keys", d) for d in devices}


def states(msgs: list[Message], device: str) -> list[dict[str, Any]]:
    return decoded([m for m in msgs if m[0].startswith(f"edge-agent/{device}/")], "/engines/detector")


def counters(msgs: list[Message], device: str) -> dict[str, Any]:
    """The engine_cache section of `device`'s latest telemetry."""
    tele = decoded([m for m in msgs if m[0] == f"edge-agent/{device}/telemetry"], "/telemetry")
    return tele[-1]["engine_cache"] if tele else {}


def engine_kept(sub: Subscriber, device: str, agent: AgentProcess, what: str) -> dict[str, Any]:
    """The first engine state of `device` with a plan (built or pulled; `fallback`: it cannot run here)."""

    def kept(m: list[Message]) -> list[dict[str, Any]]:
        return [s for s in states(m, device) if s.get("plan_sha256") and s["state"] == "fallback"]

    return kept(wait(sub, lambda m: bool(kept(m)), BUILD_S, agent, what))[0]


def settled(
    sub: Subscriber, device: str, agent: AgentProcess, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """`device`'s engine cache counters once `done` holds for them (telemetry every second)."""
    msgs = wait(sub, lambda m: done(counters(m, device)), 20, agent, f"{device}'s engine cache counters")
    return counters(msgs, device)


def tags(reg: DockerRegistry) -> list[str]:
    r = requests.get(f"http://127.0.0.1:{reg.port}/v2/site/engines/tags/list", timeout=5)
    return [] if r.status_code == 404 else sorted(r.json().get("tags") or [])


def oci_manifest(reg: DockerRegistry, key: str) -> tuple[str, dict[str, Any]]:
    r = requests.get(
        f"http://127.0.0.1:{reg.port}/v2/site/engines/manifests/{key}",
        headers={"Accept": artifact.OCI_MANIFEST},
        timeout=5,
    )
    r.raise_for_status()
    return r.headers["Docker-Content-Digest"], r.json()


def tamper_plan(reg: DockerRegistry, key: str) -> None:
    """Flip bytes in the middle of the plan's blob in the registry's storage (same size; the registry serves
    it as it is: only the puller's checks can tell)."""
    _, body = oci_manifest(reg, key)
    plan = next(layer for layer in body["layers"] if layer["mediaType"] == artifact.PLAN)
    blob = reg.blob_file(plan["digest"])
    data = bytearray(blob.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    blob.write_bytes(bytes(data))


def metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def test_one_builds_and_pushes_the_next_pulls_a_tampered_artifact_is_built_here(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "cache-a", "cache-b", "cache-c")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    url = registry.url("site/engines")

    # A: a miss, its claim, the build, the push (a gate-less fp32 engine is pushable).
    a = start_agent(config(tmp_path, "cache-a", mqtt_broker, url, keys))
    built = engine_kept(sub, "cache-a", a, "A's engine built")
    assert built["origin"] == "built" and built["loaded"] is False and "no CUDA GPU" in built["load_error"]
    key = built["key"]
    got = settled(sub, "cache-a", a, lambda c: c.get("pushes") == 1)
    assert got["misses"] == 1 and got["hits"] == 0 and got["builds"] == 1 and got["build_s"] > 0
    assert got["pushed_bytes"] > 1_000_000 and got["rejected"] == got["unavailable"] == 0
    assert tags(registry) == [key]
    digest, _ = oci_manifest(registry, key)
    assert f"engine {key} pushed to the engine cache" in a.text()
    claims = [m for m in sub.snapshot() if m[0].startswith(f"edge-agent/_fleet/builds/{key}/")]
    assert claims and claims[-1][:2] == (f"edge-agent/_fleet/builds/{key}/cache-a", b"")  # released

    # B: the same key pulls instead of building: the same plan, state as a built one (fallback: no GPU).
    prom = free_port()
    b = start_agent(config(tmp_path, "cache-b", mqtt_broker, url, keys, prometheus=prom))
    pulled = engine_kept(sub, "cache-b", b, "B's engine pulled")
    assert pulled["origin"] == "cache" and pulled["key"] == key
    assert pulled["plan_sha256"] == built["plan_sha256"] and pulled["loaded"] is False
    assert (pulled["backend"], pulled["precision"]) == ("onnxruntime", "fp32")
    assert "pulled from the engine cache" in b.text() and "built engine" not in b.text(), b.text()[-3000:]
    got = settled(sub, "cache-b", b, lambda c: c.get("hits") == 1)
    assert got["pulled_bytes"] > 1_000_000 and got["pull_s"] > 0
    assert got["builds"] == got["pushes"] == got["misses"] == got["rejected"] == 0
    assert metric(prom, "edge_agent_engine_cache_hits_total") == 1.0
    assert (metric(prom, "edge_agent_engine_cache_pulled_bytes_total") or 0) > 1_000_000
    plan = tmp_path / "cache-b" / "engines" / "detector" / f"{key}-{pulled['plan_sha256'][:12]}.plan"
    assert plan.stat().st_size > 1_000_000
    b.terminate(30)

    # C: the plan's blob tampered with in the registry: refused, built here, never pushed over.
    tamper_plan(registry, key)
    c = start_agent(config(tmp_path, "cache-c", mqtt_broker, url, keys))
    own = engine_kept(sub, "cache-c", c, "C's own engine")
    assert own["origin"] == "built" and own["key"] == key
    got = settled(sub, "cache-c", c, lambda c: c.get("builds") == 1)
    assert got["rejected"] == 1 and got["hits"] == got["pushes"] == 0
    assert "holds a plan that must not be loaded" in c.text() and "sha256" in c.text()
    assert oci_manifest(registry, key)[0] == digest and tags(registry) == [key]  # not pushed over
    assert a.proc.poll() is None and c.proc.poll() is None


def test_registry_down_at_start_both_build_here_and_say_so_once(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "down-a", "down-b")
    url = registry.url("site/engines")
    registry.stop()
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    agents = {d: start_agent(config(tmp_path, d, mqtt_broker, url, keys)) for d in keys}
    for device, agent in agents.items():
        built = engine_kept(sub, device, agent, f"{device}'s engine built")
        assert built["origin"] == "built"
        got = settled(sub, device, agent, lambda c: c.get("builds") == 1)
        assert got["unavailable"] == 1 and got["pushes"] == got["hits"] == 0
        said = [line for line in agent.text().splitlines() if "engine cache is unavailable" in line]
        assert len(said) == 1, said
        assert str(registry.port) in said[0] and "building here" in said[0]
    registry.start()
    assert tags(registry) == []


def test_push_false_builds_and_pushes_nothing(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = make_keys(tmp_path, "quiet")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    url = registry.url("site/engines")
    agent = start_agent(config(tmp_path, "quiet", mqtt_broker, url, keys, push=False))
    built = engine_kept(sub, "quiet", agent, "the engine built")
    assert built["origin"] == "built"
    got = settled(sub, "quiet", agent, lambda c: c.get("builds") == 1)
    assert got["misses"] == 1 and got["pushes"] == got["pushed_bytes"] == 0
    assert tags(registry) == [] and "pushed to the engine cache" not in agent.text()
    assert "build claim" not in agent.text()  # nothing to wait for: it claims nothing
    assert "engine cache oci://" in agent.text() and "(push off)" in agent.text()
    assert json.dumps(got)  # the section is plain JSON


def test_two_agents_starting_together_build_once_and_the_other_pulls(
    tmp_path: Path,
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    """Both miss the empty cache at once: the build claim makes one of them build and push; the other waits
    for that push and pulls it (one build for the key, not two)."""
    keys = make_keys(tmp_path, "race-a", "race-b")
    url = registry.url("site/engines")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    agents = {d: start_agent(config(tmp_path, d, mqtt_broker, url, keys)) for d in keys}
    kept = {d: engine_kept(sub, d, agent, f"{d}'s engine") for d, agent in agents.items()}
    assert sorted(k["origin"] for k in kept.values()) == ["built", "cache"], kept
    builder = next(d for d, k in kept.items() if k["origin"] == "built")
    waiter = next(d for d in kept if d != builder)
    assert kept[waiter]["plan_sha256"] == kept[builder]["plan_sha256"]
    assert f"{builder} builds {kept[builder]['key']}; waiting" in agents[waiter].text()
    assert "built engine" not in agents[waiter].text()
    assert settled(sub, waiter, agents[waiter], lambda c: c.get("hits") == 1)["builds"] == 0
    assert settled(sub, builder, agents[builder], lambda c: c.get("pushes") == 1)["builds"] == 1
    assert tags(registry) == [kept[builder]["key"]]
