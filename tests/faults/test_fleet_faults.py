"""The fleet under faults (issue 38, "Faults and bad input"), against real agents on mosquitto, a real
registry (docker-registry: CNCF Distribution) and TensorRT-RTX building real plans on this CPU (one device
kind: every agent here has the same compatibility key; no GPU, so a plan is built or pulled and ONNX Runtime
serves: state `fallback`).

Case -> test. The rollout cases run on real agents in tests/test_rollout_agents.py (R below), not here:
- registry down before and during a rollout
      -> test_registry_down_before_and_during_a_rollout_devices_build_locally
- a pushed plan tampered with in the registry (real agents: refused, built here, never pushed over)
      -> tests/test_engine_cache_agent.py::
         test_one_builds_and_pushes_the_next_pulls_a_tampered_artifact_is_built_here
- a plan under the right tag with another device kind's manifest
      -> test_a_plan_of_another_device_kind_under_the_right_tag_is_refused
- two devices racing for the build claim -> test_two_devices_racing_for_the_build_claim_build_once (agents;
  N devices on the claims alone: tests/test_build_claims.py::test_racing_devices_agree_on_exactly_one_builder)
- the builder killed mid-build (claim expires, another builds)
      -> test_the_builder_killed_mid_build_frees_the_key_by_expiry_and_another_builds (agents; the claims
         alone: tests/test_build_claims.py::test_a_killed_builders_claim_expires_and_another_device_wins)
- the CLI killed mid-rollout (--resume) -> R::test_the_cli_killed_mid_rollout_resumes_without_deploying_twice
- a device offline during its wave (a failure after a timeout, or skipped with --skip-offline)
      -> R::test_an_offline_device_fails_after_the_timeout_and_the_halt_rolls_back_the_canary
         R::test_skip_offline_skips_the_device_and_the_rollout_is_done
- a bad model failing the gate on the canary (halt, nothing else changed)
      -> R::test_a_broken_version_halts_after_the_canary_and_leaves_the_others_untouched
At most 2 agents at a time (the machine's 2 cores are shared).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests
from engine_cache_fixtures import oci_manifest, push_raw, signed_layers
from fixtures_agent import ASSETS, run_cli
from fixtures_registry import DockerRegistry, running_registry

from engines.cache import artifact
from engines.cache.signing import PlanSigner
from faults.fleet_kit import (
    CACHE_REPO,
    PREFIX,
    REPO,
    CacheRig,
    Fleet,
    cache_rig,
    fleet_args,
    fleet_deploy,
    payloads,
    running_fleet,
)

pytestmark = pytest.mark.slow
pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")
MODEL = ASSETS / "nanodet-m-416.onnx"
BUILT_S = 180.0  # bound on waiting for a device's plan (2 agents building on 2 shared cores take seconds)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[CacheRig]:
    for binary in ("mosquitto", "docker-registry"):
        if shutil.which(binary) is None and not Path(f"/usr/sbin/{binary}").exists():
            pytest.skip(f"{binary} is not installed")
    with cache_rig(tmp_path) as r:
        yield r


def wait_served(rig: CacheRig, *devices: str, timeout: float = BUILT_S) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while not all(rig.served(d) for d in devices):
        dead = [d for d in devices if rig.agents[d].proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            pytest.fail(f"{devices}: no plan after {timeout:g} s (exited: {dead})\n{rig.logs()}")
        time.sleep(0.1)
    return {d: rig.served(d) or {} for d in devices}


def test_two_devices_racing_for_the_build_claim_build_once(rig: CacheRig) -> None:
    rig.start(1)
    rig.start(2)  # both miss the empty cache at the same moment
    served = wait_served(rig, "kind-a-1", "kind-a-2")
    assert sorted(s["origin"] for s in served.values()) == ["built", "cache"], served
    builder = next(d for d, s in served.items() if s["origin"] == "built")
    key = served[builder]["key"]
    assert served["kind-a-1"]["key"] == served["kind-a-2"]["key"] == key
    # The one that built is the one whose claim won; the other loaded exactly the plan it pushed.
    claimers = {d for d, _ in rig.claims()}
    assert builder in claimers, rig.claims()
    assert served["kind-a-1"]["plan_sha256"] == served["kind-a-2"]["plan_sha256"]
    assert rig.tag_digest(key) is not None


def _tree(agent_pid: int) -> list[psutil.Process]:
    proc = psutil.Process(agent_pid)
    return [proc, *proc.children(recursive=True)]


def test_the_builder_killed_mid_build_frees_the_key_by_expiry_and_another_builds(rig: CacheRig) -> None:
    a = rig.start(1, claim_ttl_s=5)
    deadline = time.monotonic() + BUILT_S
    while not any(d == "kind-a-1" for d, _ in rig.claims()):
        assert a.proc.poll() is None and time.monotonic() < deadline, rig.logs()
        time.sleep(0.005)
    frozen = _tree(a.proc.pid)
    for p in frozen:  # the builder stops dead mid-build (the agent and its build process), its claim held
        p.send_signal(signal.SIGSTOP)
    key = rig.claims()[0][1]["key"]
    assert rig.tag_digest(key) is None, "the builder pushed before it was stopped: nothing was tested"
    try:
        rig.start(2, claim_ttl_s=5)
        served = wait_served(rig, "kind-a-2")["kind-a-2"]
    finally:
        for p in frozen:
            p.send_signal(signal.SIGKILL)
    # It waited for the frozen builder's claim, saw it expire (never renewed), claimed and built itself.
    assert served["origin"] == "built" and served["key"] == key, served
    assert "kind-a-2" in {d for d, _ in rig.claims()}, rig.claims()
    assert rig.tag_digest(key) is not None  # and pushed for the rest of the fleet


def _pushed(rig: CacheRig, device: str) -> tuple[str, str]:
    """(key, manifest digest under its tag) once `device` has built and pushed its plan."""
    key = wait_served(rig, device)[device]["key"]
    deadline = time.monotonic() + 60
    while (digest := rig.tag_digest(key)) is None:
        assert time.monotonic() < deadline, f"{device} never pushed {key}\n{rig.logs()}"
        time.sleep(0.1)
    return key, digest


def test_a_plan_of_another_device_kind_under_the_right_tag_is_refused(rig: CacheRig, tmp_path: Path) -> None:
    """A trusted device's bug or a stolen fleet key: kind B's plan (ahead of time for compute capability
    8.9) signed under kind A's tag, its manifest forged to record A's key. The signature and the key check
    pass; the device's own compatibility check refuses it, builds here and never pushes over the tag."""
    rig.start(1, push=False)  # kind A's key, nothing in the registry
    key = wait_served(rig, "kind-a-1")["kind-a-1"]["key"]
    rig.agents["kind-a-1"].kill()
    out = run_cli("build", "--onnx", str(MODEL), "--backend", "tensorrt_rtx", "--target-cc", "8.9",
                  "--name", "detector", "--out", str(tmp_path / "kind-b"), "--json")
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "kind-b" / "detector"
    plan, manifest = next(folder.glob("*.plan")), next(folder.glob("*.json"))
    forged = json.loads(manifest.read_text())
    assert forged["build"]["key"] != key  # another device kind indeed
    forged["build"]["key"] = key
    signer = PlanSigner.from_file(rig.keys[0], "fleet")  # the fleet key every device trusts
    push_raw(rig.registry, key, signed_layers(key, plan.read_bytes(), json.dumps(forged).encode(), signer),
             tmp_path / "raw", repository=CACHE_REPO)
    digest = rig.tag_digest(key)

    rig.start(2)
    served = wait_served(rig, "kind-a-2")["kind-a-2"]
    assert served["origin"] == "built" and served["key"] == key, served
    assert served["plan_sha256"] != hashlib.sha256(plan.read_bytes()).hexdigest()
    assert rig.tag_digest(key) == digest
    log = rig.agents["kind-a-2"].text()
    assert "does not fit this device" in log and "8.9" in log, log[-3000:]


