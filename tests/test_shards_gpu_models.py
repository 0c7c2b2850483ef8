"""Two GPU models in one box (issue 25): the supervisor keeps one engine lifecycle per GPU model, each
fingerprinting and building on a GPU of its model, one build at a time; a shard's rebuild request goes to
the lifecycle of its GPU's model; the engine state lists each GPU model's plan. No such box here: the GPU
inventory (NVML) and the TensorRT side are stood in for (fake_*); the routing and the job environment are
the real code's."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from fixtures_agent import wait_until

from agent.config import AgentConfig, parse_config
from agent.lifecycle import manager as manager_mod
from agent.lifecycle import runner as runner_mod
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.roles import SupervisorRole
from agent.lifecycle.serving import EngineTarget, OrtOnly
from agent.shards import engines as shard_engines
from agent.shards.engines import gpu_models
from agent.shards.placement import place
from agent.shards.protocol import RebuildAsked
from agent.shards.sharded import ShardedRuntime
from engines.buildproc import Result
from engines.cuda.gpu_probe import GpuInfo

NAMES = {0: ("NVIDIA L4", "8.9"), 1: ("NVIDIA A2", "8.6"), 2: ("NVIDIA L4", "8.9")}


def fake_info(index: int) -> GpuInfo | None:
    name, cc = NAMES[index]
    return GpuInfo(name=name, compute_capability=cc, source="pynvml")


def cfg_of(gpus: list[int], backend: str = "onnxruntime") -> AgentConfig:
    cams = {f"c{i}": {"url": f"rtsp://h/{i}", "model": "m", "shard": i % len(gpus)} for i in range(6)}
    return parse_config(
        {
            "models": {"m": {"onnx": "m.onnx", "backend": backend}},
            "cameras": cams,
            "pipeline": {"shards": len(gpus), "gpus": gpus},
            "mqtt": {"enabled": False},
        }
    )


def test_gpu_models_names_each_pinned_shard() -> None:
    plan = place(cfg_of([0, 1, 2]))
    assert gpu_models(plan, fake_info) == {
        0: "NVIDIA L4, sm 8.9",
        1: "NVIDIA A2, sm 8.6",
        2: "NVIDIA L4, sm 8.9",
    }
    unpinned = place(
        parse_config(
            {
                "models": {"m": {"onnx": "m.onnx"}},
                "cameras": {"a": {"url": "rtsp://h/a", "model": "m"}},
                "pipeline": {"shards": 1},
            }
        )
    )
    assert gpu_models(unpinned, fake_info) == {0: None}


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_engines, "gpu_models", lambda plan: gpu_models(plan, fake_info))


def test_one_lifecycle_per_gpu_model_and_rebuilds_routed_by_shard(
    fake_nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ShardedRuntime(cfg_of([0, 1, 2]))
    assert sorted(agent.managers, key=str) == ["NVIDIA A2, sm 8.6", "NVIDIA L4, sm 8.9"]
    l4, a2 = agent.managers["NVIDIA L4, sm 8.9"].role, agent.managers["NVIDIA A2, sm 8.6"].role
    assert isinstance(l4, SupervisorRole) and isinstance(a2, SupervisorRole)
    assert l4.gpu == 0 and a2.gpu == 1  # the first GPU of the model
    assert l4.build_gate is not None and l4.build_gate is a2.build_gate  # one build at a time
    assert agent.engines is agent.managers["NVIDIA L4, sm 8.9"]  # shard 0's GPU model
    asked: list[tuple[str | None, str]] = []
    for label, mgr in agent.managers.items():
        monkeypatch.setattr(mgr, "rebuild", lambda m, label=label, **kw: asked.append((label, m)) or True)
        monkeypatch.setattr(type(mgr), "models", property(lambda self: ["m"]))
    agent.shard_message(1, RebuildAsked("m", True, None, ["plan refused"]))
    agent.shard_message(2, RebuildAsked("m", False, None, None))
    assert asked == [("NVIDIA A2, sm 8.6", "m"), ("NVIDIA L4, sm 8.9", "m")]


def test_same_gpu_model_everywhere_keeps_one_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_engines, "gpu_models", lambda plan: gpu_models(plan, lambda i: fake_info(0)))
    agent = ShardedRuntime(cfg_of([0, 1]))
    assert list(agent.managers) == [None]


def test_engine_state_lists_each_gpu_models_plan(fake_nvml: None) -> None:
    from agent.cli.daemon import sharded_device

    cfg = cfg_of([0, 1])
    agent = sharded_device(cfg, place(cfg))
    sent: list[tuple[str, bytes]] = []

    class FakeMqtt:
        def publish(self, topic: str, body: bytes, **_: Any) -> None:
            sent.append((topic, body))

    agent.mqtt = FakeMqtt()  # type: ignore[assignment]
    engines = agent.runtime.shard_engines
    engines.own_state("m", {"state": "ready", "key": "aaa", "precision": "fp16"}, group="NVIDIA L4, sm 8.9")
    engines.own_state("m", {"state": "building", "key": None}, group="NVIDIA A2, sm 8.6")
    import json

    last = json.loads(sent[-1][1])
    assert last["state"] == "ready" and last["key"] == "aaa"  # shard 0's GPU model
    assert last["gpu_models"] == {
        "NVIDIA L4, sm 8.9": {"state": "ready", "key": "aaa", "precision": "fp16"},
        "NVIDIA A2, sm 8.6": {"state": "building", "key": None},
    }


def test_a_lifecycle_of_one_gpu_fingerprints_and_builds_on_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cfg = cfg_of([0, 1], backend="auto").model_copy(update={"engine_dir": tmp_path})
    seen: dict[str, Any] = {}

    def fake_engine_target(ctx: Any, gpu_index: int = 0) -> OrtOnly:
        seen["gpu_index"] = gpu_index
        return OrtOnly("fake: no TensorRT")

    monkeypatch.setattr(manager_mod, "engine_target", fake_engine_target)
    role = SupervisorRole(gpu=1, build_gate=threading.Lock())
    states: list[dict[str, Any]] = []
    mgr = EngineManager(cfg, lambda _m, s: states.append(s), lambda *_: None, "test", role=role)
    mgr.check("m")
    assert seen["gpu_index"] == 1

    class FakeJob:
        def wait(self) -> Result:
            return Result({"ok": False, "error": "fake", "error_type": "Fake", "precision": "fp16"})

    def fake_start_job(request: Any, on_event: Any, env: dict[str, str] | None = None) -> FakeJob:
        seen["env"] = env
        return FakeJob()

    monkeypatch.setattr(runner_mod, "start_job", fake_start_job)
    # A model with an engine to make (an fp32 job needs no frames), as open() registers one on a GPU box.
    caps = SimpleNamespace(precisions=lambda: ["fp32"], strongly_typed=True)
    fp = SimpleNamespace(manifest_dict=lambda: {"gpu": "fake"})
    ctx = SimpleNamespace(name="m", cfg=SimpleNamespace(precision="fp32"))
    me = manager_mod.ModelEngine(ctx, EngineTarget(caps, fp))  # type: ignore[arg-type]
    me.state.update(state="fallback")
    mgr._models["m"] = me
    assert mgr.rebuild("m")
    assert wait_until(lambda: bool(states) and states[-1]["state"] == "failed")
    assert seen["env"] == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert states[-1]["error"] == "fake"
    mgr.close()
