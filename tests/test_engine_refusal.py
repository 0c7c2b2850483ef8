"""A plan TensorRT refuses at load (issue 22, "a plan refused at load stays refused"), through the daemon's
real EngineManager on `fake_tensorrt` (whose Runtime refuses the next `refuse_loads` plans with a TensorRT
patch-mismatch message) and `fake_cudart` (so an accepted plan loads, execution slots and warm-up included).

The jobs are a stand-in for the child process that stores a new plan as the builder would (forced or not),
so what is tested is the lifecycle: the refusal recorded in the manifest (`check` says rebuild), the
published states, one forced rebuild, `failed` without a second one when the rebuilt plan is refused too,
also across a restart, until an operator asks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fake_tensorrt
import pytest
import yaml
from engine_fixtures import gpu_fp, store_engine
from fake_cudart import FakeCudart
from fixtures_agent import wait_until

from agent.config import load_config
from agent.lifecycle.commands import run_check
from agent.lifecycle.job import JobRequest, JobResult
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget
from engines.build.compat import check, refusal_record
from engines.fingerprint import Fingerprint
from engines.manifest import load_manifest
from engines.runtimes.base import Backend
from engines.store import EngineStore
from engines.trt import TrtApi

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = "det"


@dataclass
class FakeHandle:
    """engines.buildproc.ChildProcess as the manager uses it."""

    result: Any

    def wait(self) -> dict[str, Any]:
        return self.result()

    def kill(self) -> None:
        pass


@dataclass
class Daemon:
    """The daemon's side of one model: an EngineManager, what it published and swapped in, its jobs."""

    cfg: Any
    api: TrtApi
    fp: Fingerprint
    states: list[dict[str, Any]] = field(default_factory=list)
    swapped: list[Backend] = field(default_factory=list)
    jobs: list[JobRequest] = field(default_factory=list)
    manager: EngineManager | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def store(self) -> EngineStore:
        return EngineStore(self.cfg.engine_dir)

    @property
    def ctx(self) -> ModelContext:
        return ModelContext.from_config(self.cfg, MODEL)

    def start_job(self, request: JobRequest, on_event: Any) -> FakeHandle:
        with self.lock:
            self.jobs.append(request)
            n = len(self.jobs)
        return FakeHandle(lambda: self._build(request, n))

    def _build(self, request: JobRequest, n: int) -> dict[str, Any]:
        """What the job's builder does: nothing when the stored engine fits (unless forced), else a new
        plan (its bytes differ per build) under the configured key, under the lock the manager holds for
        the whole job and hands down (request.lock_fd)."""
        settings = request.model.build_settings("fp32")
        now = check(self.store, MODEL, settings, self.fp)
        if now.ok and not request.force:
            return JobResult(True, request.precision, "fp32", False, now.key, message="up to date").to_event()
        assert request.lock_fd is not None
        m = store_engine(
            self.store,
            MODEL,
            settings,
            self.fp,
            plan=fake_tensorrt.PLAN_MAGIC + b"build %d" % n,
            lock=False,
        )
        return JobResult(
            True, request.precision, "fp32", True, m.key, str(m.path), 0.01, "built", now.reasons
        ).to_event()

    def open(self) -> Backend:
        self.manager = EngineManager(
            self.cfg,
            lambda _name, state: self.states.append(state),
            self._swap,
            "test",
            watch_interval_s=3600,
        )
        return self.manager.open(MODEL)

    def _swap(self, _name: str, backend: Backend) -> None:
        self.swapped.append(backend)

    def settle(self, state: str, jobs: int) -> None:
        """Wait for `state` after `jobs` jobs, and a moment longer for a job that should not come."""
        assert wait_until(lambda: self.last["state"] == state and len(self.jobs) == jobs, 10), (
            self.sequence,
            self.jobs,
        )
        time.sleep(0.2)
        assert self.last["state"] == state and len(self.jobs) == jobs, (self.sequence, self.jobs)

    @property
    def last(self) -> dict[str, Any]:
        return self.states[-1]

    @property
    def sequence(self) -> list[str]:
        """The published states, consecutive repeats folded."""
        out: list[str] = []
        for s in self.states:
            if not out or out[-1] != s["state"]:
                out.append(s["state"])
        return out

    def manifest(self) -> dict[str, Any]:
        m = self.store.manifest(MODEL, self.key)
        assert m is not None
        return m.build.to_dict()

    @property
    def key(self) -> str:
        return check(self.store, MODEL, self.ctx.build_settings("fp32"), self.fp).key

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        for b in self.swapped:
            b.close()


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "agent.yaml"
    data = {
        "device_id": "refusal",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            MODEL: {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "tensorrt",
                "precision": "fp32",
                "streams": 2,
            }
        },
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": MODEL}},
        "mqtt": {"enabled": False},
    }
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    config = write_config(tmp_path)
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2  # the profile set once per stream
    api = TrtApi(mod)
    d = Daemon(load_config(config), api, gpu_fp(api))
    target = EngineTarget(api, d.fp)
    monkeypatch.setattr("agent.lifecycle.manager.engine_target", lambda _ctx: target)
    monkeypatch.setattr("agent.lifecycle.commands.engine_target", lambda _ctx: target)
    monkeypatch.setattr("agent.lifecycle.runner.start_job", d.start_job)
    cudart = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: cudart)
    yield d
    d.close()


