"""The real components of the fleet benches (agent/bench/fleet_cache.py, fleet_rollout.py) beside those of
agent/bench/deploy_rig.py: CNCF Distribution (`docker-registry serve`, plain HTTP on a free port of
127.0.0.1, its access log kept to count the bytes it served), N agents as subprocesses, and one MQTT
listener on the whole prefix that keeps every device's `engines/{model}`, `deployments/{model}` and status
messages with their receive times.

Needs the docker-registry binary (apt: docker-registry) besides mosquitto.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.bench.deploy_rig import Agent, Service, _binary, free_port

# The access log's line (Apache combined): "GET /v2/<repo>/blobs/sha256:<hex> HTTP/1.1" <status> <bytes>.
_ACCESS = re.compile(r'"(GET|HEAD|PUT|PATCH|POST) (/v2/\S+) HTTP/[\d.]+" (\d{3}) (\d+|-)')


def registry(workdir: Path) -> Service:
    """docker-registry (CNCF Distribution) storing under workdir/registry, plain HTTP, no auth."""
    port = free_port()
    data = workdir / "registry"
    data.mkdir(exist_ok=True)
    conf = workdir / "registry.yml"
    conf.write_text(
        "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
        f"storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    return Service("docker-registry", [_binary("docker-registry"), "serve", str(conf)], port,
                   workdir / "registry.log")


def registry_traffic(log: Path, data: Path) -> dict[str, int]:
    """What the registry moved: bytes of blobs it served (GET 200, from its access log) and the bytes of
    the blobs it stores (each pushed once: a tag that exists is never pushed over)."""
    served = requests = manifests_put = 0
    for line in log.read_text(errors="replace").splitlines():
        m = _ACCESS.search(line)
        if m is None:
            continue
        requests += 1
        if m.group(1) == "GET" and "/blobs/" in m.group(2) and m.group(3) == "200" and m.group(4) != "-":
            served += int(m.group(4))
        manifests_put += m.group(1) == "PUT" and "/manifests/" in m.group(2) and m.group(3) == "201"
    stored = sum(p.stat().st_size for p in (data / "docker" / "registry" / "v2" / "blobs").rglob("data"))
    return {"bytes_pulled": served, "bytes_stored": stored, "manifests_pushed": manifests_put,
            "requests": requests}


def start_agents(configs: list[Path], logs: Path) -> list[Agent]:
    """One agent per config (`python -m agent.cli run`), their output in logs/{config stem}.log."""
    logs.mkdir(parents=True, exist_ok=True)
    return [Agent(c, logs / f"{c.stem}.log") for c in configs]


def stop_agents(agents: list[Agent]) -> None:
    for a in agents:
        if a.proc.poll() is None:
            a.proc.terminate()
    for a in agents:
        a.stop()


class FleetListener:
    """Subscribed to `{prefix}/#`: per device the `engines/{model}` and `deployments/{model}` payloads in
    order with their receive time (monotonic), the last status; `_fleet/...` messages as they came."""

    def __init__(self, port: int, prefix: str) -> None:
        import paho.mqtt.client as mqtt

        self.prefix = prefix
        self.engines: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        self.deployments: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        self.status: dict[str, dict[str, Any]] = {}
        self.cache_counters: dict[str, dict[str, Any]] = {}  # the last telemetry's engine_cache section
        self.fleet: list[tuple[float, str, bytes]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-fleet-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"{prefix}/#", qos=1)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        now = time.monotonic()
        parts = msg.topic[len(self.prefix) + 1 :].split("/")
        with self._lock:
            if parts[0] == "_fleet":
                self.fleet.append((now, msg.topic, bytes(msg.payload)))
                return
            if not msg.payload or len(parts) < 2:
                return
            try:
                body = json.loads(msg.payload)
            except ValueError:
                return
            if len(parts) == 3 and parts[1] in ("engines", "deployments") and isinstance(body, dict):
                book = self.engines if parts[1] == "engines" else self.deployments
                book.setdefault(parts[0], []).append((now, body))
            elif len(parts) == 2 and parts[1] == "status" and isinstance(body, dict):
                self.status[parts[0]] = body
            elif parts[1:] == ["telemetry"] and isinstance(body, dict):
                counters = body.get("engine_cache")
                self.cache_counters[parts[0]] = counters if isinstance(counters, dict) else {}

    def engine_states(self, device: str) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return list(self.engines.get(device, []))

    def deployment_states(self, device: str) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return list(self.deployments.get(device, []))

    def counters(self, device: str) -> dict[str, Any]:
        with self._lock:
            return dict(self.cache_counters.get(device) or {})

    def online(self, device: str) -> bool:
        with self._lock:
            return (self.status.get(device) or {}).get("state") == "online"

    def wait(self, cond: Callable[[], bool], timeout: float, what: str, agents: list[Agent]) -> None:
        """Until cond() holds; RuntimeError naming `what` (and the first dead agent's log) after timeout."""
        deadline = time.monotonic() + timeout
        while not cond():
            dead = next((a for a in agents if a.proc.poll() is not None), None)
            if dead is not None or time.monotonic() > deadline:
                why = f"agent {dead.log.stem} exited" if dead else f"timed out after {timeout:g} s"
                tail = (dead or agents[0]).tail() if agents else ""
                raise RuntimeError(f"{why} waiting for {what}\nlog:\n{tail}")
            time.sleep(0.1)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
