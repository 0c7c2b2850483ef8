"""The deployment orchestrator (issue 37: 4-8) end to end against a fake_host: real signed documents, real
downloads from nginx over HTTPS with a test CA (credentials in the URL), the real verify of the bundled
NanoDet, the real VersionStore, ONNX Runtime backends for the gate and shadow on frames of the bundled clip.
The fake host stands in for the Device/Runtime (wired by the next step, with its own real-agent tests):
it serves what it was last promoted and reports camera health the test sets.

Second versions (tools/deploy_gate_agreement.py): v2/v3 = weights x (1 + N(0, 1 %)) (a retrained stand-in,
agreement ~0.96); labels shuffled (agreement 0); slow = the same outputs + 60 MatMuls (~5x the latency).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from fixtures_http import NGINX, Nginx, Pki, make_pki, running_nginx

from agent.config import ModelConfig
from agent.config.deploy import DeployConfig, DeployWatchConfig
from agent.deploy.host import CameraHealth
from agent.deploy.job import Job
from agent.deploy.manager import Deployer
from agent.deploy.signing import generate_keys, sign_document
from agent.deploy.state import DOWNLOADING, GATING, DeploymentState
from agent.deploy.versions import VersionStore
from agent.deploy.watch import judge
from engines.runtimes.ort import OrtBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import deploy_gate_agreement as variants  # noqa: E402

PASSWORD = "s3cret-Pa55"
MODEL = "nanodet"
HEALTHY = CameraHealth(frames=100, age_p95_ms=40.0, detections_per_frame=3.0, state="running")


# ---- the fake host -------------------------------------------------------------------------------------
class fake_host:
    """The agent as the orchestrator sees it: one model `nanodet` on camera `street`."""

    def __init__(self, own: ModelConfig, frames: list[np.ndarray], engine_dir: Path) -> None:
        self.own, self.frames, self._engine_dir = own, frames, engine_dir
        self.serving = own
        self.promoted: list[ModelConfig] = []
        self.states: list[dict[str, Any]] = []
        self.fail_camera_after_promote = False
        self.health_error_after_promote = False
        self.build_error: Exception | None = None  # raised by candidate_backend
        self.frames_gate: threading.Event | None = None  # set: live_frames waits for it

    def model_config(self, model: str) -> ModelConfig | None:
        return self.own if model == MODEL else None

    def score_threshold(self, model: str) -> float:
        return 0.4

    def engine_dir(self) -> Path | None:
        return self._engine_dir

    def live_frames(self, model: str, n: int, timeout_s: float) -> list[tuple[str, np.ndarray]]:
        if self.frames_gate is not None:
            self.frames_gate.wait(30)
        return [("street", f) for f in self.frames[:n]]

    @contextlib.contextmanager
    def _ort(self, cfg: ModelConfig) -> Iterator[OrtBackend]:
        backend = OrtBackend(cfg.onnx, intra_threads=1)
        backend.load()
        try:
            yield backend
        finally:
            backend.close()

    def candidate_backend(self, model: str, model_cfg: ModelConfig) -> contextlib.AbstractContextManager[Any]:
        if self.build_error is not None:
            raise self.build_error
        return self._ort(model_cfg)

    def serving_backend(self, model: str) -> contextlib.AbstractContextManager[Any]:
        return self._ort(self.serving)

    def promote(self, model: str, model_cfg: ModelConfig) -> None:
        self.serving = model_cfg
        self.promoted.append(model_cfg)

    def camera_health(self, model: str) -> dict[str, CameraHealth]:
        if self.health_error_after_promote and self.serving is not self.own:
            raise RuntimeError("telemetry gone")
        if self.fail_camera_after_promote and self.serving is not self.own:
            return {"street": CameraHealth(10, None, 0.0, "failed", 0)}
        return {"street": HEALTHY}

    def publish_state(self, model: str, payload: bytes) -> None:
        self.states.append(json.loads(payload))

    def stages(self) -> list[str]:
        out: list[str] = []
        for s in self.states:
            if not out or out[-1] != s["stage"]:
                out.append(s["stage"])
        return out


# ---- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def www(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("www")
    d = root / "private"
    d.mkdir()
    variants.retrained(d / "v2.onnx", 0.01, seed=1)
    variants.retrained(d / "v3.onnx", 0.01, seed=2)
    variants.retrained(d / "v4.onnx", 0.01, seed=3)
    variants.slow(d / "slow.onnx")
    shutil.copy(variants.LABELS, d / "coco.names")
    variants.shuffled_labels(d / "shuffled.names")
    return root


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory, www: Path, pki: Pki) -> Iterator[Nginx]:
    if NGINX is None:
        pytest.skip("needs nginx (apt-get install nginx-light; .ci/run installs it)")
    with running_nginx(tmp_path_factory.mktemp("nginx"), www, pki, {"deploy": PASSWORD}) as server:
        yield server


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return variants.clip_frames(12, every=5)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate_keys(tmp_path_factory.mktemp("keys"), "ops")


@pytest.fixture
def cfg(tmp_path: Path, pki: Pki, keys: tuple[Path, Path]) -> DeployConfig:
    return DeployConfig(
        enabled=True,
        trusted_keys={"ops": keys[1]},
        ca_file=pki.ca_cert,
        state_dir=tmp_path / "state",
        watch_s=0.3,
    )


@pytest.fixture
def host(tmp_path: Path, frames: list[np.ndarray]) -> fake_host:
    own = ModelConfig(
        onnx=variants.NANODET,
        labels=variants.LABELS,
        format="nanodet",
        backend="onnxruntime",
        precision="fp32",
    )
    return fake_host(own, frames, tmp_path / "engines")


@pytest.fixture
def deployer(cfg: DeployConfig, host: fake_host) -> Iterator[Deployer]:
    d = Deployer(cfg, VersionStore(cfg.state_dir), host, frames_timeout_s=5, watch_interval_s=0.05)
    yield d
    d.close()


class Docs:
    def __init__(self, nginx: Nginx, www: Path, private_key: Path) -> None:
        self.nginx, self.www, self.key = nginx, www, private_key

    def art(self, name: str) -> dict[str, Any]:
        data = (self.www / "private" / name).read_bytes()
        url = self.nginx.url(f"private/{name}", auth=f"deploy:{PASSWORD}@")
        return {"url": url, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def make(
        self, version: str, onnx: str = "v2.onnx", labels: str = "coco.names", **more: Any
    ) -> dict[str, Any]:
        doc = {
            "model": MODEL,
            "version": version,
            "format": "nanodet",
            "artifacts": {"onnx": self.art(onnx), "labels": self.art(labels)},
            "gate": {"frames": 10},
            "shadow": {"frames": 6, "max_latency_ratio": 10.0},
            "request_id": version,
            **more,
        }
        return sign_document(doc, self.key, "ops")

    def raw(self, *args: Any, **kw: Any) -> bytes:
        return json.dumps(self.make(*args, **kw)).encode()


@pytest.fixture
def docs(nginx: Nginx, www: Path, keys: tuple[Path, Path]) -> Docs:
    return Docs(nginx, www, keys[0])


def run(deployer: Deployer, raw: bytes) -> DeploymentState:
    answer = deployer.submit(raw)
    assert answer["ok"], answer
    state = deployer.wait(MODEL, 120)
    assert state is not None
    return state


def left_in(state_dir: Path) -> list[str]:
    staging = state_dir / "staging"
    return (
        [str(p.relative_to(state_dir)) for p in staging.rglob("*") if p.is_file()] if staging.exists() else []
    )


# ---- the happy path ------------------------------------------------------------------------------------
def test_a_signed_version_goes_to_serving_through_every_stage(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.deploy")
    state = run(deployer, docs.raw("v2"))
    assert state.stage == "serving", state.reason
    assert host.stages() == [
        "accepted",
        "downloading",
        "verifying",
        "building",
        "gating",
        "shadow",
        "watching",
        "serving",
    ]
    last = host.states[-1]
    assert (
        last["schema"] == "edge-agent/deployment/1" and last["version"] == "v2" and last["previous"] is None
    )
    assert last["request_id"] == "v2" and last["versions"] == ["v2"] and last["progress"] == 1.0
    gate = last["checks"]["gate"]
    assert gate["agreement"] >= gate["threshold"] == cfg.gate.min_agreement and gate["frames"] == 10
    assert last["checks"]["shadow"]["latency_ratio"] > 0 and last["checks"]["shadow"]["frames"] == 6
    assert last["checks"]["watch"]["cameras"]["street"]["state"] == "running"
    progress = [s["progress"] for s in host.states if s["stage"] == "downloading"]
    assert progress == sorted(progress) and progress[-1] == 1.0 and len(progress) > 2
    timed = ["accepted", "downloading", "verifying", "building", "gating", "shadow", "watching"]
    assert sorted(last["stage_s"]) == sorted(timed) and min(last["stage_s"].values()) >= 0
    watching = [s["progress"] for s in host.states if s["stage"] == "watching"]
    assert len(watching) > 1 and watching == sorted(watching) and watching[-1] > 0  # the watch reports too
    # Promoted with the hot swap: the version's own files serve; persisted for a restart.
    vdir = cfg.state_dir / "models" / MODEL / "v2"
    assert host.serving.onnx == vdir / "model.onnx" and host.promoted == [host.serving]
    assert deployer.store.serving(MODEL) == "v2"
    assert left_in(cfg.state_dir) == []
    record = json.loads((cfg.state_dir / "deployments" / f"{MODEL}.json").read_text())
    assert record["state"]["stage"] == "serving"
    # One journal line per stage change; the URL's credentials nowhere.
    lines = [r.getMessage() for r in caplog.records if r.name == "agent.deploy"]
    for stage in host.stages():
        assert sum(f"deployment {MODEL} v2: {stage}" in line for line in lines) == 1, (stage, lines)
    assert PASSWORD not in json.dumps(host.states), [s for s in host.states if PASSWORD in json.dumps(s)][:1]
    assert PASSWORD not in caplog.text and "deploy:s3" not in caplog.text


def test_the_same_version_again_is_answered_already_serving_nothing_rebuilt(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    assert run(deployer, docs.raw("v2")).stage == "serving"
    published, promoted = len(host.states), len(host.promoted)
    answer = deployer.submit(docs.raw("v2"))
    assert answer["ok"] and answer["reason"] == "already serving" and answer["stage"] == "serving"
    assert len(host.states) == published and len(host.promoted) == promoted


def test_a_serving_version_survives_a_restart_and_a_broken_one_falls_back(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    assert run(deployer, docs.raw("v2")).stage == "serving"
    deployer.close()
    again = Deployer(cfg, VersionStore(cfg.state_dir), host)
    serve = again.start([MODEL])
    assert serve[MODEL].onnx == cfg.state_dir / "models" / MODEL / "v2" / "model.onnx"
    with open(serve[MODEL].onnx, "r+b") as f:  # a bit flipped on disk
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    host.states.clear()
    assert Deployer(cfg, VersionStore(cfg.state_dir), host).start([MODEL]) == {}
    assert host.states[-1]["stage"] == "failed" and "v2 is broken" in host.states[-1]["reason"]
    assert "config's own model" in host.states[-1]["reason"]


# ---- refusals ------------------------------------------------------------------------------------------
def test_shuffled_labels_are_rejected_at_the_gate_and_nothing_stays(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    state = run(deployer, docs.raw("v2", labels="shuffled.names"))
    assert state.stage == "rejected" and state.reason is not None and state.reason.startswith("gate:")
    assert state.checks["gate"]["agreement"] < 0.1 < cfg.gate.min_agreement
    assert host.stages()[-2:] == ["gating", "rejected"]
    assert host.promoted == [] and deployer.store.serving(MODEL) is None
    assert not (cfg.state_dir / "models" / MODEL / "v2").exists() and left_in(cfg.state_dir) == []


def test_a_slow_version_is_rejected_in_shadow(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    doc = docs.make("slow", onnx="slow.onnx")
    doc.pop("signature")
    doc["shadow"] = {"frames": 6}  # the config's max_latency_ratio (2.0)
    state = run(deployer, json.dumps(sign_document(doc, docs.key, "ops")).encode())
    assert state.stage == "rejected" and "shadow: latency p95" in str(state.reason), state.reason
    assert state.checks["shadow"]["latency_ratio"] > cfg.shadow.max_latency_ratio
    assert state.checks["gate"]["agreement"] >= cfg.gate.min_agreement  # same outputs: the gate passed it
    assert host.promoted == [] and not (cfg.state_dir / "models" / MODEL / "slow").exists()


def test_a_camera_failing_after_promotion_rolls_back_by_itself(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    host.fail_camera_after_promote = True
    state = run(deployer, docs.raw("v2", watch_s=30))
    assert state.stage == "rolled_back" and "camera street failed" in str(state.reason), state.reason
    assert "the config model serves again" in str(state.reason)
    assert host.promoted[-1] is host.own and host.serving is host.own
    assert deployer.store.serving(MODEL) is None
    assert host.states[-1]["checks"]["watch"]["cameras"]["street"]["state"] == "failed"


def test_unsigned_unknown_model_and_bad_documents_are_refused_with_a_reason(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    doc = docs.make("v2")
    unsigned = {k: v for k, v in doc.items() if k != "signature"}
    answer = deployer.submit(json.dumps(unsigned).encode())
    assert not answer["ok"] and answer["field"] == "signature" and "not signed" in answer["reason"]
    assert host.states[-1]["stage"] == "rejected" and host.states[-1]["reason"] == answer["reason"]
    doc["version"] = "v9"  # changed after signing
    assert "signature" in deployer.submit(json.dumps(doc).encode())["reason"]
    other = docs.make("v2")
    other.pop("signature")
    other["model"] = "other"
    answer = deployer.submit(json.dumps(sign_document(other, docs.key, "ops")).encode())
    assert (
        not answer["ok"] and answer["field"] == "model" and "not a model of this device" in answer["reason"]
    )
    answer = deployer.submit(b"{not json")
    assert not answer["ok"] and answer["reason"]
    assert host.promoted == [] and PASSWORD not in json.dumps(host.states)


# ---- one deployment per model --------------------------------------------------------------------------
def test_a_newer_document_supersedes_a_pending_one(deployer: Deployer, host: fake_host, docs: Docs) -> None:
    host.frames_gate = threading.Event()
    first = deployer.submit(docs.raw("v2"))
    assert first["ok"]
    for _ in range(600):  # until v2 waits for its gate frames
        if host.states and host.states[-1]["stage"] == "gating":
            break
        threading.Event().wait(0.05)
    second = deployer.submit(docs.raw("v3", onnx="v3.onnx"))
    assert second["ok"] and second["reason"] == "supersedes version v2 (cancelled)"
    host.frames_gate.set()
    state = deployer.wait(MODEL, 120)
    assert state is not None and state.stage == "serving" and state.version == "v3", state.reason
    v2_end = [s for s in host.states if s["version"] == "v2"][-1]
    assert v2_end["stage"] == "failed" and v2_end["reason"] == "cancelled: superseded by version v3"
    accepted = next(s for s in host.states if s["version"] == "v3")
    assert accepted["stage"] == "accepted" and accepted["superseded"] == "v2"
    assert [m.onnx.parent.name for m in host.promoted] == ["v3"]
    assert [v.version for v in deployer.store.versions(MODEL)] == ["v3"]


def test_rollback_by_hand_serves_the_previous_version(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    assert run(deployer, docs.raw("v2")).stage == "serving"
    assert run(deployer, docs.raw("v3", onnx="v3.onnx")).stage == "serving"
    assert host.states[-1]["previous"] == "v2" and host.states[-1]["versions"] == ["v3", "v2"]
    answer = deployer.rollback(MODEL)
    assert answer == {"ok": True, "model": MODEL, "version": "v2", "previous": "v3", "stage": "rolled_back"}
    assert host.serving.onnx.parent.name == "v2" and deployer.store.serving(MODEL) == "v2"
    assert host.states[-1]["stage"] == "rolled_back" and "by hand from v3" in host.states[-1]["reason"]
    to_config = deployer.rollback(MODEL, to=None)
    assert to_config["ok"] and to_config["version"] == "v3"  # the previous one is v3 now
    bad = deployer.rollback(MODEL, to="v7")
    assert not bad["ok"] and bad["field"] == "to"
    assert not deployer.rollback("other")["ok"]


# ---- restarts ------------------------------------------------------------------------------------------
def _interrupted(deployer: Deployer, docs: Docs, stage: str, **more: Any) -> Job:
    from agent.deploy.document import document_digest, parse_document

    doc, body = parse_document(docs.make("v2"), "test")
    job = Job(doc, body, document_digest(body), DeploymentState(MODEL, "v2", stage), **more)
    deployer.env.save(job)
    return job


def test_an_interrupted_download_resumes_after_a_restart(
    deployer: Deployer, host: fake_host, docs: Docs, nginx: Nginx, cfg: DeployConfig
) -> None:
    _interrupted(deployer, docs, DOWNLOADING)
    data = (docs.www / "private" / "v2.onnx").read_bytes()
    stage_dir = deployer.store.stage_dir(MODEL, "v2")
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / "model.onnx.part").write_bytes(data[: len(data) // 2])  # what the killed agent had
    nginx.requests()  # the log so far
    assert deployer.start([MODEL]) == {}  # the config's own model serves while it resumes
    state = deployer.wait(MODEL, 120)
    assert state is not None and state.stage == "serving", state.reason
    assert f'range="bytes={len(data) // 2}-"' in "\n".join(nginx.requests())
    first = host.states[0]  # resumed where it was, not accepted again
    assert first["stage"] == "downloading" and first["reason"] == "resumed after a restart"


def test_an_interrupted_gate_fails_after_a_restart_and_the_old_version_serves(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    staged = deployer.store.stage_dir(MODEL, "v2")
    staged.mkdir(parents=True, exist_ok=True)
    for _key, name in (("onnx", "v2.onnx"), ("labels", "coco.names")):
        shutil.copy(docs.www / "private" / name, staged / name)
    doc = docs.make("v2")
    deployer.store.install(MODEL, "v2", {"onnx": staged / "v2.onnx", "labels": staged / "coco.names"}, doc)
    _interrupted(deployer, docs, GATING, installed_here=True)
    assert deployer.start([MODEL]) == {}
    assert deployer.wait(MODEL, 1) is None  # nothing resumed
    last = host.states[-1]
    assert last["stage"] == "failed" and last["reason"].startswith(
        "interrupted (the agent stopped during gating)"
    )
    assert "the config model serves" in last["reason"]
    assert deployer.store.versions(MODEL) == [] and left_in(cfg.state_dir) == []
    assert host.promoted == []


# ---- the watch's rules ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("now", "expect"),
    [
        (HEALTHY, None),
        (CameraHealth(100, 110.0, 3.0, "running"), None),  # within 3x of 40 ms (floor 50 ms: 150 ms)
        (CameraHealth(100, 160.0, 3.0, "running"), "frame age p95 160 ms"),
        (CameraHealth(100, 40.0, 0.5, "running"), "detections per frame collapsed"),
        (CameraHealth(0, None, 0.0, "running"), None),  # no frames yet: nothing to judge
        (CameraHealth(100, 40.0, 3.0, "failed"), "camera street failed"),
        (CameraHealth(100, 40.0, 3.0, "running", errors=2), "engine errors"),
    ],
)
def test_the_watch_rules(now: CameraHealth, expect: str | None) -> None:
    reason = judge({"street": HEALTHY}, {"street": now}, DeployWatchConfig())
    assert (reason is None) if expect is None else (expect in str(reason)), reason


def test_no_detections_before_is_no_collapse() -> None:
    quiet = CameraHealth(100, 40.0, 0.0, "running")
    assert judge({"street": quiet}, {"street": quiet}, DeployWatchConfig()) is None


def test_an_agent_stopped_during_the_watch_serves_the_previous_version_after_a_restart(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    assert deployer.submit(docs.raw("v2", watch_s=60))["ok"]
    for _ in range(1200):
        if host.states and host.states[-1]["stage"] == "watching":
            break
        threading.Event().wait(0.05)
    assert deployer.store.serving(MODEL) == "v2"
    deployer.close()  # the agent stops: the record stays at watching
    assert json.loads(deployer.env.record_path(MODEL).read_text())["state"]["stage"] == "watching"
    again = Deployer(cfg, VersionStore(cfg.state_dir), host)
    assert again.start([MODEL]) == {}  # the config's own model, as before the promotion
    last = host.states[-1]
    assert last["stage"] == "failed" and "stopped during watching" in last["reason"], last
    assert again.store.serving(MODEL) is None


def test_a_newer_document_ends_the_watch_of_a_promoted_one_which_stays(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    assert deployer.submit(docs.raw("v2", watch_s=60))["ok"]
    for _ in range(1200):
        if host.states and host.states[-1]["stage"] == "watching":
            break
        threading.Event().wait(0.05)
    assert deployer.submit(docs.raw("v3", onnx="v3.onnx"))["ok"]
    state = deployer.wait(MODEL, 120)
    assert state is not None and state.stage == "serving" and state.version == "v3", state.reason
    v2_end = [s for s in host.states if s["version"] == "v2"][-1]
    assert v2_end["stage"] == "serving" and "watch cut short by a newer deployment" in v2_end["reason"]
    assert state.previous == "v2" and [m.onnx.parent.name for m in host.promoted] == ["v2", "v3"]


def test_older_versions_beyond_keep_versions_are_pruned_after_a_promotion(
    cfg: DeployConfig, host: fake_host, docs: Docs
) -> None:
    deployer = Deployer(
        cfg.model_copy(update={"keep_versions": 1}), VersionStore(cfg.state_dir), host, watch_interval_s=0.05
    )
    try:
        for version, onnx in (("v2", "v2.onnx"), ("v3", "v3.onnx"), ("v4", "v4.onnx")):
            assert run(deployer, docs.raw(version, onnx=onnx)).stage == "serving"
    finally:
        deployer.close()
    # keep_versions 1: the serving one, plus the previous one (the rollback target) which is never pruned.
    assert [v.version for v in deployer.store.versions(MODEL)] == ["v4", "v3"]
    assert host.states[-1]["versions"] == ["v4", "v3"]
    assert not (cfg.state_dir / "models" / MODEL / "v2").exists()


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"sha256": "0" * 64}, "sha256"),
        ({"size": 1234}, "size"),
        ({"url": "missing.onnx"}, "404"),
    ],
)
def test_a_refused_download_is_rejected_and_leaves_nothing(
    deployer: Deployer,
    host: fake_host,
    docs: Docs,
    cfg: DeployConfig,
    change: dict[str, Any],
    expect: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    doc = docs.make("v2")
    doc.pop("signature")
    if "url" in change:
        change = {"url": docs.nginx.url(f"private/{change['url']}", auth=f"deploy:{PASSWORD}@")}
    doc["artifacts"]["onnx"].update(change)
    state = run(deployer, json.dumps(sign_document(doc, docs.key, "ops")).encode())
    assert state.stage == "rejected" and expect in str(state.reason), state.reason
    assert host.stages()[-2:] == ["downloading", "rejected"] and host.promoted == []
    assert PASSWORD not in json.dumps(host.states) and PASSWORD not in caplog.text
    assert "deployment nanodet v2: rejected: " in caplog.text  # the journal line with the reason
    assert left_in(cfg.state_dir) == [] and deployer.store.versions(MODEL) == []


@pytest.mark.parametrize(
    ("make", "passes"),
    [
        (lambda d: (variants.retrained(d / "m.onnx", 0.01, seed=1), variants.LABELS), True),
        (lambda d: (variants.NANODET, variants.shuffled_labels(d / "l.names")), False),
        (lambda d: (variants.wrong_normalisation(d / "m.onnx"), variants.LABELS), False),
        (lambda d: (variants.wrong_input_size(d / "m.onnx"), variants.LABELS), False),
    ],
    ids=["retrained", "labels-shuffled", "normalisation", "input-size"],
)
def test_the_default_agreement_floor_separates_a_retrained_version_from_broken_ones(
    tmp_path: Path, frames: list[np.ndarray], make: Any, passes: bool
) -> None:
    onnx, labels = make(tmp_path)
    agreement = variants.agreement(onnx, labels, frames[:10])["map50"]
    assert (agreement >= DeployConfig().gate.min_agreement) is passes, agreement


def test_health_that_cannot_be_read_after_a_promotion_rolls_back(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    host.health_error_after_promote = True
    state = run(deployer, docs.raw("v2", watch_s=30))
    assert state.stage == "rolled_back" and "watch: RuntimeError: telemetry gone" in str(state.reason)
    assert host.serving is host.own and deployer.store.serving(MODEL) is None


def test_deployments_off_refuse_every_document(cfg: DeployConfig, host: fake_host, docs: Docs) -> None:
    off = Deployer(cfg.model_copy(update={"enabled": False}), VersionStore(cfg.state_dir), host)
    answer = off.submit(docs.raw("v2"))
    assert not answer["ok"] and "deploy.enabled: false" in answer["reason"] and host.states == []


def test_a_chain_of_documents_ends_with_the_newest_the_middle_one_never_starts(
    deployer: Deployer, host: fake_host, docs: Docs
) -> None:
    host.frames_gate = threading.Event()
    assert deployer.submit(docs.raw("v2"))["ok"]
    for _ in range(600):
        if host.states and host.states[-1]["stage"] == "gating":
            break
        threading.Event().wait(0.05)
    assert deployer.submit(docs.raw("v3", onnx="v3.onnx"))["reason"] == "supersedes version v2 (cancelled)"
    assert deployer.submit(docs.raw("v4", onnx="v4.onnx"))["reason"] == "supersedes version v3 (cancelled)"
    host.frames_gate.set()
    state = deployer.wait(MODEL, 120)
    assert state is not None and state.stage == "serving" and state.version == "v4", state.reason
    v3 = [(s["stage"], s["reason"]) for s in host.states if s["version"] == "v3"]
    assert v3 == [("failed", "cancelled: superseded by version v4")]
    assert [m.onnx.parent.name for m in host.promoted] == ["v4"]


@pytest.mark.parametrize(
    ("error", "stage"), [(RuntimeError, "rejected"), (OSError, "failed")], ids=["engine", "device"]
)
def test_a_build_error_ends_the_deployment_without_leaking_the_url(
    deployer: Deployer,
    host: fake_host,
    docs: Docs,
    cfg: DeployConfig,
    caplog: pytest.LogCaptureFixture,
    error: type[Exception],
    stage: str,
) -> None:
    doc = docs.make("v2")
    url = doc["artifacts"]["onnx"]["url"]
    host.build_error = error(f"cannot build from {url}")  # an error quoting the URL it was given
    state = run(deployer, json.dumps(doc).encode())
    assert state.stage == stage and str(state.reason).startswith("building: "), state.reason
    assert PASSWORD not in json.dumps(host.states) and PASSWORD not in caplog.text
    assert deployer.store.versions(MODEL) == [] and host.promoted == [] and left_in(cfg.state_dir) == []


def _calibration_archive(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path.name


def test_a_calibration_archive_reaches_the_serving_versions_calibration_folder(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig, frames: list[np.ndarray]
) -> None:
    jpegs = {f"set/f{i}.jpg": cv2.imencode(".jpg", img)[1].tobytes() for i, img in enumerate(frames[:3])}
    name = _calibration_archive(docs.www / "private" / "calib-ok.tar.gz", jpegs)
    arts = {"onnx": docs.art("v2.onnx"), "labels": docs.art("coco.names"), "calibration": docs.art(name)}
    state = run(deployer, json.dumps(docs.make("v2", artifacts=arts)).encode())
    assert state.stage == "serving", state.reason
    calib = cfg.state_dir / "models" / MODEL / "v2" / "calibration"
    assert sorted(p.name for p in calib.iterdir()) == ["f0.jpg", "f1.jpg", "f2.jpg"]
    assert (host.serving.calibration.source, host.serving.calibration.folder) == ("folder", calib)
    assert left_in(cfg.state_dir) == []


def test_a_hostile_calibration_archive_is_rejected_at_verifying_and_nothing_stays(
    deployer: Deployer, host: fake_host, docs: Docs, cfg: DeployConfig
) -> None:
    name = _calibration_archive(docs.www / "private" / "calib-evil.tar.gz", {"../../escape.jpg": b"x"})
    arts = {"onnx": docs.art("v2.onnx"), "labels": docs.art("coco.names"), "calibration": docs.art(name)}
    state = run(deployer, json.dumps(docs.make("v2", artifacts=arts)).encode())
    assert state.stage == "rejected" and "artifacts.calibration" in str(state.reason), state.reason
    assert host.stages()[-2:] == ["verifying", "rejected"] and host.promoted == []
    assert deployer.store.versions(MODEL) == [] and left_in(cfg.state_dir) == []
    assert not list(cfg.state_dir.rglob("escape.jpg"))
