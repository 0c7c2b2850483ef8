"""Helpers of tests/faults/test_fleet_faults.py: a fleet of real agents on one mosquitto, the artifact store
(nginx) and signed documents of the fleet-rollout bench (agent/bench/fleet_rollout.py: its agent configs
and documents are reused here, optionally on TensorRT-RTX with an engine cache), `fleet deploy` as the
operator runs it, and the engine cache's rig: agents of one device kind on one registry.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from fixtures_agent import AgentProcess
from fixtures_mqtt import Message, Subscriber
from fixtures_registry import DockerRegistry, running_registry

from agent.bench.args import BenchOptions
from agent.bench.deploy_rig import Service, mosquitto, nginx
from agent.bench.fleet_rollout import PREFIX, agent_config, document

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fleet:
    """Agents site-01 ... on `broker`, documents served by `store` from work/www, one subscriber of all."""

    work: Path
    broker: Service
    store: Service
    key: Path
    configs: list[Path]
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    sub: Subscriber | None = None

    @property
    def devices(self) -> list[str]:
        return [c.stem for c in self.configs]

    def start(self, device: str) -> AgentProcess:
        n = sum(1 for _ in self.work.glob(f"{device}-*.log"))
        agent = AgentProcess(self.work / f"{device}.yaml", self.work / f"{device}-{n}.log")
        self.agents[device] = agent
        return agent

    def document(self, version: str, broken: bool = False) -> Path:
        return document(self.work / "www", self.store.port, version, BenchOptions(), self.key, broken)

    def messages(self) -> list[Message]:
        assert self.sub is not None
        return self.sub.snapshot()

    def logs(self) -> str:
        return "\n".join(f"--- {d}\n{a.text()[-1500:]}" for d, a in self.agents.items())


@contextlib.contextmanager
def running_fleet(work: Path, n: int, cache: str | None = None) -> Iterator[Fleet]:
    """N agents of the fleet-rollout bench (a file camera each, deployments on), all online on return;
    with `cache` (an oci:// URL) on TensorRT-RTX with that engine cache, plans signed with the fleet key."""
    from agent.deploy.signing import generate_keys

    (work / "www").mkdir(parents=True)
    key, pub = generate_keys(work / "keys", "bench")
    broker = mosquitto(work)
    store = nginx(work, work / "www")
    configs = []
    for i in range(1, n + 1):
        path = work / f"site-{i:02d}.yaml"
        cfg = agent_config(work, i, BenchOptions(), broker.port, pub)
        if cache is not None:
            cfg["models"]["detector"]["backend"] = "tensorrt_rtx"
            cfg["engines"] = {"cache": cache, "signing_key": str(key), "signing_key_id": "bench",
                              "trusted_keys": {"bench": str(pub)}, "timeout_s": 5}
        path.write_text(yaml.safe_dump(cfg))
        configs.append(path)
    fleet = Fleet(work, broker, store, key, configs)
    try:
        fleet.sub = Subscriber(broker.port, f"{PREFIX}/#")
        for device in fleet.devices:
            fleet.start(device)
        fleet.sub.wait_for(lambda m: all(online(m, d) for d in fleet.devices), 180)
        yield fleet
    finally:
        for agent in fleet.agents.values():
            agent.kill()
        if fleet.sub is not None:
            fleet.sub.close()
        store.stop()
        broker.stop()


def payloads(msgs: list[Message], topic: str) -> list[Any]:
    out = []
    for t, p, _ in msgs:
        if t == topic and p:
            with contextlib.suppress(ValueError):
                out.append(json.loads(p))
    return out


def online(msgs: list[Message], device: str) -> bool:
    status = payloads(msgs, f"{PREFIX}/{device}/status")
    return bool(status) and status[-1].get("state") == "online"










def fleet_args(fleet: Fleet, doc: Path, *extra: str) -> list[str]:
    """`fleet deploy DOC` to every device of the fleet: canary 1, then batches of `extra`'s or 1."""
    batch = () if "--batch" in extra else ("--batch", "1")
    return [sys.executable, "-m", "agent.cli", "fleet", "deploy", str(doc), "--devices",
            ",".join(fleet.devices), "--canary", "1", *batch, "--max-failures", "0", "--mqtt-host",
            "127.0.0.1", "--mqtt-port", str(fleet.broker.port), "--prefix", PREFIX, "--json", *extra]


def fleet_deploy(fleet: Fleet, doc: Path, *extra: str, timeout: float = 600) -> tuple[int, dict[str, Any]]:
    """Run `fleet deploy ... --json` to its end: the exit code and the final state it printed."""
    p = subprocess.run(fleet_args(fleet, doc, *extra), cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    try:
        return p.returncode, json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"fleet deploy exit {p.returncode}: {p.stdout}\n{p.stderr}") from None


# --- the engine cache: agents of one device kind (TensorRT-RTX, no camera) on one registry -----------------


@dataclass
class CacheRig:
    """mosquitto, docker-registry and the fleet key; agents kind-a-{i} of the fleet-cache bench's config."""

    work: Path
    broker: Service
    registry: DockerRegistry
    keys: tuple[Path, Path]
    sub: Subscriber
    agents: dict[str, AgentProcess] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.registry.url(CACHE_REPO)

    def start(self, i: int, **engines: Any) -> AgentProcess:
        """Agent kind-a-{i}; `engines` overrides keys of its `engines:` section."""
        from agent.bench.fleet_cache import agent_config as cache_config

        cfg = cache_config(self.work, i, BenchOptions(), self.broker.port, self.url, self.keys)
        cfg["engines"].update(engines)
        device = cfg["device_id"]
        path = self.work / f"{device}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        agent = AgentProcess(path, self.work / f"{device}-{len(self.agents)}.log")
        self.agents[device] = agent
        return agent

    def engine_states(self, device: str) -> list[dict[str, Any]]:
        return payloads(self.sub.snapshot(), f"{CACHE_PREFIX}/{device}/engines/detector")

    def served(self, device: str) -> dict[str, Any] | None:
        """The device's first engine state holding a plan (ready, or fallback: no GPU here), or None."""
        return next((s for s in self.engine_states(device) if s.get("state") in ("ready", "fallback")
                     and s.get("plan_sha256")), None)

    def claims(self) -> list[tuple[str, dict[str, Any]]]:
        """(device of the topic, payload) of every non-empty build claim seen, in order."""
        out = []
        for t, p, _ in self.sub.snapshot():
            if t.startswith(f"{CACHE_PREFIX}/_fleet/builds/") and p:
                with contextlib.suppress(ValueError):
                    out.append((t.rsplit("/", 1)[-1], json.loads(p)))
        return out

    def tag_digest(self, key: str) -> str | None:
        """The digest of the manifest under tag `key` in the registry (HEAD), None if there is none."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{self.registry.port}/v2/{CACHE_REPO}/manifests/{key}", method="HEAD",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return str(r.headers.get("Docker-Content-Digest"))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def logs(self) -> str:
        return "\n".join(f"--- {d}\n{a.text()[-2500:]}" for d, a in self.agents.items())


CACHE_REPO = "site/engines"  # tests/engine_cache_fixtures.py's helpers default to it
CACHE_PREFIX = "fleetbench"


@contextlib.contextmanager
def cache_rig(work: Path) -> Iterator[CacheRig]:
    """mosquitto, an empty registry (tests/fixtures_registry.py) and a subscriber of the cache prefix."""
    from agent.deploy.signing import generate_keys

    keys = generate_keys(work / "keys", "fleet")
    broker = mosquitto(work)
    try:
        with running_registry(work / "registry") as reg:
            rig = CacheRig(work, broker, reg, keys, Subscriber(broker.port, f"{CACHE_PREFIX}/#"))
            try:
                yield rig
            finally:
                for agent in rig.agents.values():
                    agent.kill()
                rig.sub.close()
    finally:
        broker.stop()
