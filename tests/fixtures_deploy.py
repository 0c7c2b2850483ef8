"""Deployments against the real agent (issue 37): an artifact store (nginx), signing keys, the agent's config
with a `deploy:` section, documents, and the MQTT side (cmd/deploy, cmd/rollback, `deployments/{model}`).

    kit = deploy_kit                      # fixture (module): nginx serving kit.www, keys "ops", artifacts
    cfg = agent_config(tmp_path, mqtt_broker.port, kit)       # -> agent.yaml (2 file cameras on "detector")
    agent = start_agent(cfg)                                  # tests/fixtures_agent.py
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    answer = deploy(sub, kit.make_document("v2"))             # publishes cmd/deploy, waits for the result
    state = wait_stage(sub, "detector", "serving", agent=agent)

Artifacts in kit.www (served over plain HTTP, `deploy.allow_http: true`, and HTTPS with kit.pki's CA as
`deploy.ca_file`): `nanodet.onnx` (the bundled NanoDet as it is), `v2.onnx`, `v3.onnx` (weights x (1 +
N(0, 1 %)): retrained stand-ins that pass the gate), `coco.names`, `shuffled.names` (labels permuted: fails
the gate). `kit.add(name, maker)` adds another (maker(path) writes it: tools/deploy_gate_agreement.py has
`slow`, `wrong_normalisation`, ...). Every test of a module shares the store; each agent has its own state.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model
from fixtures_http import NGINX, Nginx, Pki, make_pki, running_nginx
from fixtures_mqtt import Subscriber

from agent.deploy.signing import generate_keys, sign_document

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
CLIP = ASSETS / "bikes.mp4"
sys.path.insert(0, str(REPO / "tools"))
import deploy_gate_agreement as variants  # noqa: E402

DEVICE = "deploy-test"
BASE = f"edge-agent/{DEVICE}"  # the topics of the agent agent_config() describes
MODEL = "detector"
KEY_ID = "ops"
FINAL = ("serving", "rejected", "rolled_back", "failed")


@dataclass
class DeployKit:
    """The artifact store and the keys of a test module."""

    www: Path
    nginx: Nginx
    pki: Pki
    private_key: Path
    public_key: Path

    def add(self, name: str, maker: Callable[[Path], object]) -> Path:
        """An artifact made by `maker(path)` (once per module)."""
        path = self.www / name
        if not path.exists():
            maker(path)
        return path

    def artifact(self, name: str, tls: bool = False) -> dict[str, Any]:
        """`{url, sha256, size}` of a file of the store (plain HTTP unless `tls`)."""
        data = (self.www / name).read_bytes()
        return {
            "url": self.nginx.url(name, tls=tls),
            "sha256": hashlib.sha256(data).hexdigest(),
            "size": len(data),
        }

    def make_document(
        self,
        version: str,
        onnx: str = "v2.onnx",
        labels: str = "coco.names",
        *,
        model: str = MODEL,
        tls: bool = False,
        sign: bool = True,
        **more: Any,
    ) -> dict[str, Any]:
        """A deployment document for `onnx` + `labels` of the store, url/sha256/size filled, signed by the
        trusted key "ops" (unless `sign` is false). Small gate and shadow runs and no watch unless `more`
        says otherwise (every key of `more` goes into the document as given)."""
        doc: dict[str, Any] = {
            "model": model,
            "version": version,
            "format": "nanodet",
            "artifacts": {"onnx": self.artifact(onnx, tls), "labels": self.artifact(labels, tls)},
            "gate": {"frames": 10},
            "shadow": {"frames": 8, "max_latency_ratio": 10.0},  # the 2-core machine's load, not the model
            "watch_s": 0,
            "request_id": f"deploy-{version}",
            **more,
        }
        return sign_document(doc, self.private_key, KEY_ID) if sign else doc


@pytest.fixture(scope="module")
def deploy_kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeployKit]:
    """nginx serving the artifacts (HTTP and HTTPS with a test CA) and the signing keys, for a module."""
    if NGINX is None:
        pytest.skip("needs nginx (apt-get install nginx-light; .ci/run installs it)")
    www = tmp_path_factory.mktemp("www")
    shutil.copy(variants.NANODET, www / "nanodet.onnx")
    variants.retrained(www / "v2.onnx", 0.01, seed=1)
    variants.retrained(www / "v3.onnx", 0.01, seed=2)
    shutil.copy(variants.LABELS, www / "coco.names")
    variants.shuffled_labels(www / "shuffled.names")
    private, public = generate_keys(tmp_path_factory.mktemp("keys"), KEY_ID)
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    with running_nginx(tmp_path_factory.mktemp("nginx"), www, pki, {}) as nginx:
        yield DeployKit(www, nginx, pki, private, public)


def agent_config(
    tmp_path: Path,
    port: int,
    kit: DeployKit,
    *,
    cameras: int = 2,
    fps: float = 4,
    state_dir: Path | None = None,
    deploy: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    telemetry_s: float = 1.0,
    name: str = "agent.yaml",
) -> Path:
    """The agent's YAML: model "detector" (the bundled NanoDet on ONNX Runtime), `cameras` file cameras
    (cam1, cam2, ...) looping the bundled clip at `fps`, MQTT on the test broker, telemetry every
    `telemetry_s`, and `deploy` enabled (state in tmp_path/deploy-state, key "ops" trusted, http allowed,
    the test CA; `deploy` overrides keys of that section). Same tmp_path, same state: a restarted agent
    finds its versions."""
    section = {
        "enabled": True,
        "trusted_keys": {KEY_ID: str(kit.public_key)},
        "allow_http": True,
        "ca_file": str(kit.pki.ca_cert),
        "state_dir": str(state_dir or tmp_path / "deploy-state"),
        "connect_timeout_s": 5,
        "read_timeout_s": 10,
        **(deploy or {}),
    }
    cfg = {
        "device_id": DEVICE,
        "engine_dir": str(tmp_path / "engines"),
        "models": {MODEL: model or bundled_model()},
        "cameras": {
            f"cam{i + 1}": {"url": str(CLIP), "model": MODEL, "fps": fps} for i in range(cameras)
        },
        "mqtt": {"host": "127.0.0.1", "port": port, "keepalive": 5},
        "telemetry": {"interval_s": telemetry_s},
        "deploy": section,
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---- MQTT ----------------------------------------------------------------------------------------------
def _fail(what: str, timeout: float, agent: AgentProcess | None, seen: str) -> None:
    log = f"\nagent log:\n{agent.text()[-4000:]}" if agent is not None else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}; {seen}{log}")


def command(
    sub: Subscriber,
    action: str,
    body: dict[str, Any] | bytes,
    *,
    timeout: float = 30.0,
    agent: AgentProcess | None = None,
    base: str = BASE,
) -> dict[str, Any]:
    """Publish `{base}/cmd/{action}` and return its `cmd/{action}/result` (matched by request_id when the
    body has one, else the first result after the publish). `sub` must subscribe to `{base}/#`."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    rid = body.get("request_id") if isinstance(body, dict) else None
    result_topic = f"{BASE}/cmd/{action}/result"
    start = len(sub.snapshot())
    sub.publish(f"{base}/cmd/{action}", raw)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for topic, payload, _ in sub.snapshot()[start:]:
            if topic == result_topic:
                answer = json.loads(payload)
                if rid is None or answer.get("request_id") == rid:
                    return answer
        time.sleep(0.05)
    _fail(f"{result_topic} (request_id {rid!r})", timeout, agent, "no answer")
    raise AssertionError  # not reached


