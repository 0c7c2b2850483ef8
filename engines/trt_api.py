"""Every TensorRT version/flavour difference, found by probing the imported module (never by
comparing version strings elsewhere).

    api = import_trt()            # tensorrt if importable, else tensorrt_rtx; or import_trt("tensorrt_rtx")
    api = TrtApi(module)          # wrap an already imported module (tests pass `fake_tensorrt`)

The rest of the package calls only TrtApi methods. Each probe answers "does this module have X";
what cannot be done raises UnavailableError("X is not available on <flavour> <version>"), after
Polygraphy's `fail_unavailable`.

Facts behind the probes (TensorRT docs; only the tensorrt_rtx paths run on this project's CI):
- TensorRT <= 9 needs NetworkDefinitionCreationFlag.EXPLICIT_BATCH for ONNX; 10 ignores it; 11 drops it.
- Weak typing (BuilderFlag.FP16/INT8) exists up to TensorRT 10; TensorRT 11 and TensorRT-RTX are strongly
  typed only, so reduced precision must be in the ONNX graph (see engines.precision).
- set_memory_pool_limit appeared in 8.4, max_workspace_size was removed in 10.
- TensorRT-RTX builds ahead of time without a GPU for the compute capabilities set on the config;
  its timing-cache calls are no-ops (kept, and recorded honestly as "no hit").
- INT8 on weakly typed TensorRT (<= 10): BuilderFlag.INT8 (+ FP16 so layers without an INT8 kernel, and
  the layers we keep out of INT8, run in FP16) with an IInt8*Calibrator; per-layer `precision` /
  `set_output_type` are only honoured with PREFER/OBEY_PRECISION_CONSTRAINTS (8.2+; STRICT_TYPES before).
  Dynamic-shape networks calibrate at the kOPT shape of the calibration profile (set_calibration_profile).
- INT8 on strongly typed TensorRT (11, RTX): explicit quantisation only, i.e. a Q/DQ ONNX; no calibrators.
- Layer information: IBuilderConfig.profiling_verbosity (ProfilingVerbosity.DETAILED) and the engine
  inspector (ICudaEngine.create_engine_inspector, LayerInformationFormat.JSON) arrived in TensorRT 8.2;
  IProfiler (report_layer_time) is older. TensorRT-RTX 1.7 also logs the DETAILED layer list at VERBOSE
  when it builds ("Layers:" ..., measured): the logger keeps it (engines.layer_info reads it).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, cast

import numpy as np

from engines.errors import BuildError, UnavailableError
from engines.layer_info import BUILD_LOG_MARK

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    class TrtLogger(trt.ILogger):
        """What TrtApi.logger() returns (its class, CaptureLogger, is made at run time on the module's
        ILogger)."""

        errors: list[str]  # messages logged at ERROR and INTERNAL_ERROR
        layers_log: str | None  # the builder's DETAILED layer list, where it logs one


log = logging.getLogger("engines.trt")

FLAVORS = ("tensorrt", "tensorrt_rtx")
_LABELS = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}

ProgressCallback = Callable[[str, int, int], None]


def flavor_label(flavor: str | None) -> str:
    """Human name of a flavour: "TensorRT" / "TensorRT-RTX"."""
    return _LABELS.get(flavor or "", str(flavor))


def import_trt(flavor: str | None = None) -> TrtApi:
    """Import TensorRT: the given flavour, or `tensorrt` then `tensorrt_rtx` when None."""
    names = [flavor] if flavor else list(FLAVORS)
    problems = []
    for name in names:
        if name not in FLAVORS:
            raise UnavailableError(f"unknown TensorRT flavour {name!r} (expected one of {list(FLAVORS)})")
        try:
            return TrtApi(importlib.import_module(name), name)
        except ImportError as e:
            problems.append(f"{name}: {e}")
    raise UnavailableError("no TensorRT module is importable (" + "; ".join(problems) + ")")


@dataclass(frozen=True)
class IoTensor:
    """One engine IO tensor as the runtime sees it (shape -1 = dynamic)."""

    name: str
    is_input: bool
    shape: tuple[int, ...]
    dtype: np.dtype
    # (min, opt, max) of profile 0 for inputs, None for outputs.
    profile: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None


_FLOATS = ("FLOAT", "HALF", "BF16")
# Modules whose plugins were registered in this process (TrtApi.init_plugins), and how that went.
_PLUGINS_DONE: dict[ModuleType, bool] = {}


def _enum_name(value: Any) -> str:
    """Member name of a TensorRT (pybind11) or Python enum value: "CONVOLUTION", "FLOAT"."""
    name = getattr(value, "name", None)
    return str(name) if name else str(value).split(".")[-1]


@dataclass(frozen=True)
class LayerInfo:
    """One network layer as plain data (names of its input/output tensors, output dtypes)."""

    index: int
    name: str
    type: str  # LayerType member name: "CONVOLUTION", "ACTIVATION", ...
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    output_dtypes: tuple[str, ...]  # DataType member names: "FLOAT", "HALF", "INT32", ...


class TrtApi:
    """A TensorRT module plus probes of what it can do."""

    def __init__(self, module: ModuleType, flavor: str | None = None) -> None:
        self.mod = module
        name = flavor or module.__name__.split(".")[0]
        # Fakes and renamed imports: a module with ComputeCapability is an RTX-style (AOT) builder.
        if name not in FLAVORS:
            name = "tensorrt_rtx" if hasattr(module, "ComputeCapability") else "tensorrt"
        self.flavor: str = name
        self.version: str = str(getattr(module, "__version__", "unknown"))

    # --- identity -------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return f"{flavor_label(self.flavor)} {self.version}"

    def fail_unavailable(self, what: str) -> NoReturn:
        raise UnavailableError(f"{what} is not available on {self.flavor} {self.version}")

    # --- probes ---------------------------------------------------------------------------
    def _has(self, obj_name: str, attr: str) -> bool:
        return hasattr(getattr(self.mod, obj_name, None), attr)

    def require_execution(self) -> None:
        """UnavailableError unless engines can run through the tensor-address API (TensorRT >= 8.5,
        JetPack >= 5.1; every TensorRT-RTX): set_tensor_address + execute_async_v3."""
        if not (
            self._has("IExecutionContext", "set_tensor_address")
            and self._has("IExecutionContext", "execute_async_v3")
        ):
            raise UnavailableError(
                f"{self.label} cannot run engines here: the agent needs the tensor-address API "
                "(set_tensor_address, execute_async_v3) of TensorRT >= 8.5 (JetPack >= 5.1)"
            )

    @property
    def weakly_typed(self) -> bool:
        """True where the builder chooses precisions from flags (FP16 flag exists: TensorRT <= 10)."""
        return self._has("BuilderFlag", "FP16")

    @property
    def strongly_typed(self) -> bool:
        """True where networks must carry their precision in the graph (TensorRT 11, TensorRT-RTX)."""
        return not self.weakly_typed

    @property
    def aot_without_gpu(self) -> bool:
        """Builds for a target compute capability without a GPU (TensorRT-RTX)."""
        return self._has("IBuilderConfig", "set_compute_capability") and self._has(
            "ComputeCapability", "NONE"
        )

    @property
    def has_progress_monitor(self) -> bool:
        return hasattr(self.mod, "IProgressMonitor") and self._has("IBuilderConfig", "progress_monitor")

    @property
    def has_dla(self) -> bool:
        return self._has("DeviceType", "DLA") and self._has("IBuilderConfig", "DLA_core")

    @property
    def has_int8_calibration(self) -> bool:
        """Implicit (calibrated) INT8: weakly typed, INT8 flag, calibrator base classes (TensorRT <= 10)."""
        return (
            self.weakly_typed
            and self._has("BuilderFlag", "INT8")
            and hasattr(self.mod, "IInt8EntropyCalibrator2")
            and self._has("IBuilderConfig", "int8_calibrator")
        )

    @property
    def has_explicit_quantization(self) -> bool:
        """Q/DQ networks: the parser makes IQuantize/IDequantize layers (TensorRT >= 8, RTX)."""
        return self._has("LayerType", "DEQUANTIZE") and self._has("DataType", "INT8")

    def precisions(self) -> list[str]:
        """Precisions the builder accepts here. `best` is never among them: the agent resolves it
        (accuracy gate) to one of these before building."""
        out = ["fp32", "fp16"]
        if self.has_int8_calibration or (self.strongly_typed and self.has_explicit_quantization):
            out.append("int8")
        return out

    # --- logging --------------------------------------------------------------------------
    def logger(self) -> TrtLogger:
        """A TensorRT logger that forwards to Python logging and keeps errors for messages."""
        base = getattr(self.mod, "ILogger", object)
        severity = getattr(self.mod.ILogger, "Severity", None) if hasattr(self.mod, "ILogger") else None

        class CaptureLogger(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                base.__init__(self)
                self.errors: list[str] = []
                self.layers_log: str | None = None  # the builder's DETAILED layer list, where it logs one

            def log(self, sev: Any, msg: str) -> None:
                if msg.startswith(BUILD_LOG_MARK):
                    self.layers_log = msg
                # Severity is an enum ordered INTERNAL_ERROR(0) < ERROR(1) < WARNING(2) < INFO < VERBOSE.
                level = int(sev) if severity is not None else 1
                if level <= 1:
                    self.errors.append(msg)
                    log.error("%s", msg)
                elif level == 2:
                    log.warning("%s", msg)
                else:
                    log.debug("%s", msg)

        return CaptureLogger()

    # --- plugins --------------------------------------------------------------------------
    def init_plugins(self, logger: trt.ILogger) -> bool:
        """Register TensorRT's bundled plugins (EfficientNMS_TRT, BatchedNMS_TRT, ...) once per process and
        module, before any parse or deserialisation (as Polygraphy and trtexec do): without it an ONNX with
        plugin ops fails to parse and a plan with plugin layers fails to load in a fresh process.
        Returns False where the module has no plugin library (TensorRT-RTX) or registration failed."""
        if self.mod in _PLUGINS_DONE:
            return _PLUGINS_DONE[self.mod]
        init = getattr(self.mod, "init_libnvinfer_plugins", None)
        ok = False
        if init is not None:
            try:
                ok = bool(init(logger, ""))
            except Exception as e:  # a broken plugin library must not stop models that need none
                log.warning("%s: registering the TensorRT plugins failed: %s", self.label, e)
            if not ok:
                log.warning(
                    "%s: init_libnvinfer_plugins failed; plugin layers will not parse or load", self.label
                )
        _PLUGINS_DONE[self.mod] = ok
        return ok

    # --- network --------------------------------------------------------------------------
    def network_flags(self) -> int:
        flags = 0
        ndcf: Any = getattr(self.mod, "NetworkDefinitionCreationFlag", None)
        # Required on TensorRT <= 9, ignored (deprecated) on 10, absent on 11 and RTX.
        if hasattr(ndcf, "EXPLICIT_BATCH"):
            flags |= 1 << int(ndcf.EXPLICIT_BATCH)
        # Required where weak typing is gone; the flag itself may be gone too (always strong then).
        if self.strongly_typed and hasattr(ndcf, "STRONGLY_TYPED"):
            flags |= 1 << int(ndcf.STRONGLY_TYPED)
        return flags

    def parser_errors(self, parser: trt.OnnxParser) -> list[str]:
        """Parser errors as text, naming node and op where the parser reports them."""
        out = []
        for i in range(parser.num_errors):
            err = cast("trt.ParserError", parser.get_error(i))
            desc = err.desc() if hasattr(err, "desc") else str(err)
            node = err.node() if hasattr(err, "node") else -1
            parts = []
            # node_name()/node_operator() arrived in TensorRT 10; older parsers only give the index.
            name = err.node_name() if hasattr(err, "node_name") else ""
            op = err.node_operator() if hasattr(err, "node_operator") else ""
            if name or op:
                parts.append(f"node {name or node!s} (op {op or '?'})")
            elif isinstance(node, int) and node >= 0:
                parts.append(f"node #{node}")
            code = err.code() if hasattr(err, "code") else None
            code_s = str(code).split(".")[-1] if code is not None else ""
            out.append(": ".join([*parts, *([code_s] if code_s else []), desc]))
        return out

    # --- builder config -------------------------------------------------------------------
    def set_workspace(self, config: trt.IBuilderConfig, nbytes: int) -> None:
        if hasattr(config, "set_memory_pool_limit") and self._has("MemoryPoolType", "WORKSPACE"):
            config.set_memory_pool_limit(self.mod.MemoryPoolType.WORKSPACE, int(nbytes))
        elif hasattr(config, "max_workspace_size"):  # TensorRT < 8.4
            config.max_workspace_size = int(nbytes)
        else:
            self.fail_unavailable("a workspace limit")

    def set_optimization_level(self, config: trt.IBuilderConfig, level: int) -> None:
        if hasattr(config, "builder_optimization_level"):
            config.builder_optimization_level = int(level)
        elif level != 3:  # 3 is the default where the knob exists; older builders behave like it
            self.fail_unavailable(f"builder optimization level {level}")

    def set_precision_flag(self, config: trt.IBuilderConfig, precision: str) -> None:
        """Weakly typed builders only: allow `precision` kernels (fp32 needs no flag)."""
        if precision == "fp32":
            return
        flag = getattr(getattr(self.mod, "BuilderFlag", None), precision.upper(), None)
        if flag is None or not self.weakly_typed:
            self.fail_unavailable(f"the {precision.upper()} builder flag")
        config.set_flag(flag)

    def disallow_tf32(self, config: trt.IBuilderConfig) -> bool:
        """FP32 that is FP32: TensorRT allows TF32 (10-bit mantissa inner products) for FLOAT tensors by
        default on Ampere and later (Orin included). Returns True where the flag existed and was cleared."""
        flag = getattr(getattr(self.mod, "BuilderFlag", None), "TF32", None)
        if flag is None or not hasattr(config, "clear_flag"):
            return False
        config.clear_flag(flag)
        return True

    # --- optimisation profiles ------------------------------------------------------------
    def add_profile(self, config: trt.IBuilderConfig, profile: trt.IOptimizationProfile, what: str) -> int:
        """Add an optimisation profile; BuildError naming it when TensorRT refuses it (returns -1 for an
        invalid profile: shapes outside the network's dims, min > max, a missing input)."""
        index = config.add_optimization_profile(profile)
        if not isinstance(index, int) or index < 0:
            raise BuildError(
                f"{self.label} refused optimisation profile {what} (add_optimization_profile -> {index})"
            )
        return index

    # --- INT8 -----------------------------------------------------------------------------
    _CALIBRATORS: ClassVar[dict[str, str]] = {
        "entropy": "IInt8EntropyCalibrator2",
        "minmax": "IInt8MinMaxCalibrator",
        "percentile": "IInt8LegacyCalibrator",  # quantile cut-off: the only percentile-style calibrator
    }

    def calibrator_base(self, method: str) -> type[trt.IInt8Calibrator]:
        """The TensorRT calibrator class implementing `method` (entropy | minmax | percentile)."""
        name = self._CALIBRATORS.get(method)
        if name is None:
            raise UnavailableError(
                f"calibration method {method!r} is unknown (expected one of {list(self._CALIBRATORS)})"
            )
        if not self.has_int8_calibration or not hasattr(self.mod, name):
            self.fail_unavailable(f"INT8 calibration with {name} ({method})")
        return cast("type[trt.IInt8Calibrator]", getattr(self.mod, name))

    def set_int8(self, config: trt.IBuilderConfig, calibrator: trt.IInt8Calibrator | None) -> list[str]:
        """Weakly typed: INT8 + FP16 flags (FP16 is where unquantisable/kept layers fall back), and the
        calibrator (None for a Q/DQ network, whose scales are in the graph). Returns the flags set."""
        flags = self.mod.BuilderFlag
        if not self.weakly_typed or not hasattr(flags, "INT8"):
            self.fail_unavailable("the INT8 builder flag")
        config.set_flag(flags.INT8)
        names = ["INT8"]
        if hasattr(flags, "FP16"):
            config.set_flag(flags.FP16)
            names.append("FP16")
        if calibrator is not None:
            config.int8_calibrator = calibrator
        return names

    def set_calibration_profile(self, config: trt.IBuilderConfig, profile: trt.IOptimizationProfile) -> bool:
        """Calibrate dynamic shapes at this profile's kOPT shape (TensorRT >= 7.1); False if unsupported.
        BuildError when TensorRT refuses the profile (it returns False for an invalid one)."""
        if not hasattr(config, "set_calibration_profile"):
            return False
        if config.set_calibration_profile(profile) is False:
            raise BuildError(
                f"{self.label} refused the calibration profile (set_calibration_profile -> False)"
            )
        return True

    _CONSTRAINT_FLAGS = ("OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS")

    def set_precision_constraints(self, config: trt.IBuilderConfig, mode: str) -> str | None:
        """Make per-layer precisions binding: PREFER (warn and fall back when no kernel fits) or OBEY
        (fail the build). Before 8.2 only STRICT_TYPES exists. Exactly one of OBEY/PREFER ends up set
        (NvInfer.h: setting both is an error), so a second call replaces the first. Returns the flag set,
        None if none exists."""
        flags = self.mod.BuilderFlag
        wanted = "OBEY_PRECISION_CONSTRAINTS" if mode == "obey" else "PREFER_PRECISION_CONSTRAINTS"
        for name in (wanted, "STRICT_TYPES"):
            if hasattr(flags, name):
                for other in self._CONSTRAINT_FLAGS:
                    if other != name and hasattr(flags, other) and hasattr(config, "clear_flag"):
                        config.clear_flag(getattr(flags, other))
                config.set_flag(getattr(flags, name))
                return name
        log.warning("%s has no precision-constraint flag: per-layer precisions are hints only", self.label)
        return None

    def network_layers(self, network: trt.INetworkDefinition) -> tuple[list[LayerInfo], list[str]]:
        """(layers in network order, network output tensor names) as plain data for layer selection."""
        layers = []
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            inputs = []
            for j in range(layer.num_inputs):
                t = layer.get_input(j)
                inputs.append(t.name if t is not None else None)
            outputs, dtypes = [], []
            for j in range(layer.num_outputs):
                t = layer.get_output(j)
                outputs.append(t.name)
                dtypes.append(_enum_name(t.dtype))
            layers.append(
                LayerInfo(
                    i,
                    layer.name,
                    _enum_name(layer.type),
                    tuple(inputs),
                    tuple(outputs),
                    tuple(dtypes),
                )
            )
        outs = [network.get_output(i).name for i in range(network.num_outputs)]
        return layers, outs

    def constrain_layer(self, network: trt.INetworkDefinition, index: int, precision: str) -> None:
        """Run layer `index` in `precision` (fp16 | fp32), its float outputs in that type too (integer and
        BOOL outputs, e.g. of shape layers, keep theirs). Weakly typed TensorRT only: strongly typed
        networks carry their precision in the graph."""
        if not self.weakly_typed:
            self.fail_unavailable("per-layer precision constraints")
        dtype = self.mod.DataType.HALF if precision == "fp16" else self.mod.DataType.FLOAT
        layer = network.get_layer(index)
        layer.precision = dtype
        for j in range(layer.num_outputs):
            if _enum_name(layer.get_output(j).dtype) in _FLOATS:
                layer.set_output_type(j, dtype)

    def constrain_float_layer(self, network: trt.INetworkDefinition, index: int) -> bool:
        """Run layer `index` in FP32 where it touches floats. A layer reading a float (a comparison whose
        output is BOOL included: it would otherwise be free to read FP16) computes in FLOAT; only its float
        outputs get an output type (BOOL and integer outputs keep theirs). Returns whether anything was
        constrained (layers on integers or booleans only are left alone)."""
        if not self.weakly_typed:
            self.fail_unavailable("per-layer precision constraints")
        layer = network.get_layer(index)
        reads_float = any(
            (t := layer.get_input(j)) is not None and _enum_name(t.dtype) in _FLOATS
            for j in range(layer.num_inputs)
        )
        floats = [j for j in range(layer.num_outputs) if _enum_name(layer.get_output(j).dtype) in _FLOATS]
        if reads_float or floats:
            layer.precision = self.mod.DataType.FLOAT
        for j in floats:
            layer.set_output_type(j, self.mod.DataType.FLOAT)
        return bool(reads_float or floats)

    def explain_int8_build_failure(self, errors: list[str]) -> str | None:
        """An actionable hint for a failed explicit-quantisation (Q/DQ) build, None when we know none.

        Measured on TensorRT-RTX 1.7.1.116 (CPU AOT, sm86): Q/DQ convolutions build (single convs,
        depthwise, padded; and NanoDet after ONNX Runtime's basic graph optimisation), but the raw tf2onnx
        NanoDet with any Q/DQ fails in the builder with "Internal Error (Assertion count >= 0 failed" in
        weightsPtr.cpp: unfolded constant/shape subgraphs around the quantised layers trip it.
        """
        text = " ".join(errors)
        if self.flavor == "tensorrt_rtx" and "Internal Error" in text:
            return (
                f"{self.label} hit an internal error on this Q/DQ graph; graphs quantised without folding "
                "their constant/shape subgraphs trigger it (fold first, e.g. ONNX Runtime "
                "GraphOptimizationLevel.ORT_ENABLE_BASIC with optimized_model_filepath, then quantise "
                "again), or use precision fp16, or TensorRT (weakly typed, calibrated INT8) on a "
                "Jetson/datacenter GPU"
            )
        return None

    # --- layer information and per-layer times ----------------------------------------------
    def set_profiling_verbosity(self, config: trt.IBuilderConfig) -> str | None:
        """Build with ProfilingVerbosity.DETAILED (layer names, types, precisions and tactics in the engine
        inspector, TensorRT >= 8.2 and RTX). Returns "detailed", or None where the knob does not exist."""
        if not (
            self._has("IBuilderConfig", "profiling_verbosity") and self._has("ProfilingVerbosity", "DETAILED")
        ):
            log.info("%s has no profiling verbosity: the engine records no layer details", self.label)
            return None
        config.profiling_verbosity = self.mod.ProfilingVerbosity.DETAILED
        return "detailed"

    @property
    def has_engine_inspector(self) -> bool:
        return self._has("ICudaEngine", "create_engine_inspector") and self._has(
            "LayerInformationFormat", "JSON"
        )

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

    def set_dla(self, builder: trt.Builder, config: trt.IBuilderConfig, core: int) -> None:
        """Run on DLA core `core`, with GPU fallback for layers DLA cannot run. The caller refuses what DLA
        cannot run at all (FP32, dynamic shapes) before this (engines.builder)."""
        if not self.has_dla:
            self.fail_unavailable("DLA")
        cores = int(getattr(builder, "num_DLA_cores", 0))
        if core >= cores:
            raise UnavailableError(
                f"DLA core {core} requested but {self.flavor} {self.version} reports {cores} DLA cores here"
            )
        config.default_device_type = self.mod.DeviceType.DLA
        config.DLA_core = int(core)
        if not self._has("BuilderFlag", "GPU_FALLBACK"):
            self.fail_unavailable("DLA GPU fallback")
        config.set_flag(self.mod.BuilderFlag.GPU_FALLBACK)

    def dla_placement(self, network: trt.INetworkDefinition, config: trt.IBuilderConfig) -> tuple[int, int]:
        """(layers DLA can run, layers that fall back to the GPU) for a DLA-configured build, from
        IBuilderConfig.can_run_on_DLA per layer: with GPU_FALLBACK every layer may silently go to the GPU."""
        on_dla = sum(1 for i in range(network.num_layers) if config.can_run_on_DLA(network.get_layer(i)))
        return on_dla, network.num_layers - on_dla

    def compute_capabilities(self) -> list[str]:
        """Compute capabilities an AOT builder can target, as "8.6" strings."""
        cc_enum = getattr(self.mod, "ComputeCapability", None)
        out = []
        for name in dir(cc_enum):
            if name.startswith("SM") and name[2:].isdigit():
                digits = name[2:]
                out.append(f"{digits[:-1]}.{digits[-1]}")
        return sorted(out, key=lambda s: tuple(int(p) for p in s.split(".")))

    def set_target_compute_capability(self, config: trt.IBuilderConfig, cc: str | None) -> None:
        """AOT target: `cc` ("8.6"), or None for the GPU present (CURRENT). No-op without AOT support."""
        if not self.aot_without_gpu:
            return
        cc_enum = self.mod.ComputeCapability
        if cc is None:
            value = cc_enum.CURRENT
        else:
            value = getattr(cc_enum, "SM" + cc.replace(".", ""), None)
            if value is None:
                raise UnavailableError(
                    f"compute capability {cc} is not available on {self.flavor} {self.version} "
                    f"(targets: {', '.join(self.compute_capabilities())})"
                )
        # TensorRT-RTX only (aot_without_gpu); TensorRT 10.13 has neither.
        config.num_compute_capabilities = 1  # type: ignore[attr-defined]
        if config.set_compute_capability(value, 0) is False:  # type: ignore[attr-defined]
            raise BuildError(f"{self.label} refused target compute capability {cc or 'CURRENT'}")

    def progress_monitor(self, callback: ProgressCallback) -> Any | None:
        """An IProgressMonitor forwarding phase start/step/finish to callback, or None if absent."""
        if not self.has_progress_monitor:
            return None
        base = self.mod.IProgressMonitor

        class Monitor(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                base.__init__(self)
                self.totals: dict[str, int] = {}
                self.error: BaseException | None = None

            def _emit(self, phase: str, step: int, total: int) -> None:
                # An exception escaping into TensorRT's C++ caller would abort the build obscurely.
                try:
                    callback(phase, step, total)
                except BaseException as e:
                    self.error = e

            def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
                self.totals[phase_name] = int(num_steps)
                self._emit(phase_name, 0, int(num_steps))

            def step_complete(self, phase_name: str, step: int) -> bool:
                self._emit(phase_name, int(step) + 1, self.totals.get(phase_name, 0))
                return self.error is None  # False cancels the build

            def phase_finish(self, phase_name: str) -> None:
                total = self.totals.get(phase_name, 0)
                self._emit(phase_name, total, total)

        return Monitor()

    # --- timing cache ---------------------------------------------------------------------
    @contextmanager
    def _quiet(self) -> Iterator[None]:
        # TensorRT-RTX warns DeprecationWarning on timing-cache calls (no-ops there); the path is kept.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield

    @property
    def has_timing_cache(self) -> bool:
        return self._has("IBuilderConfig", "create_timing_cache") and self._has(
            "IBuilderConfig", "set_timing_cache"
        )

    def attach_timing_cache(
        self, config: trt.IBuilderConfig, data: bytes
    ) -> tuple[trt.ITimingCache, int, str]:
        """Create a cache from `data` (may be empty) and attach it. Returns (cache, entries it holds, status):
        status "loaded" | "empty" | "unreadable" (TensorRT could not read `data`) | "mismatch"
        (set_timing_cache refused it: another TensorRT or device); the last two start from an empty cache,
        which is what is attached then. entries: -1 where TensorRT cannot say."""
        with self._quiet():
            status = "loaded" if data else "empty"
            cache = config.create_timing_cache(data)
            if cache is None:  # unreadable or from another version: start empty
                cache, status = config.create_timing_cache(b""), "unreadable"
            if config.set_timing_cache(cache, False) is False:
                log.warning(
                    "%s refused the saved timing cache (another version or device); starting empty",
                    self.label,
                )
                cache, status = config.create_timing_cache(b""), "mismatch"
                if config.set_timing_cache(cache, False) is False:
                    raise BuildError(
                        f"{self.label} refused even an empty timing cache (set_timing_cache -> False)"
                    )
            return (
                cache,
                (0 if status in ("unreadable", "mismatch") else self.timing_cache_entries(cache)),
                status,
            )

    def timing_cache_entries(self, cache: trt.ITimingCache) -> int:
        # queryKeys (TensorRT >= 10) says whether a cache really holds timings; RTX's holds none.
        if not hasattr(cache, "queryKeys"):
            return -1  # unknown
        with self._quiet():
            try:
                return len(cache.queryKeys())
            except Exception as e:  # the binding raises on caches it cannot enumerate: unknown, not fatal
                log.warning("%s: cannot count timing cache entries: %s", self.label, e)
                return -1

    def merged_timing_cache(
        self, config: trt.IBuilderConfig, cache: trt.ITimingCache, on_disk: bytes
    ) -> bytes:
        """Serialise `cache` merged with what another build saved meanwhile (whose timings are dropped,
        with a warning, when TensorRT cannot combine them: ours are the ones this build measured)."""
        with self._quiet():
            if on_disk:
                other = config.create_timing_cache(on_disk)
                if other is None or cache.combine(other, True) is False:
                    log.warning(
                        "%s: the timing cache on disk could not be merged; keeping this build's", self.label
                    )
            return bytes(memoryview(cache.serialize()))

    # --- runtime --------------------------------------------------------------------------
    def deserialize(self, plan: bytes, logger: Any, dla_core: int | None = None) -> tuple[Any, Any]:
        """(runtime, engine); engine is None when TensorRT refuses the plan (see logger.errors).

        As trtexec does: the bundled plugins are registered first (a plan with plugin layers does not load
        in a fresh process otherwise), and an engine built for DLA core `dla_core` gets that core on the
        runtime (IRuntime::setDLACore) before it is deserialised."""
        self.init_plugins(logger)
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
        return _enum_name(context.nvtx_verbosity).lower()

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
