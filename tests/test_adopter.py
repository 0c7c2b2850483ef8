"""The serving side of the engine lifecycle on its own (agent.lifecycle.swap): the Adopter loads a built
engine, warms it up and hands it to the worker, or records a refused plan and asks for one rebuild; the
supervisor's Announcer only says an engine is ready.

Real engine store, manifests and TensorRTBackend over `fake_tensorrt` (its Runtime refuses the next
`refuse_loads` plans) and `fake_cudart`: no GPU here. The worker's swap and the rebuild are recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fake_tensorrt
import pytest
import yaml
from engine_fixtures import gpu_fp, store_engine
from fake_cudart import FakeCudart

from agent.config import load_config
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget
from agent.lifecycle.state import ModelEngine, StateBoard
from agent.lifecycle.swap import Adopter, Announcer
from engines.runtimes.base import Backend
from engines.store import EngineStore
from engines.trt import TrtApi

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = "det"


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        config = tmp_path / "agent.yaml"
        model = {
            "onnx": str(ASSETS / "nanodet-m-416.onnx"),
            "format": "nanodet",
            "labels": str(ASSETS / "coco.names"),
            "backend": "tensorrt",
            "precision": "fp32",
        }
        data = {
            "engine_dir": str(tmp_path / "engines"),
            "models": {MODEL: model},
            "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": MODEL}},
            "mqtt": {"enabled": False},
        }
        config.write_text(yaml.safe_dump(data))
        self.api = TrtApi(fake_tensorrt.make("10.3.0"))
        self.fp = gpu_fp(self.api)
        self.ctx = ModelContext.from_config(load_config(config), MODEL)
        self.store = EngineStore(tmp_path / "engines")
        self.states: list[dict[str, Any]] = []
        self.swapped: list[Backend] = []
        self.rebuilds: list[tuple] = []
        self.answer = True  # what the rebuild says: started
        self.board = StateBoard(lambda _name, state: self.states.append(dict(state)))
        self.adopter = Adopter(lambda: self.store, self.board, self.swap, self.rebuild)
        self.me = ModelEngine(self.ctx, EngineTarget(self.api, self.fp))
        self.me.state.update(state="building")
        self.me.requested = "fp32"

    def swap(self, _name: str, backend: Backend) -> None:
        self.swapped.append(backend)

    def rebuild(self, name: str, force: bool, precision: Any, reasons: Any) -> bool:
        self.rebuilds.append((name, force, precision, reasons))
        return self.answer

    def built(self, n: int = 1) -> str:
        """A plan stored under the configured key, as a job leaves it."""
        m = store_engine(
            self.store,
            MODEL,
            self.ctx.build_settings("fp32"),
            self.fp,
            plan=fake_tensorrt.PLAN_MAGIC + b"%d" % n,
        )
        assert m.key is not None
        return m.key

    def refused_at_load(self, key: str) -> dict[str, Any] | None:
        m = self.store.manifest(MODEL, key)
        assert m is not None
        return m.build.refused_at_load

    def close(self) -> None:
        for b in self.swapped:
            b.close()


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    cudart = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: cudart)
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_built_engine_is_loaded_warmed_up_and_swapped_in(rig: Rig) -> None:
    key = rig.built()
    rig.adopter.adopt(rig.me, key)
    assert len(rig.swapped) == 1 and rig.swapped[0].name == "tensorrt"
    last = rig.states[-1]
    assert last["state"] == "ready" and last["key"] == key and last["loaded"] is True
    assert last["plan_sha256"] == rig.store.manifest(MODEL, key).build.plan_sha256  # type: ignore[union-attr]
    assert rig.rebuilds == [] and rig.me.refusals == 0


def test_a_refused_plan_is_recorded_and_rebuilt_once_then_failed(rig: Rig) -> None:
    key = rig.built()
    rig.api.mod.refuse_loads = 1
    rig.adopter.adopt(rig.me, key)
    reason = f"TensorRT refused this plan at load: {rig.api.mod.refusal}"
    assert rig.swapped == [] and rig.rebuilds == [(MODEL, True, "fp32", [reason])]
    record = rig.refused_at_load(key)
    assert record is not None and record["refusals"] == 1 and record["error"] == rig.api.mod.refusal
    # The rebuilt plan refused too: `failed`, recorded, and no second rebuild (no loop).
    key = rig.built(2)
    rig.api.mod.refuse_loads = 1
    rig.adopter.adopt(rig.me, key)
    assert rig.swapped == [] and len(rig.rebuilds) == 1
    assert rig.states[-1]["state"] == "failed" and "refused the plan" in rig.states[-1]["error"]
    record = rig.refused_at_load(key)
    assert record is not None and record["refusals"] == 2


def test_a_rebuild_already_under_way_is_not_a_second_one(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    key = rig.built()
    rig.api.mod.refuse_loads = 1
    rig.answer = False
    rig.adopter.adopt(rig.me, key)
    assert len(rig.rebuilds) == 1 and "no rebuild started (one is under way)" in caplog.text


def test_an_engine_this_device_cannot_run_is_kept_not_rebuilt(rig: Rig) -> None:
    key = rig.built()
    rig.api.mod.refuse_loads = 1
    rig.api.mod.refusal = (
        "IRuntime::deserializeCudaEngine: Error Code 2: OutOfMemory (no further information)"
    )
    rig.adopter.adopt(rig.me, key)
    assert rig.swapped == [] and rig.rebuilds == []
    last = rig.states[-1]
    assert last["state"] == "fallback" and last["loaded"] is False and "OutOfMemory" in last["load_error"]
    assert last["backend"] == "onnxruntime" and "cannot run on this device" in last["reasons"][0]
    assert rig.refused_at_load(key) is None


def test_a_retired_model_gets_no_engine(rig: Rig) -> None:
    key = rig.built()
    rig.me.retired = True  # reloaded away while its job ran
    n = len(rig.states)
    rig.adopter.adopt(rig.me, key)
    assert rig.swapped == [] and len(rig.states) == n  # nothing published for it either


def test_the_announcer_says_ready_and_loads_nothing(rig: Rig) -> None:
    key = rig.built()
    rig.api.mod.refuse_loads = 1  # a load would be refused: the announcer never loads
    announcer = Announcer(lambda: rig.store, rig.board)
    assert announcer.ort(rig.ctx) is None
    announcer.adopt(rig.me, key)
    last = rig.states[-1]
    assert last["state"] == "ready" and last["backend"] == "tensorrt" and last["key"] == key
    assert last["precision"] == "fp32" and "loaded" not in last
    assert rig.api.mod.refuse_loads == 1 and rig.swapped == []


def test_the_announcer_without_a_gpu_says_onnx_runtime_serves(rig: Rig) -> None:
    """Issue 36.2 for the supervisor of shards: an engine no shard can run here is `fallback`, what serves
    (ONNX Runtime, fp32) and why; never `ready` with TensorRT."""
    key = rig.built()
    rig.me.target = EngineTarget(rig.api, gpu_fp(rig.api, gpu=None))
    announcer = Announcer(lambda: rig.store, rig.board)
    for say in (announcer.adopt, announcer.fitting):
        say(rig.me, key)
        last = rig.states[-1]
        assert (last["state"], last["backend"], last["precision"]) == ("fallback", "onnxruntime", "fp32")
        assert last["loaded"] is False and "no CUDA GPU" in last["reasons"][0] and last["key"] == key