def deploy(
    sub: Subscriber, doc: dict[str, Any] | bytes, *, timeout: float = 30.0, agent: AgentProcess | None = None
) -> dict[str, Any]:
    """Publish `cmd/deploy` with `doc` and return its result: {ok, stage, model, version, request_id,
    reason} or {ok: false, error/reason, field}."""
    return command(sub, "deploy", doc, timeout=timeout, agent=agent)


def rollback(
    sub: Subscriber, model: str = MODEL, to: str | None = None, *, request_id: str = "rb",
    agent: AgentProcess | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "request_id": request_id}
    if to is not None:
        body["to"] = to
    return command(sub, "rollback", body, agent=agent)


def states(sub: Subscriber, model: str = MODEL) -> list[dict[str, Any]]:
    """Every `deployments/{model}` message seen so far, decoded (an empty one, a cleared topic: {})."""
    topic = f"{BASE}/deployments/{model}"
    return [json.loads(p) if p else {} for t, p, _ in sub.snapshot() if t == topic]


def wait_stage(
    sub: Subscriber,
    model: str,
    stage: str | tuple[str, ...],
    *,
    version: str | None = None,
    timeout: float = 240.0,
    agent: AgentProcess | None = None,
    after: int = 0,
) -> dict[str, Any]:
    """The first `deployments/{model}` state (from the `after`-th on) in `stage` (and of `version` when
    given). With `version`, another final stage of that version fails at once, with the state's reason."""
    wanted = (stage,) if isinstance(stage, str) else stage
    deadline = time.monotonic() + timeout
    while True:
        for st in states(sub, model)[after:]:
            if version is not None and st.get("version") != version:
                continue
            if st.get("stage") in wanted:
                return st
            if st.get("stage") in FINAL and version is not None:
                pytest.fail(f"deployment {model} {version} ended {st.get('stage')}: {st.get('reason')}")
        if time.monotonic() > deadline:
            seen = [(s.get("stage"), s.get("version")) for s in states(sub, model)]
            _fail(f"deployments/{model} {wanted} {version or ''}", timeout, agent, f"states seen: {seen}")
        time.sleep(0.1)


def telemetry(sub: Subscriber) -> list[dict[str, Any]]:
    """Every telemetry payload seen so far, decoded."""
    return [json.loads(p) for t, p, _ in sub.snapshot() if t == f"{BASE}/telemetry"]


def frame_counts(sub: Subscriber) -> list[tuple[float, int, int]]:
    """(telemetry ts, frames read, frames processed) of all cameras together, per telemetry message so far:
    the cameras' cumulative `frames_in` / `frames_out` counters (agent.runtime.reports)."""
    out = []
    for t in telemetry(sub):
        cams = (t.get("cameras") or {}).values()
        read = sum(int(c.get("frames_in") or 0) for c in cams)
        out.append((float(t.get("ts") or 0), read, sum(int(c.get("frames_out") or 0) for c in cams)))
    return out
