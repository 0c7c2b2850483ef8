"""The builder-config part of TrtApi: workspace, optimisation level, precision flags, profiles, INT8
calibration, precision constraints, profiling verbosity, DLA, the AOT target and progress."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

from engines.errors import BuildError, UnavailableError
from engines.trt.module import ProgressCallback, TrtModule, log

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt


class BuilderConfigCalls(TrtModule):
    """Builder-config calls, the same on every version (a TrtApi part)."""

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

    def set_dla(self, builder: trt.Builder, config: trt.IBuilderConfig, core: int) -> None:
        """Run on DLA core `core`, with GPU fallback for layers DLA cannot run. The caller refuses what DLA
        cannot run at all (FP32, dynamic shapes) before this (engines.build.trt_plan)."""
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
