"""A model deployed from an OCI registry to the real agent (mosquitto, docker-registry, ONNX Runtime serving;
tests/fixtures_deploy.py): the ONNX and its labels pushed as one manifest, the document naming it by
digest, the version reaches `serving`; then documents that must not change what serves (a tag instead of
a digest, a digest the registry lacks, a blob tampered with in the registry's storage, the registry down)
end refused with a reason naming the field, and the version of before still serves."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fixtures_agent import wait_until
from fixtures_deploy import (
    BASE,
    KEY_ID,
    MODEL,
    DeployKit,
    agent_config,
    deploy,
    deploy_kit,  # noqa: F401 (the fixture: the module's artifact store)
    states,
    wait_stage,
)
from fixtures_mqtt import Broker, Subscriber
from fixtures_oci_models import LABELS_TYPE, ONNX_TYPE, Pushed, push_files
from fixtures_registry import (
    DockerRegistry,
    registry,  # noqa: F401  (the fixture)
)

from agent.deploy.signing import sign_document

PLAIN = "?plain-http=true"  # the kit's config names a CA file: loopback would be HTTPS without this


def streaming(sub: Subscriber) -> bool:
    cams = [json.loads(p) for t, p, _ in sub.snapshot() if t.startswith(f"{BASE}/cameras/") and
            t.endswith("/state") and p]
    return bool(cams) and cams[-1]["state"] == "streaming"


def document(kit: DeployKit, version: str, onnx: dict[str, Any], labels: dict[str, Any]) -> dict[str, Any]:
    doc = kit.make_document(version, sign=False)
    doc["artifacts"] = {"onnx": onnx, "labels": labels}
    return sign_document(doc, kit.private_key, KEY_ID)


def refused(sub: Subscriber, doc: dict[str, Any], stage: str, agent: Any) -> dict[str, Any]:
    """The final state of `doc`'s deployment, which must be `stage`."""
    answer = deploy(sub, doc, agent=agent)
    assert answer["ok"] and answer["stage"] == "accepted", answer
    return wait_stage(sub, MODEL, (stage,), version=doc["version"], timeout=120, agent=agent)


def serving_version(state_dir: Path) -> str | None:
    return json.loads((state_dir / "models" / MODEL / "serving.json").read_text())["serving"]


def test_a_model_from_the_registry_serves_and_bad_references_change_nothing(
    deploy_kit: DeployKit,  # noqa: F811
    registry: DockerRegistry,  # noqa: F811
    mqtt_broker: Broker,
    mqtt_subscribe: Any,
    start_agent: Any,
    tmp_path: Path,
) -> None:
    www = deploy_kit.www
    both = [(www / "v2.onnx", ONNX_TYPE), (www / "coco.names", LABELS_TYPE)]
    v2 = push_files(registry, "site/models", both, tag="v2")
    v3 = push_files(registry, "site/models", [(www / "v3.onnx", ONNX_TYPE)], tag="v3")
    state_dir = tmp_path / "deploy-state"
    cfg = agent_config(tmp_path, mqtt_broker.port, deploy_kit, cameras=1)
    sub = mqtt_subscribe(mqtt_broker.port, f"{BASE}/#")
    agent = start_agent(cfg)
    assert wait_until(lambda: streaming(sub), 90), agent.text()[-3000:]

    labels = v2.artifact(www / "coco.names", query=PLAIN)
    good = document(deploy_kit, "v2", v2.artifact(www / "v2.onnx", query=PLAIN), labels)
    assert deploy(sub, good, agent=agent)["ok"]
    served = wait_stage(sub, MODEL, "serving", version="v2", agent=agent)
    assert served["versions"] == ["v2"] and serving_version(state_dir) == "v2"
    assert (state_dir / "models" / MODEL / "v2" / "model.onnx").read_bytes() == (www / "v2.onnx").read_bytes()

    # A tag: refused before anything is fetched, by the document's own rules.
    tagged = {**v3.artifact(www / "v3.onnx"), "url": f"oci://127.0.0.1:{registry.port}/site/models:v3{PLAIN}"}
    answer = deploy(sub, document(deploy_kit, "v3", tagged, labels), agent=agent)
    assert not answer["ok"] and answer["field"] == "artifacts.onnx.url", answer
    assert "names a tag" in answer["error"], answer

    # A digest the registry has no manifest of.
    missing = v3.artifact(www / "v3.onnx", digest="sha256:" + "0" * 64, query=PLAIN)
    st = refused(sub, document(deploy_kit, "v4", missing, labels), "rejected", agent)
    assert st["reason"].startswith("download of artifacts.onnx (oci://127.0.0.1:"), st
    assert "no manifest of this digest" in st["reason"], st

    # The blob changed in the registry's storage after the push: its bytes fail the document's sha256.
    _tamper(registry, v3, www / "v3.onnx")
    st = refused(sub, document(deploy_kit, "v5", v3.artifact(www / "v3.onnx", query=PLAIN), labels),
                 "rejected", agent)
    assert "download of artifacts.onnx (" in st["reason"] and "sha256 mismatch" in st["reason"], st

    # The registry down: a fault after the download's retries (as an unreachable HTTP store), not a verdict.
    registry.stop()
    v6 = document(deploy_kit, "v6", v2.artifact(www / "v2.onnx", query=PLAIN), labels)
    st = refused(sub, v6, "failed", agent)
    assert "download of artifacts.onnx (" in st["reason"] and "connection refused" in st["reason"], st

    # Nothing of the refused versions stays; v2 serves throughout.
    assert serving_version(state_dir) == "v2"
    assert sorted(p.name for p in (state_dir / "models" / MODEL).iterdir() if p.is_dir()) == ["v2"]
    after = [s for s in states(sub) if s.get("version") in ("v4", "v5", "v6")]
    assert after and all(s["versions"] == ["v2"] for s in after), after
    time.sleep(1)
    assert streaming(sub)


def _tamper(reg: DockerRegistry, pushed: Pushed, path: Path) -> None:
    blob = reg.blob_file(pushed.blobs[path])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
