"""The runtime part of TrtApi: deserialise a plan, read its IO tensors, NVTX verbosity, DLA cores and
a per-layer profiler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.trt.module import TrtModule, enum_name, log


@dataclass(frozen=True)
class IoTensor:
    """One engine IO tensor as the runtime sees it (shape -1 = dynamic)."""

    name: str
    is_input: bool
    shape: tuple[int, ...]
    dtype: np.dtype
    # (min, opt, max) of profile 0 for inputs, None for outputs.
    profile: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None


class RuntimeCalls(TrtModule):
    """Runtime calls, the same on every version (a TrtApi part)."""

    def layer_profiler(self) -> Any | None:
        """An IProfiler that keeps every report_layer_time(layer, ms) in `.times` {layer: [ms, ...]}, in
        call order (once per layer per execution); None where the module has no IProfiler."""
        if not hasattr(self.mod, "IProfiler"):
            return None
        base = self.mod.IProfiler

        class LayerTimes(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                base.__init__(self)  # the pybind11 trampoline needs the base initialised explicitly
                self.times: dict[str, list[float]] = {}

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                self.times.setdefault(layer_name, []).append(float(ms))

        return LayerTimes()

    def num_dla_cores(self) -> int:
        """DLA cores TensorRT sees, asked of a Runtime (the runtime library only: probing with a Builder
        would load the builder library into the daemon). 0 where DLA does not exist or TensorRT fails."""
        if not (self.has_dla and self._has("Runtime", "num_DLA_cores")):
            return 0
        try:
            return int(self.mod.Runtime(self.logger()).num_DLA_cores)
        except Exception:  # no GPU / driver: no DLA either, never a failed probe
            return 0

    def deserialize(self, plan: bytes, logger: Any, dla_core: int | None = None) -> tuple[Any, Any]:
        """(runtime, engine); engine is None when TensorRT refuses the plan (see logger.errors).

        As trtexec does: the bundled plugins are registered first (a plan with plugin layers does not load
        in a fresh process otherwise), and an engine built for DLA core `dla_core` gets that core on the
        runtime (IRuntime::setDLACore) before it is deserialised."""
        self.init_plugins()
        runtime = self.mod.Runtime(logger)
        if dla_core is not None:
            if hasattr(runtime, "DLA_core"):
                runtime.DLA_core = int(dla_core)
            else:
                log.warning("%s: the runtime has no DLA_core; DLA core %d not selected", self.label, dla_core)
        return runtime, runtime.deserialize_cuda_engine(plan)

    # Serving lowers the engine's NVTX verbosity to this (names stay visible in Nsight Systems timelines).
    SERVING_NVTX = "LAYER_NAMES_ONLY"

    def serving_nvtx(self, context: Any, detailed: bool) -> str | None:
        """Set an execution context's NVTX verbosity: DETAILED (as built: `edge-agent profile`) or
        SERVING_NVTX. Engines are built DETAILED for the inspector, and TensorRT's docs say so: "Building
        with DETAILED verbosity will generally increase latency in enqueueV3()"; the context's setting
        cannot exceed the build's and does not change what the engine inspector sees. Returns the level
        now in effect ("detailed", "layer_names_only"), None where TensorRT has no such setting."""
        levels = getattr(self.mod, "ProfilingVerbosity", None)
        wanted = getattr(levels, "DETAILED" if detailed else self.SERVING_NVTX, None)
        if wanted is None or not hasattr(context, "nvtx_verbosity"):
            return None
        context.nvtx_verbosity = wanted
        return enum_name(context.nvtx_verbosity).lower()

    def _nptype(self, trt_dtype: Any) -> np.dtype:
        if hasattr(self.mod, "nptype"):
            dtype: np.dtype = np.dtype(self.mod.nptype(trt_dtype))
            return dtype
        names = {
            "FLOAT": np.float32,
            "HALF": np.float16,
            "INT8": np.int8,
            "INT32": np.int32,
            "INT64": np.int64,
            "BOOL": np.bool_,
            "UINT8": np.uint8,
        }
        return np.dtype(names[str(trt_dtype).split(".")[-1]])

    def io_tensors(self, engine: Any) -> list[IoTensor]:
        if not hasattr(engine, "num_io_tensors"):  # TensorRT < 8.5 only had bindings
            self.fail_unavailable("the named IO tensor API (num_io_tensors)")
        out = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == self.mod.TensorIOMode.INPUT
            profile = None
            if is_input:
                mn, opt, mx = engine.get_tensor_profile_shape(name, 0)
                profile = (tuple(mn), tuple(opt), tuple(mx))
            out.append(
                IoTensor(
                    name,
                    is_input,
                    tuple(engine.get_tensor_shape(name)),
                    self._nptype(engine.get_tensor_dtype(name)),
                    profile,
                )
            )
        return out