def _engine_keys(fleet: Fleet, device: str, since: int) -> dict[str, dict]:
    """The device's engine states holding a plan since message `since`, the last one per key."""
    states = payloads(fleet.messages()[since:], f"{PREFIX}/{device}/engines/detector")
    return {s["key"]: s for s in states if s.get("plan_sha256") and s.get("state") in ("ready", "fallback")}


def _unavailable(fleet: Fleet, device: str) -> list[str]:
    return [ln for ln in fleet.agents[device].text().splitlines() if "engine cache is unavailable" in ln]


def test_registry_down_before_and_during_a_rollout_devices_build_locally(tmp_path: Path) -> None:
    """Two RTX agents with the engine cache. Before: the registry stops, then `fleet deploy`: each builds
    the new version's engine here, says so once, the rollout is done. During: the registry is back, the
    canary builds and pushes the next version, the registry dies before the second wave: that device
    builds here too, the rollout is done, and the registry, back, holds the canary's plan under the key."""
    with running_registry(tmp_path / "registry") as reg, \
            running_fleet(tmp_path / "fleet", 2, cache=reg.url(CACHE_REPO)) as fleet:
        canary, second = fleet.devices
        deadline = time.monotonic() + BUILT_S
        while not all(_engine_keys(fleet, d, 0) for d in fleet.devices):  # the configured model's engine
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.2)
        before = _tags(reg)
        reg.stop()
        n0 = len(fleet.messages())
        rc, final = fleet_deploy(fleet, fleet.document("v-down"), "--soak", "1")
        assert rc == 0 and final["status"] == "done", final
        for device in fleet.devices:
            (state,) = _engine_keys(fleet, device, n0).values()
            assert state["origin"] == "built", state
            said = _unavailable(fleet, device)
            assert len(said) == 1 and "building here" in said[0], said

        reg.start()
        assert _tags(reg) == before  # nothing pushed while it was down
        n1 = len(fleet.messages())
        cli = subprocess.Popen(fleet_args(fleet, fleet.document("v-during"), "--soak", "3"), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + BUILT_S
        while not (built := _engine_keys(fleet, canary, n1)) or _tags(reg) == before:
            assert cli.poll() is None and time.monotonic() < deadline, (cli.communicate(), fleet.logs())
            time.sleep(0.05)
        ((key, pushed),) = built.items()
        assert pushed["origin"] == "built" and _tags(reg) - before == {key}
        reg.stop()  # the canary still gates and soaks: the second wave finds the registry down
        out, err = cli.communicate(timeout=600)
        assert cli.returncode == 0 and json.loads(out)["status"] == "done", (out, err)
        (state,) = _engine_keys(fleet, second, n1).values()
        assert state["key"] == key and state["origin"] == "built", state  # not pulled: built here
        reg.start()
        assert _tags(reg) - before == {key} and _plan_sha(reg, key) == pushed["plan_sha256"]  # the canary's


def _tags(reg: DockerRegistry) -> set[str]:
    r = requests.get(f"http://127.0.0.1:{reg.port}/v2/{CACHE_REPO}/tags/list", timeout=5)
    return set() if r.status_code == 404 else set(r.json().get("tags") or [])


def _plan_sha(reg: DockerRegistry, key: str) -> str:
    """build.plan_sha256 of the engine manifest stored under the tag `key`."""
    layers = oci_manifest(reg, key, CACHE_REPO)["layers"]
    layer = next(d for d in layers if d["mediaType"] == artifact.MANIFEST)
    r = requests.get(f"http://127.0.0.1:{reg.port}/v2/{CACHE_REPO}/blobs/{layer['digest']}", timeout=5)
    return str(r.json()["build"]["plan_sha256"])