def refused_reason(d: Daemon) -> str:
    return f"TensorRT refused this plan at load: {d.api.mod.refusal}"


def test_plan_refused_at_start_is_recorded_and_rebuilt_once(daemon: Daemon) -> None:
    store_engine(
        daemon.store,
        MODEL,
        daemon.ctx.build_settings("fp32"),
        daemon.fp,
        plan=fake_tensorrt.PLAN_MAGIC + b"v1",
    )
    first = daemon.manifest()
    daemon.api.mod.refuse_loads = 1
    served = daemon.open()
    assert served.name == "onnxruntime"
    served.close()
    # Refused: the manifest says so, for `check` and the next start, before anything is rebuilt.
    record = daemon.manifest()["refused_at_load"]
    assert record["error"] == daemon.api.mod.refusal and record["refusals"] == 1
    assert record["plan_sha256"] == first["plan_sha256"]
    assert record["fingerprint"] == daemon.fp.manifest_dict()
    result = check(daemon.store, MODEL, daemon.ctx.build_settings("fp32"), daemon.fp)
    assert result.status == "rebuild" and result.reasons == [refused_reason(daemon)]
    assert daemon.sequence == ["checking", "fallback"] and daemon.last["reasons"] == [refused_reason(daemon)]

    daemon.manager.start()  # type: ignore[union-attr]  # the pipeline runs: jobs start
    daemon.settle("ready", jobs=1)
    assert daemon.jobs[0].force is True  # the same key, rebuilt
    assert daemon.sequence == ["checking", "fallback", "building", "ready"]
    assert daemon.last["loaded"] is True and daemon.last["backend"] == "tensorrt"
    assert daemon.last["nvtx_verbosity"] == "layer_names_only"
    assert len(daemon.swapped) == 1 and daemon.swapped[0].slots == 2
    # The rebuilt engine: a new plan, and a manifest without the refusal.
    rebuilt = daemon.manifest()
    assert "refused_at_load" not in rebuilt and rebuilt["plan_sha256"] != first["plan_sha256"]
    assert check(daemon.store, MODEL, daemon.ctx.build_settings("fp32"), daemon.fp).ok


def test_plan_refused_after_a_job_is_rebuilt_and_served(daemon: Daemon) -> None:
    """No engine at start: the job's plan is refused when adopted; the state says so, one forced rebuild."""
    daemon.api.mod.refuse_loads = 1
    daemon.open().close()
    daemon.manager.start()  # type: ignore[union-attr]
    daemon.settle("ready", jobs=2)
    assert [j.force for j in daemon.jobs] == [False, True]
    assert daemon.sequence == ["checking", "fallback", "building", "ready"]
    refused = [
        s for s in daemon.states if s["state"] == "building" and refused_reason(daemon) in s["reasons"]
    ]
    assert refused, daemon.states  # published while the rebuild runs
    assert daemon.last["loaded"] is True and len(daemon.swapped) == 1
    assert "refused_at_load" not in daemon.manifest()


