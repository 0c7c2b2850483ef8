"""The engine cache in the daemon's lifecycle where a real GPU would be needed (issue 38 item 1): the daemon's
real EngineManager with the real cache client against a real registry (CNCF Distribution), on `fake_tensorrt`
and `fake_cudart` (no GPU here: a plan that loads and one TensorRT refuses at load need them).

- a pulled plan TensorRT refuses at load: counted as rejected, rebuilt here (forced: no second pull), and
  the cache's copy is never pushed over;
- the registry down: built here, said once however many times the cache is tried; once the registry
  answers again, that is said and the next build is pushed.

The job is a stand-in for the child process (what it stores is what the builder would store).
"""

from __future__ import annotations

import hashlib
import logging
import threading
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
from fixtures_registry import DockerRegistry

from agent.config import load_config
from agent.deploy.signing import generate_keys
from agent.lifecycle.job import JobRequest, JobResult
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget
from agent.telemetry.engine_cache import ENGINE_CACHE
from engines.build.compat import build_spec
from engines.cache.client import EngineCache
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust
from engines.fingerprint import Fingerprint
from engines.runtimes.base import Backend
from engines.store import EngineStore
from engines.trt import TrtApi

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = "det"


@dataclass
class FakeHandle:
    result: Any

    def wait(self) -> dict[str, Any]:
        return self.result()

    def kill(self) -> None:
        pass


@dataclass
class Daemon:
    """One model's EngineManager with the cache configured; what it published; the jobs it started."""

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
    def key(self) -> str:
        settings = ModelContext.from_config(self.cfg, MODEL).build_settings("fp32")
        return build_spec(settings, self.fp).key

    def start_job(self, request: JobRequest, on_event: Any) -> FakeHandle:
        with self.lock:
            self.jobs.append(request)
            n = len(self.jobs)
        return FakeHandle(lambda: self._build(request, n))

    def _build(self, request: JobRequest, n: int) -> dict[str, Any]:
        """The builder's part: a new plan under the configured key (its manifest records the key)."""
        settings = request.model.build_settings("fp32")
        plan = fake_tensorrt.PLAN_MAGIC + b"built here %d" % n
        m = store_engine(self.store, MODEL, settings, self.fp, plan=plan, lock=False, key=self.key)
        return JobResult(True, request.precision, "fp32", True, m.key, str(m.path), 0.01, "built").to_event()

    def start(self) -> None:
        """Open the model (no engine: fallback) and start its job, as the daemon does."""
        self.manager = EngineManager(self.cfg, self._publish, self._swap, "test", watch_interval_s=3600)
        self.manager.open(MODEL).close()
        self.manager.start()

    def _publish(self, _name: str, state: dict[str, Any]) -> None:
        self.states.append(dict(state))

    def _swap(self, _name: str, backend: Backend) -> None:
        self.swapped.append(backend)

    def settled(self, done: Any) -> dict[str, Any]:
        assert wait_until(lambda: bool(self.states) and done(self.last), 20), self.states
        return self.last

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        for b in self.swapped:
            b.close()

    @property
    def last(self) -> dict[str, Any]:
        return self.states[-1] if self.states else {}


def write_config(tmp_path: Path, cache: str, keys: Path) -> Path:
    config = tmp_path / "agent.yaml"
    data = {
        "device_id": "dev",
        "engine_dir": str(tmp_path / "engines"),
        "models": {
            MODEL: {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
                "backend": "tensorrt",
                "precision": "fp32",
            }
        },
        "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": MODEL}},
        "mqtt": {"enabled": False},
        "engines": {
            "cache": cache,
            "signing_key": str(keys / "dev.key"),
            "signing_key_id": "dev",
            "trusted_keys": {"dev": str(keys / "dev.pub"), "builder": str(keys / "builder.pub")},
            "timeout_s": 3,
        },
    }
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for key_id in ("dev", "builder"):
        generate_keys(tmp_path / "keys", key_id)
    return tmp_path / "keys"


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TrtApi, Fingerprint]]:
    """fake TensorRT 10.3 on a fake Orin: every model's target, the job a stand-in, cudart faked."""
    api = TrtApi(fake_tensorrt.make("10.3.0"))
    fp = gpu_fp(api)
    target = EngineTarget(api, fp)
    monkeypatch.setattr("agent.lifecycle.manager.engine_target", lambda _ctx: target)
    cudart = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: cudart)
    ENGINE_CACHE.reset()
    yield api, fp
    ENGINE_CACHE.reset()


def daemon_for(tmp_path: Path, cache: str, keys: Path, gpu: tuple[TrtApi, Fingerprint], mp: Any) -> Daemon:
    d = Daemon(load_config(write_config(tmp_path, cache, keys)), *gpu)
    mp.setattr("agent.lifecycle.runner.start_job", d.start_job)
    return d


def push_from_builder(tmp_path: Path, registry: DockerRegistry, d: Daemon, keys: Path) -> str:
    """Another device's engine of the same key, signed by it, in the registry; its digest."""
    other = EngineStore(tmp_path / "builder-engines")
    settings = ModelContext.from_config(d.cfg, MODEL).build_settings("fp32")
    plan = fake_tensorrt.PLAN_MAGIC + b"from the cache"
    m = store_engine(other, MODEL, settings, d.fp, plan=plan, key=d.key)
    assert m.path is not None
    cache = EngineCache(parse_cache_url(registry.url("site/engines")))
    signer = PlanSigner.from_file(keys / "builder.key", "builder")
    pushed = cache.push(d.key, other.plan_path_for(MODEL, m), m.path, None, signer, "builder")
    assert pushed is not None
    return pushed.digest


