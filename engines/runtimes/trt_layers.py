"""A TensorRT engine layer by layer: what the engine inspector says about it, and per-layer times.

    text = engine_information(api, engine)           # IEngineInspector JSON, None before TensorRT 8.2
    summary = build_layer_summary(api, plan, logger, has_gpu)   # the manifest's build.layers
    run = profile_engine(backend, batch, iterations)  # IProfiler times joined with the inspector's layers

profile_engine times the engine twice, as trtexec --separateProfileRun does: first without the profiler
(per-layer reporting synchronises after every layer, so a profiled run is slower than serving), giving
`run_ms_p50` and the CUDA-event device time; then a separate profiled run for the per-layer times.
`ProfileRun.timing` says so (method "separate_profile_run").

Written to the TensorRT docs ("Engine Inspector"; IProfiler.report_layer_time, called once per layer for
every execution while a profiler is attached to the execution context): engines cannot execute on this
project's CI (no supported GPU), so `engine_information` and `profile_engine` are type-checked against
tensorrt-stubs and their attributes checked on the real tensorrt_rtx module, not run. What runs here is
`build_layer_summary` without a GPU: TensorRT-RTX's builder log (engines.build.layer_info).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from engines.build.layer_info import (
    EngineLayer,
    layers_from_build_log,
    layers_from_inspector,
    summarize,
)
from engines.runtimes.profiling import WARMUP_RUNS, ProfileError, ProfileRun, layer_timings
from engines.trt import TrtApi

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

log = logging.getLogger(__name__)


class ProfiledBackend(Protocol):
    """What profile_engine needs of a loaded engine (engines.runtimes.tensorrt.TensorRTBackend has it;
    named by this protocol, not imported, because that module imports engine_information from here)."""

    @property
    def precision(self) -> str: ...

    @property
    def plan_path(self) -> str: ...

    @property
    def trt_api(self) -> TrtApi: ...

    def set_profiler(self, profiler: trt.IProfiler) -> None: ...

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def layer_information(self) -> str | None: ...


def engine_information(
    api: TrtApi, engine: trt.ICudaEngine, context: trt.IExecutionContext | None = None
) -> str | None:
    """The inspector's JSON for the whole engine; None where TensorRT has no inspector. With `context`
    (input shapes set) the inspector resolves dynamic dimensions and formats."""
    if not api.has_engine_inspector:
        return None
    inspector = engine.create_engine_inspector()
    if inspector is None:  # TensorRT returns null when it cannot make one (out of host memory)
        log.warning("TensorRT could not create an engine inspector; no layer information")
        return None
    if context is not None:
        inspector.execution_context = context
    fmt = cast("trt.LayerInformationFormat", api.mod.LayerInformationFormat.JSON)
    return inspector.get_engine_information(fmt)


def build_layer_summary(api: TrtApi, plan: bytes, logger: Any, has_gpu: bool) -> dict[str, Any] | None:
    """{total, precisions, source} for the manifest, from what this machine can see of the new engine:
    the builder's DETAILED layer log (TensorRT-RTX), else, with a GPU, the inspector of the deserialised
    plan. None when neither is there. Never fails a build: this is a description, not the engine."""
    try:
        if logger.layers_log:
            layers = layers_from_build_log(logger.layers_log)
            if layers:
                return summarize(layers, "build_log")
        if has_gpu and api.has_engine_inspector:
            _runtime, engine = api.deserialize(plan, logger)
            if engine is not None:
                text = engine_information(api, cast("trt.ICudaEngine", engine))
                if text:
                    return summarize(layers_from_inspector(text), "inspector")
    except Exception as e:  # LayerInfoError, or whatever TensorRT raises: the engine is built and sound
        log.warning("layer summary of the new engine not recorded: %s", e)
    return None


def _layer_info(layers: list[EngineLayer]) -> dict[str, dict[str, Any]]:
    return {
        layer.name: {
            "op_type": layer.type,
            "precision": layer.precision,
            "tactic": layer.tactic,
            "source": layer.onnx_nodes[0] if len(layer.onnx_nodes) == 1 else None,
        }
        for layer in layers
    }


def profile_engine(backend: ProfiledBackend, batch: np.ndarray, iterations: int) -> ProfileRun:
    """Per-layer times of a loaded engine over `iterations` executions of `batch` (after WARMUP_RUNS),
    with each layer's type, precision and tactic from the inspector (as detailed as the build's
    profiling verbosity)."""
    if iterations < 1:
        raise ProfileError(f"iterations must be >= 1, got {iterations}")
    api = backend.trt_api
    profiler = api.layer_profiler()
    if profiler is None:
        api.fail_unavailable("IProfiler")
    run_ms, gpu_ms = _timed_runs(backend, batch, iterations)  # no profiler attached yet
    # The separate profiled run: execution reports each layer's time to the profiler
    # (enqueue_emits_profile defaults to True).
    backend.set_profiler(cast("trt.IProfiler", profiler))
    profiled_ms, _ = _timed_runs(backend, batch, iterations, on_warm=profiler.times.clear)
    text = backend.layer_information()
    layers = layers_from_inspector(text) if text else []
    names = [layer.name for layer in layers]
    return ProfileRun(
        runtime=api.flavor,
        precision=backend.precision,
        model=backend.plan_path,
        iterations=iterations,
        run_ms_p50=_p50(run_ms),
        layers=layer_timings(dict(profiler.times), _layer_info(layers)),
        graph={
            "engine_layers": len(names),
            "not_profiled": [n for n in names if n not in profiler.times],
            "runtime_version": api.version,
        },
        timing={
            "method": "separate_profile_run",  # run_ms_p50 timed without the profiler, layers in a 2nd run
            "gpu_ms_p50": _p50(gpu_ms),
            "profiled_run_ms_p50": _p50(profiled_ms),
        },
    )


def _p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 4) if values else None


def _timed_runs(
    backend: ProfiledBackend, batch: np.ndarray, iterations: int, on_warm: Any = None
) -> tuple[list[float], list[float]]:
    """(wall ms, device ms where the backend measures it) of `iterations` runs after WARMUP_RUNS."""
    for _ in range(WARMUP_RUNS):
        backend.infer(batch)
    if on_warm is not None:
        on_warm()
    wall, device = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        backend.infer(batch)
        wall.append(1000.0 * (time.perf_counter() - t0))
        gpu = getattr(backend, "last_gpu_ms", None)  # CUDA events of the slot (TensorRTBackend)
        if gpu is not None:
            device.append(float(gpu))
    return wall, device