def test_plan_refused_again_after_its_rebuild_fails_without_a_loop(
    daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    store_engine(
        daemon.store,
        MODEL,
        daemon.ctx.build_settings("fp32"),
        daemon.fp,
        plan=fake_tensorrt.PLAN_MAGIC + b"v1",
    )
    daemon.api.mod.refuse_loads = 2
    daemon.open().close()
    daemon.manager.start()  # type: ignore[union-attr]
    daemon.settle("failed", jobs=1)  # one rebuild, none after the second refusal
    assert daemon.sequence == ["checking", "fallback", "building", "failed"]
    assert "refused the plan of engine" in daemon.last["error"] and "twice" in daemon.last["error"]
    assert daemon.last["backend"] == "onnxruntime" and daemon.swapped == []
    record = daemon.manifest()["refused_at_load"]
    assert record["refusals"] == 2
    # `edge-agent check` says so too.
    assert run_check(daemon.cfg, MODEL, as_json=True) == 1
    report = json.loads(capsys.readouterr().out)["models"][MODEL]
    assert report["status"] == "rebuild"
    assert report["reasons"] == [
        f"TensorRT refused this plan at load (2 plans in a row): {daemon.api.mod.refusal}"
    ]

    # A restart: still failed, no job (the record stands while the device is the same).
    daemon.manager.close()  # type: ignore[union-attr]
    daemon.states.clear()
    daemon.open().close()
    daemon.manager.start()  # type: ignore[union-attr]
    daemon.settle("failed", jobs=1)
    assert daemon.sequence == ["checking", "failed"] and "twice" in daemon.last["error"]

    # The operator asks (TensorRT fixed meanwhile): rebuilt and served.
    assert daemon.manager.rebuild(MODEL, force=True)  # type: ignore[union-attr]
    daemon.settle("ready", jobs=2)
    assert daemon.sequence == ["checking", "failed", "building", "ready"] and daemon.last["loaded"] is True
    assert "refused_at_load" not in daemon.manifest()


@pytest.mark.parametrize("why", ["no GPU", "CUDA failure"])
def test_cannot_run_here_is_not_a_refused_plan(
    daemon: Daemon, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fallback` (ONNX Runtime serves: issue 36.2), `loaded: false` with the reason, no rebuild, nothing
    recorded."""
    if why == "no GPU":
        daemon.fp = gpu_fp(daemon.api, gpu=None)
        target = EngineTarget(daemon.api, daemon.fp)
        monkeypatch.setattr("agent.lifecycle.manager.engine_target", lambda _ctx: target)
    else:
        daemon.api.mod.refuse_loads = 1
        daemon.api.mod.refusal = (
            "IRuntime::deserializeCudaEngine: Error Code 2: OutOfMemory (no further information)"
        )
    store_engine(daemon.store, MODEL, daemon.ctx.build_settings("fp32"), daemon.fp)
    daemon.open().close()
    daemon.manager.start()  # type: ignore[union-attr]
    daemon.settle("fallback", jobs=0)
    assert daemon.sequence == ["checking", "fallback"] and daemon.last["loaded"] is False
    assert (daemon.last["backend"], daemon.last["precision"]) == ("onnxruntime", "fp32"), daemon.last
    assert ("no CUDA GPU" if why == "no GPU" else "OutOfMemory") in daemon.last["load_error"]
    assert "refused_at_load" not in daemon.manifest()


# --- the record itself -------------------------------------------------------------------------------------
def test_check_says_rebuild_while_the_refusal_matches_this_device(tmp_path: Path) -> None:
    api = TrtApi(fake_tensorrt.make("10.3.0"))
    fp = gpu_fp(api)
    store = EngineStore(tmp_path)
    settings = ModelContext.from_config(load_config(write_config(tmp_path)), MODEL).build_settings("fp32")
    m = store_engine(store, MODEL, settings, fp)
    assert m.key is not None
    sha = m.build.plan_sha256
    assert check(store, MODEL, settings, fp).ok

    with store.lock(MODEL):
        written = store.set_refused_at_load(
            MODEL, m.key, sha, refusal_record(fp, "Version tag does not match", sha)
        )
    assert (
        written is not None and load_manifest(store.manifest_path(MODEL, m.key)).build.refused_at_load["at"]
    )
    result = check(store, MODEL, settings, fp)
    assert result.status == "rebuild"
    assert result.reasons == ["TensorRT refused this plan at load: Version tag does not match"]
    # Another driver (same key fields): the plan gets another chance.
    updated = Fingerprint(**{**fp.manifest_dict(), "cuda_driver": "12.8"})
    assert check(store, MODEL, settings, updated).ok
    # A record of another plan (the manifest was rebuilt meanwhile) is never written.
    with store.lock(MODEL):
        assert store.set_refused_at_load(MODEL, m.key, "0" * 64, refusal_record(fp, "x", "0" * 64)) is None
        store.set_refused_at_load(MODEL, m.key, sha, None)  # cleared
    assert check(store, MODEL, settings, fp).ok