def test_a_pulled_plan_tensorrt_refuses_is_built_here_and_never_pushed_over(
    tmp_path: Path,
    registry: DockerRegistry,
    keys: Path,
    fake_gpu: tuple[TrtApi, Fingerprint],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = daemon_for(tmp_path, registry.url("site/engines"), keys, fake_gpu, monkeypatch)
    digest = push_from_builder(tmp_path, registry, d, keys)
    fake_gpu[0].mod.refuse_loads = 1  # the pulled plan: a TensorRT patch the fingerprint cannot tell
    try:
        d.start()
        last = d.settled(lambda s: s["state"] == "ready")
    finally:
        d.close()
    # Pulled first (the job's result: origin cache), refused at load, then built here and served.
    origins = [s.get("origin") for s in d.states if s.get("origin")]
    assert origins[0] == "cache" and origins[-1] == "built", d.states
    assert last["origin"] == "built" and last["loaded"] is True and last["key"] == d.key
    assert last["plan_sha256"] != hashlib.sha256(fake_tensorrt.PLAN_MAGIC + b"from the cache").hexdigest()
    assert [j.force for j in d.jobs] == [True]  # one job: the forced rebuild (the pull was none)
    got = ENGINE_CACHE.snapshot()
    assert (got["hits"], got["rejected"], got["pushes"], got["builds"]) == (1, 1, 0, 1)
    # The cache's copy is as the builder pushed it: not pushed over.
    cache = EngineCache(parse_cache_url(registry.url("site/engines")))
    assert cache.exists(d.key)
    again = cache.pull(d.key, tmp_path / "check", _trust(keys))
    assert again is not None and again.digest == digest and again.builder == "builder"


def test_registry_down_is_said_once_and_its_return_too(
    tmp_path: Path,
    registry: DockerRegistry,
    keys: Path,
    fake_gpu: tuple[TrtApi, Fingerprint],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry.stop()
    d = daemon_for(tmp_path, registry.url("site/engines"), keys, fake_gpu, monkeypatch)
    caplog.set_level(logging.DEBUG, logger="agent.lifecycle.manager")
    try:
        d.start()
        d.settled(lambda s: s["state"] == "ready" and s.get("origin") == "built")
        assert d.manager is not None
        for n in (2, 3):  # forced rebuilds: each tries to push to the registry, still down
            assert wait_until(lambda: d.manager is not None and d.manager.rebuild(MODEL, force=True), 10)
            assert wait_until(lambda n=n: len(d.jobs) == n and d.last.get("state") == "ready", 10)
        warned = _unavailable(caplog)
        assert len(warned) == 1, [r.message for r in caplog.records]
        assert "engine cache is unavailable" in warned[0].message and "building here" in warned[0].message
        assert ENGINE_CACHE.snapshot()["unavailable"] == 1 and ENGINE_CACHE.snapshot()["pushes"] == 0
        registry.start()
        assert wait_until(lambda: d.manager is not None and d.manager.rebuild(MODEL, force=True), 10)
        assert wait_until(lambda: ENGINE_CACHE.snapshot()["pushes"] == 1, 20), caplog.text
    finally:
        d.close()
    assert "engine cache answers again" in caplog.text
    assert len(_unavailable(caplog)) == 1


def _trust(keys: Path) -> PlanTrust:
    return PlanTrust.from_files({"builder": keys / "builder.pub"})


def _unavailable(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and "unavailable" in r.message]


def test_the_compat_check_of_a_pulled_manifest(tmp_path: Path, fake_gpu: tuple[TrtApi, Fingerprint]) -> None:
    """What the agent checks on a pulled manifest before its engine is stored (the client checked digests
    and the signature): the key, this device (another GPU kind is named), the gate of a reduced precision."""
    from agent.lifecycle.shared_cache import compatible, pushable
    from engines.cache.errors import CacheRejected

    api, fp = fake_gpu
    cfg = load_config(write_config(tmp_path, "oci://127.0.0.1:1/site/engines", _keys(tmp_path)))
    ctx = ModelContext.from_config(cfg, MODEL)
    store = EngineStore(tmp_path / "other")
    fp16 = ctx.build_settings("fp16")
    spec = build_spec(fp16, fp)
    gated = {"metric": "map50", "value": 0.97, "threshold": 0.9, "passed": True}
    m = store_engine(store, MODEL, fp16, fp, key=spec.key)
    store.set_validation(MODEL, spec.key, gated)
    assert m.path is not None
    compatible(spec)(m.path)  # fits: nothing raised
    other_gpu = build_spec(fp16, gpu_fp(api, gpu="Xavier", cc="7.2"))
    with pytest.raises(CacheRejected, match=f"of engine {spec.key}, not {other_gpu.key}"):
        compatible(other_gpu)(m.path)  # another key: another device kind's manifest under this tag
    forged = store_engine(store, "forged", fp16, gpu_fp(api, gpu="Xavier", cc="7.2"), key=spec.key)
    assert forged.path is not None
    with pytest.raises(CacheRejected, match="does not fit this device: GPU Xavier"):
        compatible(spec)(forged.path)  # the right key written into another device's manifest
    store.set_validation(MODEL, spec.key, {**gated, "passed": False})
    with pytest.raises(CacheRejected, match="did not pass its accuracy gate"):
        compatible(spec)(m.path)
    done = JobResult(True, "fp16", "fp16", True, spec.key, validation=gated)
    assert pushable(done)
    failed = {**gated, "passed": False}
    assert not pushable(JobResult(True, "fp16", "fp16", True, spec.key, validation=failed))
    assert not pushable(JobResult(True, "fp16", "fp16", False, spec.key))  # up to date: not built here


def _keys(tmp_path: Path) -> Path:
    for key_id in ("dev", "builder"):
        generate_keys(tmp_path / "keys", key_id)
    return tmp_path / "keys"
