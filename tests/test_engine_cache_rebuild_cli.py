"""`edge-agent rebuild` with the fleet's engine cache (issue 38; docs/DESIGN.md "The engine cache in the
agent"): a plain rebuild of an engine that does not fit pulls the engine the cache holds for its key (as the
daemon does); `--force` builds here, never pulls, and never pushes over the cache's copy.

mosquitto (the build claims), CNCF Distribution (`docker-registry`), the real CLI building a real TensorRT-RTX
plan on this CPU; the artifact in the registry is another device's, signed by it, made for this machine's key
(tests/test_engine_cache_agent_origin.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_agent import run_cli
from fixtures_mqtt import Broker
from fixtures_registry import DockerRegistry
from test_engine_cache_agent import BUILD_S, config, make_keys, oci_manifest, tags
from test_engine_cache_agent_origin import push_as_other
from test_engine_cache_agent_wait import key_of

from engines.store import EngineStore

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
pytestmark = pytest.mark.slow


def stored_sha(tmp_path: Path, key: str) -> str | None:
    m = EngineStore(tmp_path / "cli" / "engines").manifest("detector", key)
    return None if m is None else m.build.plan_sha256


def test_rebuild_pulls_what_the_cache_holds_and_force_builds_here(
    tmp_path: Path, mqtt_broker: Broker, registry: DockerRegistry
) -> None:
    keys = make_keys(tmp_path, "cli", "other")
    url = registry.url("site/engines")
    path = config(tmp_path, "cli", mqtt_broker, url, keys)
    key = key_of(path)
    sha = push_as_other(tmp_path, path, url, keys["other"][0])
    digest, _ = oci_manifest(registry, key)

    pulled = run_cli("rebuild", "-c", str(path), timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    assert f"engine {key} of model 'detector' pulled from the engine cache" in pulled.stdout, pulled.stdout
    assert "built by other" in pulled.stdout and "built engine" not in pulled.stdout
    assert stored_sha(tmp_path, key) == sha

    forced = run_cli("rebuild", "-c", str(path), "--force", timeout=BUILD_S)
    assert forced.returncode == 0, forced.stderr
    assert f"built engine {key}" in forced.stdout and "pulled" not in forced.stdout, forced.stdout
    assert stored_sha(tmp_path, key) not in (None, sha)  # this machine's own plan
    assert tags(registry) == [key] and oci_manifest(registry, key)[0] == digest  # not pushed over
