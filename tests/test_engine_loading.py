"""Loading a stored engine the way its manifest says (issue 22), on `fake_tensorrt` plus `fake_cudart`, so
TensorRTBackend.load runs its whole path here, execution slots included:

- the slots own the profile sets the build made (build.profiles_per_context), not a guess from `streams`;
- serving contexts run at NVTX verbosity LAYER_NAMES_ONLY, `edge-agent profile` (set_profiler) at DETAILED;
- a DLA engine's core is set on the runtime before deserialising, plugins are registered first;
- a plan TensorRT refuses is a PlanRefusedError, a CUDA failure while deserialising is not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import fake_tensorrt
import numpy as np
import pytest
from engine_fixtures import gpu_fp, store_engine
from fake_cudart import FakeCudart

from engines.runtimes.base import BackendError, PlanRefusedError
from engines.runtimes.slots import slot_profiles
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

NANODET = Path(__file__).resolve().parent.parent / "agent" / "assets" / "nanodet-m-416.onnx"


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    rt = FakeCudart()
    monkeypatch.setattr("engines.runtimes.slots.import_cudart", lambda: rt)
    return rt


def backend(
    tmp_path: Path,
    mod: ModuleType,
    built_for: int = 1,
    contexts: int = 1,
    dla_core: int | None = None,
    **build: Any,
) -> TensorRTBackend:
    """A backend over an engine stored as a build for `built_for` streams would be."""
    api = TrtApi(mod)
    fp = gpu_fp(api)
    store = EngineStore(tmp_path / "engines")
    # fp16: what DLA runs (the manifest only records it here).
    settings = BuildSettings(onnx=NANODET, contexts=built_for, dla_core=dla_core, precision="fp16")
    m = store_engine(store, "det", settings, fp, **build)
    assert m.key is not None
    return TensorRTBackend(store, "det", m.key, api=api, fingerprint=fp, contexts=contexts)


def slot_sets(b: TensorRTBackend) -> list[list[int]]:
    assert b._pool is not None
    return [[p for p, _lo, _hi in slot.profiles] for slot in b._pool.slots]


# --- B: profile sets per context --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "per_context", "contexts", "expected"),
    [
        # Built for 2 streams (2 profiles each), loaded with 4: 2 slots of 2 profiles, not 4 slots of 1.
        (4, 2, 4, [[0, 1], [2, 3]]),
        (4, 2, 2, [[0, 1], [2, 3]]),
        (4, 2, 1, [[0, 1]]),  # fewer slots than sets: each still owns its full set
        (2, 1, 2, [[0], [1]]),
        (2, 1, 3, [[0], [1]]),
        (3, 3, 2, [[0, 1, 2]]),
        # Older manifests (no field): today's guess.
        (4, None, 4, [[0], [1], [2], [3]]),
        (4, None, 2, [[0, 1], [2, 3]]),
        (3, None, 2, [[0, 1, 2]]),
        # A recorded size the engine contradicts is ignored: the guess again.
        (4, 3, 2, [[0, 1], [2, 3]]),
        (4, 0, 1, [[0, 1, 2, 3]]),
    ],
)
def test_slot_profiles(total: int, per_context: int | None, contexts: int, expected: list[list[int]]) -> None:
    assert slot_profiles(total, per_context, contexts) == expected


def test_slots_follow_the_recorded_profile_sets(
    tmp_path: Path, cudart: FakeCudart, caplog: pytest.LogCaptureFixture
) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 4  # built for 2 streams, 2 profiles per context
    b = backend(tmp_path, mod, built_for=2, contexts=4, profiles_per_context=2)
    with caplog.at_level(logging.WARNING, "engines.runtimes.slots"):
        b.load()
    assert b.slots == 2 and slot_sets(b) == [[0, 1], [2, 3]]
    assert "4 execution contexts configured, but the engine has 2 profile set(s)" in caplog.text
    out = b.infer(np.zeros((2, 3, 416, 416), np.float32))
    assert out["scores"].shape == (2, 3598, 80) and out["boxes"].dtype == np.float16
    b.close()
    assert cudart.live == 0  # every buffer, stream and event freed


def test_slots_of_an_engine_without_the_field_are_guessed_with_a_warning(
    tmp_path: Path, cudart: FakeCudart, caplog: pytest.LogCaptureFixture
) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2
    b = backend(tmp_path, mod, built_for=2, contexts=2, profiles_per_context=None)
    with caplog.at_level(logging.WARNING):
        b.load()
    assert slot_sets(b) == [[0], [1]]
    assert "has no build.profiles_per_context" in caplog.text and "det/" in caplog.text
    b.close()


# --- C: NVTX verbosity ------------------------------------------------------------------------------------
def test_serving_contexts_leave_detailed_nvtx_and_the_profiler_restores_it(
    tmp_path: Path, cudart: FakeCudart
) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.ENGINE_PROFILES = 2
    b = backend(tmp_path, mod, built_for=2, contexts=2)
    b.load()
    contexts = [slot.context for slot in b._pool.slots]  # type: ignore[union-attr]
    assert len(contexts) == 2
    assert all(c.nvtx_verbosity == mod.ProfilingVerbosity.LAYER_NAMES_ONLY for c in contexts)
    assert b.nvtx_verbosity == "layer_names_only"
    b.infer(np.zeros((1, 3, 416, 416), np.float32))
    assert [c[2] for c in mod.calls if c[0] == "execute_async_v3"] == ["LAYER_NAMES_ONLY"]

    profiler = object()
    b.set_profiler(profiler)  # type: ignore[arg-type]
    assert all(
        c.profiler is profiler and c.nvtx_verbosity == mod.ProfilingVerbosity.DETAILED for c in contexts
    )
    assert b.nvtx_verbosity == "detailed"
    b.close()


def test_profiler_never_raises_nvtx_above_the_build(tmp_path: Path, cudart: FakeCudart) -> None:
    """An engine built without DETAILED (older builds, TensorRT without the setting) stays as it is."""
    mod = fake_tensorrt.make("10.3.0")
    b = backend(tmp_path, mod, profiling_verbosity=None)
    b.load()
    b.set_profiler(object())  # type: ignore[arg-type]
    assert (
        b._pool is not None
        and b._pool.slots[0].context.nvtx_verbosity == mod.ProfilingVerbosity.LAYER_NAMES_ONLY
    )
    b.close()


def test_serving_nvtx_where_tensorrt_has_no_such_setting() -> None:
    api = TrtApi(fake_tensorrt.make("10.3.0"))
    assert api.serving_nvtx(object(), detailed=False) is None  # a context without nvtx_verbosity
    del api.mod.ProfilingVerbosity
    context: Any = type("Context", (), {"nvtx_verbosity": 2})()
    assert api.serving_nvtx(context, detailed=False) is None and context.nvtx_verbosity == 2


def test_real_rtx_has_the_nvtx_and_dla_attributes() -> None:
    trt = pytest.importorskip("tensorrt_rtx")
    assert hasattr(trt.ProfilingVerbosity, TrtApi.SERVING_NVTX) and hasattr(
        trt.ProfilingVerbosity, "DETAILED"
    )
    assert isinstance(getattr(trt.IExecutionContext, "nvtx_verbosity", None), property)
    assert isinstance(getattr(trt.Runtime, "DLA_core", None), property)


# --- D: DLA core on the runtime, plugins first -------------------------------------------------------------
def test_dla_engine_gets_its_core_on_the_runtime_and_plugins_come_first(
    tmp_path: Path, cudart: FakeCudart
) -> None:
    mod = fake_tensorrt.make("10.3.0", dla_cores=2)

    def init_plugins(logger: Any, namespace: str) -> bool:
        mod.calls.append(("init_libnvinfer_plugins", namespace))
        return True

    mod.init_libnvinfer_plugins = init_plugins
    b = backend(tmp_path, mod, dla_core=1, plan=fake_tensorrt.PLAN_MAGIC + b"dla")
    b.load()
    runtime_calls = [
        c
        for c in mod.calls
        if c[0] in ("init_libnvinfer_plugins", "Runtime.DLA_core", "deserialize_cuda_engine")
    ]
    assert runtime_calls == [
        ("init_libnvinfer_plugins", ""),
        ("Runtime.DLA_core", 1),
        ("deserialize_cuda_engine", 1),
    ]
    b.close()
    # A GPU engine: no core set; plugins are registered once per process and module.
    mod.calls.clear()
    b = backend(tmp_path / "gpu", mod)
    b.load()
    assert [c for c in mod.calls if c[0] != "execute_async_v3"] == [("deserialize_cuda_engine", -1)]
    b.close()


# --- A (the runtime's part): refused plan vs. this device ------------------------------------------------
def test_a_refused_plan_is_a_plan_refused_error(tmp_path: Path, cudart: FakeCudart) -> None:
    mod = fake_tensorrt.make("10.3.0")
    mod.refuse_loads = 1
    b = backend(tmp_path, mod)
    with pytest.raises(
        PlanRefusedError, match=r"tensorrt: TensorRT refused .*det/.*\.plan: .*please rebuild"
    ) as e:
        b.load()
    assert e.value.reason == mod.refusal and e.value.plan == b.plan_path
    assert not b.loaded
    b.load()  # the next plan is accepted (the fake refuses `refuse_loads` times)
    assert b.loaded
    b.close()


def test_a_cuda_failure_while_deserialising_is_not_a_refused_plan(tmp_path: Path, cudart: FakeCudart) -> None:
    """TensorRT-RTX 1.7 without a driver, measured: the device cannot run it, a rebuild would not help."""
    mod = fake_tensorrt.make("10.3.0")
    mod.refuse_loads = 1
    mod.refusal = (
        "IRuntime::deserializeCudaEngine: Error Code 1: Cuda Runtime (In ScopedCudaStream at "
        "cudaResources.cpp:25 (cudaError 35: CUDA driver version is insufficient for CUDA runtime version))"
    )
    with pytest.raises(BackendError, match="cudaError 35") as e:
        backend(tmp_path, mod).load()
    assert not isinstance(e.value, PlanRefusedError)
