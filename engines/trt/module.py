"""A TensorRT module, what it can do, its logger and plugins: the base every part of TrtApi builds on.

Every TensorRT version/flavour difference lives in this package (engines.trt), found by probing the
imported module (never by comparing version strings elsewhere). The rest of engines/ calls only TrtApi
methods (engines.trt.api: this base plus network, config, timing_cache and runtime). Each probe answers
"does this module have X"; what cannot be done raises UnavailableError("X is not available on
<flavour> <version>"), after Polygraphy's `fail_unavailable`.

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
  when it builds ("Layers:" ..., measured): the logger keeps it (engines.build.layer_info reads it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, cast

from engines.build.layer_info import BUILD_LOG_MARK
from engines.errors import UnavailableError

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


# Modules whose plugins were registered in this process (TrtApi.init_plugins), and how that went.
_PLUGINS_DONE: dict[ModuleType, bool] = {}
# The logger each module's plugin library logs to, for the life of the process: the library keeps only a
# raw pointer to the logger it was registered with (the binding has no keep_alive), and the plugins log on
# every creation and deserialisation, long after the build or load that registered them (as Polygraphy
# does: one process-wide logger). Never released.
_PLUGIN_LOGGERS: dict[ModuleType, Any] = {}


def enum_name(value: Any) -> str:
    """Member name of a TensorRT (pybind11) or Python enum value: "CONVOLUTION", "FLOAT"."""
    name = getattr(value, "name", None)
    return str(name) if name else str(value).split(".")[-1]


class TrtModule:
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
        """UnavailableError unless engines can run through the tensor-address API (TensorRT >= 8.5; every
        TensorRT-RTX): set_tensor_address + execute_async_v3. On a Jetson the floor is JetPack 6 anyway
        (TensorRT 10.3, Python 3.10, CUDA 12: JetPack 5.1's bindings are Python 3.8 and CUDA 11.4)."""
        if not (
            self._has("IExecutionContext", "set_tensor_address")
            and self._has("IExecutionContext", "execute_async_v3")
        ):
            raise UnavailableError(
                f"{self.label} cannot run engines here: the agent needs the tensor-address API "
                "(set_tensor_address, execute_async_v3) of TensorRT >= 8.5 (on a Jetson: JetPack >= 6)"
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

    @property
    def has_engine_inspector(self) -> bool:
        return self._has("ICudaEngine", "create_engine_inspector") and self._has(
            "LayerInformationFormat", "JSON"
        )

    @property
    def has_timing_cache(self) -> bool:
        return self._has("IBuilderConfig", "create_timing_cache") and self._has(
            "IBuilderConfig", "set_timing_cache"
        )

    # --- logging --------------------------------------------------------------------------
    def logger(self, *, keep_errors: bool = True) -> TrtLogger:
        """A TensorRT logger that forwards to Python logging and keeps errors for messages (unless
        `keep_errors` is False: the process-lifetime plugin logger must not grow)."""
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
                    if keep_errors:
                        self.errors.append(msg)
                    log.error("%s", msg)
                elif level == 2:
                    log.warning("%s", msg)
                else:
                    log.debug("%s", msg)

        return CaptureLogger()

    # --- plugins --------------------------------------------------------------------------
    def plugin_logger(self) -> TrtLogger:
        """The one logger this module's plugin library gets, made on first use and kept for the process."""
        if self.mod not in _PLUGIN_LOGGERS:
            _PLUGIN_LOGGERS[self.mod] = self.logger(keep_errors=False)
        return cast("TrtLogger", _PLUGIN_LOGGERS[self.mod])

    def init_plugins(self) -> bool:
        """Register TensorRT's bundled plugins (EfficientNMS_TRT, BatchedNMS_TRT, ...) once per process and
        module, before any parse or deserialisation (as Polygraphy and trtexec do): without it an ONNX with
        plugin ops fails to parse and a plan with plugin layers fails to load in a fresh process. The library
        logs to plugin_logger(), never to a build's or load's own logger (it would outlive it).
        Returns False where the module has no plugin library (TensorRT-RTX) or registration failed."""
        if self.mod in _PLUGINS_DONE:
            return _PLUGINS_DONE[self.mod]
        init = getattr(self.mod, "init_libnvinfer_plugins", None)
        ok = False
        if init is not None:
            try:
                ok = bool(init(self.plugin_logger(), ""))
            except Exception as e:  # a broken plugin library must not stop models that need none
                log.warning("%s: registering the TensorRT plugins failed: %s", self.label, e)
            if not ok:
                log.warning(
                    "%s: init_libnvinfer_plugins failed; plugin layers will not parse or load", self.label
                )
        _PLUGINS_DONE[self.mod] = ok
        return ok
