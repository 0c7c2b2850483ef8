"""The engine cache on the deployment path (issue 38 item 1 with issue 37's deployments): a new version's
engine is built before its gate through the lifecycle's job, so the cache stands in front of that build too.
Two real agents of one device kind (TensorRT-RTX on this CPU), mosquitto, docker-registry, nginx serving the
artifacts: the version deployed to A is built there and pushed; deployed to B, it is pulled, and the engine
B serves after the promotion says so (`origin: cache`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_agent import AgentProcess, bundled_model, decoded, wait
from fixtures_deploy import DeployKit, agent_config, deploy_kit  # noqa: F401
from fixtures_mqtt import Broker, Message, Subscriber
from fixtures_registry import DockerRegistry

from agent.deploy.signing import generate_keys

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow

MODEL = "detector"


Keys = dict[str, tuple[Path, Path]]


def config(tmp_path: Path, device: str, broker: Broker, kit: DeployKit, cache: str, keys: Keys) -> Path:
    """fixtures_deploy's agent (deployments on, one camera, RTX fp32) as `device` with the engine cache."""
    folder = tmp_path / device
    folder.mkdir()
    path = agent_config(folder, broker.port, kit, cameras=1, model=bundled_model(backend="tensorrt_rtx"))
    cfg = yaml.safe_load(path.read_text())
    cfg["device_id"] = device
    cfg["engines"] = {
        "cache": cache,
        "signing_key": str(keys[device][0]),
        "signing_key_id": device,
        "trusted_keys": {k: str(pub) for k, (_, pub) in keys.items()},
        "timeout_s": 5,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def of(msgs: list[Message], device: str, suffix: str) -> list[dict[str, Any]]:
    return decoded([m for m in msgs if m[0] == f"edge-agent/{device}{suffix}" and m[1]], suffix)


def engine_of(msgs: list[Message], device: str, onnx_sha: str, root: Path) -> dict[str, Any] | None:
    """`device`'s latest engine state whose engine was built from the ONNX with `onnx_sha`."""
    for state in reversed(of(msgs, device, f"/engines/{MODEL}")):
        key = state.get("key")
        manifest = root / device / "engines" / MODEL / f"{key}.json"
        built_from = json.loads(manifest.read_text())["build"]["onnx_sha256"] if manifest.exists() else None
        if key and state.get("plan_sha256") and built_from == onnx_sha:
            return state
    return None


def deploy_to(sub: Subscriber, device: str, doc: dict[str, Any], agent: AgentProcess) -> None:
    """cmd/deploy to `device`; returns once the version serves there (fails at once on another end)."""
    sub.publish(f"edge-agent/{device}/cmd/deploy", json.dumps(doc))

    def serving(m: list[Message]) -> bool:
        mine = [s for s in of(m, device, f"/deployments/{MODEL}") if s.get("version") == doc["version"]]
        ended = [s for s in mine if s.get("stage") in ("rejected", "rolled_back", "failed")]
        if ended:
            end = ended[0]
            pytest.fail(f"{device}: deployment {doc['version']} {end['stage']}: {end.get('reason')}")
        return any(s.get("stage") == "serving" for s in mine)

    wait(sub, serving, 240, agent, f"{device} serving {doc['version']}")


def test_a_version_built_and_pushed_by_one_is_pulled_by_the_other(
    tmp_path: Path,
    deploy_kit: DeployKit,  # noqa: F811
    mqtt_broker: Broker,
    registry: DockerRegistry,
    mqtt_subscribe: Callable[..., Subscriber],
    start_agent: Callable[[Path], AgentProcess],
) -> None:
    keys = {d: generate_keys(tmp_path / "keys", d) for d in ("site-a", "site-b")}
    url = registry.url("site/engines")
    sub = mqtt_subscribe(mqtt_broker.port, "edge-agent/#")
    a = start_agent(config(tmp_path, "site-a", mqtt_broker, deploy_kit, url, keys))
    wait(sub, lambda m: any(s.get("origin") == "built" for s in of(m, "site-a", f"/engines/{MODEL}")), 240, a,
         "A's engine of the configured model")
    b = start_agent(config(tmp_path, "site-b", mqtt_broker, deploy_kit, url, keys))
    wait(sub, lambda m: any(s.get("origin") == "cache" for s in of(m, "site-b", f"/engines/{MODEL}")), 240, b,
         "B's engine of the configured model, pulled")

    doc = deploy_kit.make_document("v2")
    v2 = hashlib.sha256((deploy_kit.www / "v2.onnx").read_bytes()).hexdigest()
    deploy_to(sub, "site-a", doc, a)
    built = engine_of(sub.snapshot(), "site-a", v2, tmp_path)
    assert built is not None and built["origin"] == "built", of(sub.snapshot(), "site-a", "/engines/" + MODEL)
    assert f"engine {built['key']} pushed to the engine cache" in a.text()

    deploy_to(sub, "site-b", doc, b)
    pulled = engine_of(sub.snapshot(), "site-b", v2, tmp_path)
    b_states = of(sub.snapshot(), "site-b", "/engines/" + MODEL)
    assert pulled is not None and pulled["origin"] == "cache", b_states
    assert pulled["key"] == built["key"] and pulled["plan_sha256"] == built["plan_sha256"]
    assert pulled["loaded"] is False and pulled["backend"] == "onnxruntime"  # as a built one: no GPU here
    assert f"deployment detector: engine {built['key']} pulled from the engine cache" in b.text()
    assert "built engine" not in b.text(), b.text()[-3000:]
    tele = of(sub.snapshot(), "site-b", "/telemetry")
    assert tele[-1]["engine_cache"]["hits"] == 2 and tele[-1]["engine_cache"]["builds"] == 0
