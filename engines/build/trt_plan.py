"""The TensorRT part of a build: parse the ONNX, configure the builder, build_serialized_network.

    plan, tc_handle, entries, described = build_plan(api, prepared, spec, timing_cache=data, int8=req)

`described` is what the manifest's build record says of the engine: profiling_verbosity, layers (where
this machine can see them: engines.runtimes.trt_layers.build_layer_summary), tf32, the timing cache
status, int8 and dla. A failure raises BuildError/UnavailableError naming the ONNX and TensorRT's words.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import onnx

from engines.build import islands
from engines.build.compat import BuildSpec
from engines.build.int8 import Int8Request, configure_int8, finish_int8
from engines.errors import BuildError
from engines.precision import PreparedModel
from engines.runtimes.trt_layers import build_layer_summary
from engines.settings import profiles_from_json
from engines.trt import ProgressCallback, TrtApi

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.build.calibrator import Calibrator
    from engines.trt.module import TrtLogger

    # build_plan's handle for saving the timing cache: the config that made it, and the cache (None where
    # TensorRT has none).
    TimingCacheHandle = tuple[trt.IBuilderConfig, trt.ITimingCache | None]

log = logging.getLogger("engines.builder")


def no_progress(phase: str, step: int, total: int) -> None:
    """The on_progress of a caller that wants none."""


def _pin_fp32_islands(
    api: TrtApi, network: trt.INetworkDefinition, rest_out: list[str] | None
) -> int:
    """Weakly typed FP16/INT8 builds choose layer precisions freely: the layers of an FP32 island
    (engines.build.islands) are pinned to FP32 instead - every layer reading a float, comparisons included.
    The island is every layer the rest of the graph does not need (islands.island_layers), so the layers
    the parser makes itself are pinned too: the Loop's Recurrence/TripLimit/LoopOutput, broadcasts and
    shape shuffles, the island's constants (an eps of 1e-9 is 0 in FP16). Returns how many were pinned (the
    caller sets the one precision-constraint flag). Written to the TensorRT docs, not run here."""
    layers, _ = api.network_layers(network)
    island = islands.island_layers(layers, rest_out)
    pinned = sum(api.constrain_float_layer(network, index) for index in sorted(island))
    if pinned:
        log.info("FP32 island: %d layers pinned to FP32", pinned)
    return pinned


def _rest_outputs(prepared: PreparedModel) -> list[str] | None:
    """islands.rest_outputs of the graph TensorRT parsed (None: no FP32 island). The graph only: external
    weights stay on disk. A graph onnx cannot read (TensorRT's parser took it) is pinned by layer name."""
    data = prepared.model_bytes
    try:
        model = (
            onnx.load_from_string(data)
            if data is not None
            else onnx.load(str(prepared.onnx_path), load_external_data=False)
        )
    except Exception as e:
        log.warning("FP32 island: cannot read %s (%s); its layers found by name only", prepared.onnx_path, e)
        return None
    return islands.rest_outputs(model)


def _parse(
    api: TrtApi,
    builder: trt.Builder,
    prepared: PreparedModel,
    logger: TrtLogger,
    model_bytes: bytes | None = None,
) -> tuple[trt.INetworkDefinition, trt.OnnxParser]:
    network = builder.create_network(api.network_flags())
    if network is None:
        raise BuildError(f"{api.label} could not create a network: {'; '.join(logger.errors) or 'no reason'}")
    parser = cast("trt.OnnxParser", api.mod.OnnxParser(network, logger))
    data = model_bytes if model_bytes is not None else prepared.model_bytes
    # parse_from_file lets the parser find external weights next to the ONNX file.
    ok = parser.parse(data) if data is not None else parser.parse_from_file(str(prepared.onnx_path))
    if not ok or parser.num_errors:
        errors = api.parser_errors(parser) or logger.errors or ["unknown parser error"]
        raise BuildError(f"cannot parse ONNX model {prepared.onnx_path}: " + "; ".join(errors))
    return network, parser  # the parser must outlive the network (it owns the weights)


def _new_builder(api: TrtApi, logger: TrtLogger) -> trt.Builder:
    # Plugins (EfficientNMS_TRT and friends in YOLO exports) must be registered before the parser meets them.
    api.init_plugins()
    builder = cast("trt.Builder", api.mod.Builder(logger))
    if builder is None:
        raise BuildError(f"{api.label} could not create a builder: {'; '.join(logger.errors) or 'no reason'}")
    return builder


def _base_config(
    api: TrtApi, builder: trt.Builder, spec: BuildSpec, logger: TrtLogger
) -> tuple[trt.IBuilderConfig, list[trt.IOptimizationProfile]]:
    """A builder config with the workspace, optimisation level and every profile of `spec`."""
    config = builder.create_builder_config()
    if config is None:
        raise BuildError(
            f"{api.label} could not create a builder config: {'; '.join(logger.errors) or 'no reason'}"
        )
    api.set_workspace(config, spec.workspace_bytes)
    api.set_optimization_level(config, spec.optimization_level)
    profiles = []
    for i, p in enumerate(profiles_from_json(spec.profiles)):
        profile = builder.create_optimization_profile()
        for name, s in p.items():
            # The stubs take Dims only; TensorRT converts tuples to Dims implicitly (the Dims docs).
            profile.set_shape(name, s.min, s.opt, s.max)  # type: ignore[arg-type]
        desc = ", ".join(f"{n} {list(s.min)}..{list(s.max)}" for n, s in p.items())
        api.add_profile(config, profile, f"{i} ({desc})")
        profiles.append(profile)
    return config, profiles


def _refuse_dla(spec: BuildSpec, prepared: PreparedModel) -> None:
    """What DLA cannot run at all (NVIDIA's DLA docs: FP16/INT8 only, static shapes: min = opt = max);
    the config refuses the same with the key (agent.config), this guards every other caller."""
    core = spec.fingerprint.dla_core
    if prepared.precision == "fp32":
        raise BuildError(
            f"DLA core {core}: DLA runs FP16 and INT8 only, not fp32 (use precision fp16 or int8, or no DLA)"
        )
    for i, p in enumerate(profiles_from_json(spec.profiles)):
        for name, s in p.items():
            if not s.min == s.opt == s.max:
                raise BuildError(
                    f"DLA core {core}: DLA needs static shapes, but profile {i} input {name!r} ranges "
                    f"{list(s.min)}..{list(s.max)} (set batch min = opt = max)"
                )


def _calibrate_without_island(
    api: TrtApi, prepared: PreparedModel, spec: BuildSpec, int8: Int8Request | None, timing_cache: bytes
) -> tuple[trt.ITimingCache, int, str] | None:
    """Calibrate the graph without its FP32 island (engines.build.islands) into the calibration cache,
    which the full build then reads. The island (decode + NMS: a Loop and BOOL comparisons) is pinned to FP32
    anyway; calibrating through it is wasted work at best and skipped calibration at worst (TensorRT
    7.1-8.0). The engine this pass builds is thrown away, so it builds at optimisation level 0 (scales
    come from the activations, not from tactics) with the saved timing cache attached; returns that
    cache (attach_timing_cache's triple) for the full build to share, None where no pre-pass ran."""
    if int8 is None or not prepared.calibrate:
        return None
    try:
        parts = islands.split(onnx.load(str(prepared.onnx_path)))
    except islands.IslandError as e:
        raise BuildError(f"INT8 calibration of {prepared.onnx_path}: {e}") from e
    except Exception as e:  # an unreadable file fails the same way in the parser; say it here already
        raise BuildError(f"cannot read ONNX model {prepared.onnx_path}: {e}") from e
    if parts is None:
        return None
    logger = api.logger()
    builder = _new_builder(api, logger)
    network, _parser = _parse(api, builder, prepared, logger, parts[0].SerializeToString())
    config, profiles = _base_config(api, builder, spec, logger)
    if hasattr(config, "builder_optimization_level"):  # TensorRT >= 8.6: the fastest build
        api.set_optimization_level(config, 0)
    cached = api.attach_timing_cache(config, timing_cache) if api.has_timing_cache else None
    calibrator = configure_int8(api, network, config, profiles, prepared, spec, int8)
    if int8.needs_constraints:
        api.set_precision_constraints(config, int8.constraints)
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        if calibrator is not None:
            calibrator.close()
    finish_int8(calibrator, int8, f"{prepared.onnx_path} without its FP32 island")
    if plan is None:
        raise BuildError(
            f"{api.label} failed to calibrate {prepared.onnx_path} without its FP32 island: "
            + ("; ".join(logger.errors) or "no reason given")
        )
    int8.calibrated_graph = "without_fp32_island"
    log.info("INT8: calibrated %s without its FP32 island (%d batches)", prepared.onnx_path, int8.batches_fed)
    return cached


def build_plan(
    api: TrtApi,
    prepared: PreparedModel,
    spec: BuildSpec,
    *,
    timing_cache: bytes = b"",
    on_progress: ProgressCallback = no_progress,
    int8: Int8Request | None = None,
) -> tuple[bytes, TimingCacheHandle, int, dict[str, Any]]:
    """The TensorRT part: parse, configure, build. Returns (plan, timing cache object, entries loaded,
    what the manifest's build record says of it: profiling_verbosity, layers, tf32, timing cache status,
    int8, dla). `int8` carries a calibrated INT8 build's inputs and receives its results."""
    fp = spec.fingerprint
    if fp.dla_core is not None:
        _refuse_dla(spec, prepared)
    prepass: tuple[trt.ITimingCache, int, str] | None = None
    if prepared.calibrate and int8 is not None:
        on_progress("calibrate", 0, 1)
        prepass = _calibrate_without_island(api, prepared, spec, int8, timing_cache)
        on_progress("calibrate", 1, 1)
    logger = api.logger()
    builder = _new_builder(api, logger)
    on_progress("parse", 0, 1)
    network, _parser = _parse(api, builder, prepared, logger)
    # Where layers get precisions (weakly typed, reduced precision), the FP32 island is found from the graph.
    rest_out = _rest_outputs(prepared) if api.weakly_typed and prepared.precision != "fp32" else None
    on_progress("parse", 1, 1)

    config, profiles = _base_config(api, builder, spec, logger)
    described = _configure(api, builder, network, config, prepared, spec)
    calibrator: Calibrator | None = None
    if prepared.precision == "int8":
        # Keep `calibrator` referenced until the build returns: TensorRT holds only a raw pointer.
        calibrator = configure_int8(api, network, config, profiles, prepared, spec, int8, rest_out)
    _constrain(api, network, config, prepared, int8, rest_out)
    if fp.dla_core is not None:
        described["dla"] = _dla_placement(api, network, config, fp.dla_core, prepared)
    cache: trt.ITimingCache | None = None
    entries = 0
    if api.has_timing_cache and prepass is not None:
        # The pre-pass's cache: the saved timings plus the ones it measured (one cache, two configs).
        cache, entries, described["timing_cache_status"] = prepass
        config.set_timing_cache(cache, False)
    elif api.has_timing_cache:
        cache, entries, described["timing_cache_status"] = api.attach_timing_cache(config, timing_cache)
    monitor = api.progress_monitor(on_progress)  # None where TensorRT has no IProgressMonitor (< 10)
    if monitor is not None and api.has_progress_monitor:
        # Keep `monitor` referenced until the build returns: TensorRT holds only a raw pointer.
        config.progress_monitor = monitor

    on_progress("build", 0, 1)
    plan = _build_serialized(api, builder, network, config, prepared, logger, calibrator, int8, monitor)
    on_progress("build", 1, 1)
    on_progress("serialize", 0, 1)
    data = bytes(memoryview(plan))
    on_progress("serialize", 1, 1)
    layers = build_layer_summary(api, data, logger, fp.has_gpu) if described["profiling_verbosity"] else None
    described["layers"] = layers
    described["int8"] = _check_int8_layers(prepared, layers, int8)
    return data, (config, cache), entries, described


def _configure(
    api: TrtApi,
    builder: trt.Builder,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    prepared: PreparedModel,
    spec: BuildSpec,
) -> dict[str, Any]:
    """Verbosity, the precision flag, TF32, DLA and the target CC on `config`; the start of the manifest's
    build record (build_plan's `described`, in its key order)."""
    fp = spec.fingerprint
    # Layer names, types, precisions and tactics for the inspector and `edge-agent profile`. It describes the
    # engine rather than changing what it computes, so it is recorded but not part of the engine key.
    # Serving contexts lower their NVTX verbosity at run time (engines.runtimes.slots).
    verbosity = api.set_profiling_verbosity(config)
    if prepared.builder_flag != "int8":  # INT8 flags come with the calibrator (configure_int8)
        api.set_precision_flag(config, prepared.builder_flag)
    # "fp32" means FP32: without this, Ampere and later (Orin too) run FLOAT convolutions in TF32.
    tf32 = None if prepared.precision != "fp32" else (False if api.disallow_tf32(config) else None)
    if fp.dla_core is not None:
        api.set_dla(builder, config, fp.dla_core)
    # With a GPU build for it (CURRENT); without one, for the target CC (RTX ahead-of-time).
    api.set_target_compute_capability(config, None if fp.has_gpu else fp.compute_capability)
    return {
        "profiling_verbosity": verbosity,
        "layers": None,
        "tf32": tf32,
        "timing_cache_status": None,
        "int8": None,
        "dla": None,
    }


def _constrain(
    api: TrtApi,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    prepared: PreparedModel,
    int8: Int8Request | None,
    rest_out: list[str] | None,
) -> None:
    """Pin FP32 islands (weakly typed reduced precision) and set the one precision-constraint flag that
    they and the INT8 request's kept layers need."""
    reduced = api.weakly_typed and prepared.precision != "fp32"
    pinned = _pin_fp32_islands(api, network, rest_out) if reduced else 0
    kept = int8 is not None and int8.needs_constraints
    if pinned or kept:
        # One flag for both (NvInfer.h: set exactly one of OBEY/PREFER): the INT8 request's, else PREFER.
        flag = api.set_precision_constraints(config, int8.constraints if kept and int8 else "prefer")
        if int8 is not None and flag:
            int8.flags.append(flag)


def _dla_placement(
    api: TrtApi,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    core: int,
    prepared: PreparedModel,
) -> dict[str, int]:
    """The manifest's build.dla; BuildError when no layer can run on DLA core `core`."""
    on_dla, on_gpu = api.dla_placement(network, config)
    if on_dla == 0:
        raise BuildError(
            f"DLA core {core}: no layer of {prepared.onnx_path} can run on DLA; with GPU fallback "
            f"all {on_gpu} layers would run on the GPU (remove engine.dla_core)"
        )
    log.info("DLA core %d: %d layers on DLA, %d fall back to the GPU", core, on_dla, on_gpu)
    return {"core": core, "layers_on_dla": on_dla, "layers_on_gpu": on_gpu}


def _build_serialized(
    api: TrtApi,
    builder: trt.Builder,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    prepared: PreparedModel,
    logger: TrtLogger,
    calibrator: Calibrator | None,
    int8: Int8Request | None,
    monitor: Any | None,
) -> trt.IHostMemory:
    """build_serialized_network, and every way it can fail named: calibration that failed or never ran,
    a cancelling progress callback, TensorRT's own errors (with a hint for Q/DQ graphs it cannot build)."""
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        if calibrator is not None:
            calibrator.close()  # free the calibration device buffer explicitly, whatever happened
    # Raises BuildError if calibration failed or never happened (TensorRT saw only "end" / skipped it).
    finish_int8(calibrator, int8, str(prepared.onnx_path))
    if monitor is not None and monitor.error is not None:
        raise BuildError(f"build cancelled by the progress callback: {monitor.error}") from monitor.error
    if plan is None:
        raw = "; ".join(logger.errors) or "no reason given (see the TensorRT log)"
        hint = api.explain_int8_build_failure(logger.errors) if prepared.quantized else None
        if hint:
            # The internal error is the cause; CPU-only RTX builds also log benign CUDA-driver errors.
            said = [e for e in logger.errors if "Internal Error" in e] or logger.errors
            raise BuildError(
                f"cannot build the INT8 (Q/DQ) engine from {prepared.onnx_path}: {hint}. "
                f"TensorRT said: {'; '.join(said)}"
            )
        raise BuildError(f"{api.label} failed to build {prepared.onnx_path}: {raw}")
    return plan


def _check_int8_layers(
    prepared: PreparedModel, layers: dict[str, Any] | None, int8: Int8Request | None
) -> dict[str, Any] | None:
    """The manifest's build.int8; BuildError for an "int8" engine in which TensorRT put no INT8 layer
    (the plan's next step is tried instead). Where no layer view exists (TensorRT < 8.2 without a GPU
    inspector) the count is null: calibration was still proven by finish_int8."""
    if prepared.precision != "int8":
        return None
    record: dict[str, Any] = dict(int8.record()) if int8 is not None else {}
    count = None if layers is None else int(layers["precisions"].get("INT8", 0))
    record["int8_layers"] = count
    if layers is not None and count == 0:
        raise BuildError(
            f"the INT8 engine of {prepared.onnx_path} has no INT8 layer ({layers['total']} layers: "
            f"{layers['precisions']}); refused, it would be an FP16/FP32 engine recorded as int8"
        )
    if count is None:
        log.warning(
            "INT8 engine of %s: no layer view here, its INT8 layers cannot be counted", prepared.onnx_path
        )
    return record
