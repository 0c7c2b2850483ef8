"""Build a TensorRT / TensorRT-RTX engine from ONNX and store it with its manifest.

    result = build(store, "detector", settings, agent_version="0.1.0", on_progress=cb)
    result.built        # False: the stored engine already fits ("nothing to do"), unless force=True
    result.plan_path, result.manifest, result.build_s, result.message

Steps (Polygraphy-style, each a small function): lock -> clean stale temps -> check -> prepare the
precision -> parse -> configure (INT8: engines.build.int8) -> build_serialized_network -> save timing
cache -> store. The builder takes fp32/fp16/int8 only; `best` is the agent's accuracy gate's to resolve.
A failure raises BuildError/UnavailableError and leaves the store as it was.
on_progress(phase, step, total) gets coarse phases (parse/build/serialize/save) from this module and,
where the module has IProgressMonitor, TensorRT's own phases in between.
Engines are built with ProfilingVerbosity.DETAILED where it exists; the manifest records that
(`build.profiling_verbosity`) and how many layers run in which precision (`build.layers`, where this
machine can see it: engines.runtimes.trt_layers.build_layer_summary).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import onnx

from engines.build import islands
from engines.build.calibrator import DEFAULT_QUANTILE, BatchSource, CalibrationCache, npy_batches
from engines.build.compat import BuildSpec, build_spec, check
from engines.build.int8 import Int8Request, configure_int8, finish_int8
from engines.cuda.buffers import Allocator
from engines.errors import BuildError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.manifest import Manifest
from engines.precision import PreparedModel, prepare_model, require_precision
from engines.runtimes.trt_layers import build_layer_summary
from engines.settings import BuildSettings, profiles_from_json
from engines.store import EngineStore
from engines.store.fsutil import atomic_write_bytes
from engines.trt import ProgressCallback, TrtApi, import_trt

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

    from engines.build.calibrator import Calibrator
    from engines.trt.module import TrtLogger

    # build_plan's handle for saving the timing cache: the config that made it, and the cache (None where
    # TensorRT has none).
    TimingCacheHandle = tuple[trt.IBuilderConfig, trt.ITimingCache | None]

log = logging.getLogger("engines.builder")


@dataclass(frozen=True)
class BuildResult:
    built: bool
    key: str
    plan_path: Path
    manifest: Manifest | None
    build_s: float
    message: str
    reasons: list[str] = field(default_factory=list)


def _noop(phase: str, step: int, total: int) -> None:
    pass


def _pin_fp32_islands(api: TrtApi, network: trt.INetworkDefinition) -> int:
    """Weakly typed FP16/INT8 builds choose layer precisions freely: the layers of an FP32 island
    (engines.build.islands; the ONNX parser names layers after their nodes) are pinned to FP32 instead - every
    layer reading a float, comparisons included. Returns how many were pinned (the caller sets the one
    precision-constraint flag). Written to the TensorRT docs, not run here."""
    layers, _ = api.network_layers(network)
    pinned = sum(
        api.constrain_float_layer(network, layer.index) for layer in layers if islands.marked(layer.name)
    )
    if pinned:
        log.info("FP32 island: %d layers pinned to FP32", pinned)
    return pinned


def timing_cache_path(store: EngineStore, fp: Fingerprint) -> Path:
    """One cache per (flavour, version, GPU); a CPU-only AOT build keys on its target CC."""
    gpu = fp.gpu_name or "nogpu"
    raw = f"{fp.trt_flavor}-{fp.trt_version}-{gpu}-sm{fp.compute_capability}"
    return store.timing_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", raw) + ".cache")


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
    api.init_plugins(logger)
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
    api: TrtApi, prepared: PreparedModel, spec: BuildSpec, int8: Int8Request | None
) -> None:
    """Calibrate the graph without its FP32 island (engines.build.islands) into the calibration cache,
    which the full build then reads. The island (decode + NMS: a Loop and BOOL comparisons) is pinned to FP32
    anyway; calibrating through it is wasted work at best and skipped calibration at worst (TensorRT
    7.1-8.0). The engine this pass builds is thrown away."""
    if int8 is None or not prepared.calibrate:
        return
    try:
        parts = islands.split(onnx.load(str(prepared.onnx_path)))
    except islands.IslandError as e:
        raise BuildError(f"INT8 calibration of {prepared.onnx_path}: {e}") from e
    except Exception as e:  # an unreadable file fails the same way in the parser; say it here already
        raise BuildError(f"cannot read ONNX model {prepared.onnx_path}: {e}") from e
    if parts is None:
        return
    logger = api.logger()
    builder = _new_builder(api, logger)
    network, _parser = _parse(api, builder, prepared, logger, parts[0].SerializeToString())
    config, profiles = _base_config(api, builder, spec, logger)
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


def build_plan(
    api: TrtApi,
    prepared: PreparedModel,
    spec: BuildSpec,
    *,
    timing_cache: bytes = b"",
    on_progress: ProgressCallback = _noop,
    int8: Int8Request | None = None,
) -> tuple[bytes, TimingCacheHandle, int, dict[str, Any]]:
    """The TensorRT part: parse, configure, build. Returns (plan, timing cache object, entries loaded,
    what the manifest's build record says of it: profiling_verbosity, layers, tf32, timing cache status,
    int8, dla). `int8` carries a calibrated INT8 build's inputs and receives its results."""
    fp = spec.fingerprint
    if fp.dla_core is not None:
        _refuse_dla(spec, prepared)
    if prepared.calibrate and int8 is not None:
        on_progress("calibrate", 0, 1)
        _calibrate_without_island(api, prepared, spec, int8)
        on_progress("calibrate", 1, 1)
    logger = api.logger()
    builder = _new_builder(api, logger)
    on_progress("parse", 0, 1)
    network, _parser = _parse(api, builder, prepared, logger)
    on_progress("parse", 1, 1)

    config, profiles = _base_config(api, builder, spec, logger)
    # Layer names, types, precisions and tactics for the inspector and `edge-agent profile`. It describes the
    # engine rather than changing what it computes, so it is recorded but not part of the engine key.
    # Serving contexts lower their NVTX verbosity at run time (engines.runtimes.slots).
    verbosity = api.set_profiling_verbosity(config)
    if prepared.builder_flag != "int8":  # INT8 flags come with the calibrator (configure_int8)
        api.set_precision_flag(config, prepared.builder_flag)
    # "fp32" means FP32: without this, Ampere and later (Orin too) run FLOAT convolutions in TF32.
    tf32 = None if prepared.precision != "fp32" else (False if api.disallow_tf32(config) else None)
    dla = None
    if fp.dla_core is not None:
        api.set_dla(builder, config, fp.dla_core)
    # With a GPU build for it (CURRENT); without one, for the target CC (RTX ahead-of-time).
    api.set_target_compute_capability(config, None if fp.has_gpu else fp.compute_capability)
    calibrator: Calibrator | None = None
    if prepared.precision == "int8":
        # Keep `calibrator` referenced until the build returns: TensorRT holds only a raw pointer.
        calibrator = configure_int8(api, network, config, profiles, prepared, spec, int8)
    pinned = _pin_fp32_islands(api, network) if api.weakly_typed and prepared.precision != "fp32" else 0
    kept = int8 is not None and int8.needs_constraints
    if pinned or kept:
        # One flag for both (NvInfer.h: set exactly one of OBEY/PREFER): the INT8 request's, else PREFER.
        flag = api.set_precision_constraints(config, int8.constraints if kept and int8 else "prefer")
        if int8 is not None and flag:
            int8.flags.append(flag)
    if fp.dla_core is not None:
        on_dla, on_gpu = api.dla_placement(network, config)
        if on_dla == 0:
            raise BuildError(
                f"DLA core {fp.dla_core}: no layer of {prepared.onnx_path} can run on DLA; with GPU fallback "
                f"all {on_gpu} layers would run on the GPU (remove engine.dla_core)"
            )
        dla = {"core": fp.dla_core, "layers_on_dla": on_dla, "layers_on_gpu": on_gpu}
        log.info("DLA core %d: %d layers on DLA, %d fall back to the GPU", fp.dla_core, on_dla, on_gpu)
    cache: trt.ITimingCache | None = None
    entries, tc_status = 0, None
    if api.has_timing_cache:
        cache, entries, tc_status = api.attach_timing_cache(config, timing_cache)
    monitor = api.progress_monitor(on_progress)  # None where TensorRT has no IProgressMonitor (< 10)
    if monitor is not None and api.has_progress_monitor:
        # Keep `monitor` referenced until the build returns: TensorRT holds only a raw pointer.
        config.progress_monitor = monitor

    on_progress("build", 0, 1)
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
    on_progress("build", 1, 1)
    on_progress("serialize", 0, 1)
    data = bytes(memoryview(plan))
    on_progress("serialize", 1, 1)
    layers = build_layer_summary(api, data, logger, fp.has_gpu) if verbosity else None
    int8_record = _check_int8_layers(prepared, layers, int8)
    described = {
        "profiling_verbosity": verbosity,
        "layers": layers,
        "tf32": tf32,
        "timing_cache_status": tc_status,
        "int8": int8_record,
        "dla": dla,
    }
    return data, (config, cache), entries, described


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


def _save_timing_cache(api: TrtApi, path: Path, handle: TimingCacheHandle) -> None:
    config, cache = handle
    if cache is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Builds of different models share the cache: merge under a lock so none loses the other's timings.
    with open(path.with_suffix(".lock"), "a+") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        on_disk = path.read_bytes() if path.exists() else b""
        atomic_write_bytes(path, api.merged_timing_cache(config, cache, on_disk))


def _int8_request(
    store: EngineStore,
    model: str,
    settings: BuildSettings,
    spec: BuildSpec,
    prepared: PreparedModel,
    batches: BatchSource | None,
    allocator: Allocator | None,
) -> Int8Request | None:
    """The calibrated-INT8 inputs (None unless this build calibrates), refusing early without data."""
    if not prepared.calibrate:
        return None
    cal = spec.calibration
    assert cal is not None  # build_spec refuses int8 without a calibration record
    if batches is None and settings.calibration_data is not None:
        data = settings.calibration_data
        batches = lambda: npy_batches(data)  # noqa: E731 - re-iterable, opened only if TensorRT asks
    # Identity of the cache: the calibration record plus the ONNX it was computed on.
    cache = CalibrationCache(store.calib_path(model, spec.key), {**cal, "onnx_sha256": spec.onnx_sha256})
    if batches is None and cache.load() is None:
        raise BuildError(
            f"INT8 calibration of model {model!r} needs calibration batches (build(calibration_batches=...) "
            f"or BuildSettings.calibration_data) and there is no reusable calibration cache at {cache.path}"
        )
    return Int8Request(
        method=cal["method"],
        samples=cal["samples"],
        cache=cache,
        batches=batches,
        allocator=allocator,
        quantile=cal.get("quantile", DEFAULT_QUANTILE),
        keep_layers=settings.int8_keep_layers,
        keep_precision=settings.int8_keep_precision,
        constraints=settings.precision_constraints,
    )


def build(
    store: EngineStore,
    model: str,
    settings: BuildSettings,
    *,
    fingerprint: Fingerprint | None = None,
    api: TrtApi | None = None,
    force: bool = False,
    on_progress: ProgressCallback | None = None,
    agent_version: str = "unknown",
    lock_wait_s: float | None = 0.0,
    calibration_batches: BatchSource | None = None,
    device_allocator: Allocator | None = None,
    locked: bool = False,
) -> BuildResult:
    """Build (or confirm) the engine of `model`. See the module docstring.

    Calibrated INT8 (weakly typed TensorRT): `calibration_batches` is an iterable of float32 NCHW arrays
    (or a callable returning one), else settings.calibration_data is read; neither is needed when the
    stored calibration cache matches. `device_allocator` replaces cuda-python's cudaMalloc (tests).
    `locked`: the caller holds the model's build lock (store.lock) for longer than this build - a whole
    job: gate and build - so none is taken here; otherwise it is taken for the build (`lock_wait_s`).
    """
    progress = on_progress or _noop
    api = api or import_trt()
    require_precision(api, settings.precision, f"model {model!r}")  # before check(): clear refusals
    fp = fingerprint or probe_fingerprint(api, target_compute_capability=settings.target_compute_capability)
    with contextlib.nullcontext() if locked else store.lock(model, wait_s=lock_wait_s):
        stale = store.clean_stale(model)
        if stale:
            log.info(
                "removed %d stale files of killed or failed builds: %s", len(stale), [p.name for p in stale]
            )
        reasons: list[str] = []
        if not force:
            result = check(store, model, settings, fp)
            if result.ok:
                assert result.plan_path is not None
                return BuildResult(
                    False,
                    result.key,
                    result.plan_path,
                    result.manifest,
                    0.0,
                    f"engine {result.key} of model {model!r} is up to date; nothing to build "
                    "(use force to rebuild)",
                )
            reasons = result.reasons
        spec = build_spec(settings, fp)
        if not spec.fingerprint.has_gpu and not api.aot_without_gpu:
            raise BuildError(f"{api.label} needs a CUDA GPU to build {model!r}; none is visible")
        prepared = prepare_model(api, settings.onnx, settings.precision, qdq_onnx=settings.qdq_onnx)
        int8 = _int8_request(store, model, settings, spec, prepared, calibration_batches, device_allocator)
        tc_path = timing_cache_path(store, spec.fingerprint)
        tc_data = tc_path.read_bytes() if tc_path.exists() else b""

        t0 = time.monotonic()
        plan, tc_handle, entries, described = build_plan(
            api, prepared, spec, timing_cache=tc_data, on_progress=progress, int8=int8
        )
        build_s = time.monotonic() - t0
        try:
            _save_timing_cache(api, tc_path, tc_handle)
        except OSError as e:
            # Only a cache: the engine matters. A full disk fails the plan write next, with a StoreError.
            log.warning("cannot save timing cache %s: %s", tc_path, e.strerror or e)

        progress("save", 0, 1)
        manifest = Manifest(
            fingerprint=spec.fingerprint.manifest_dict(),
            build={
                "onnx_sha256": spec.onnx_sha256,
                "precision": spec.precision,
                "profiles": spec.profiles,
                # The profile set is repeated once per execution context; the runtime splits by this.
                "profiles_per_context": len(spec.profiles) // settings.contexts,
                "workspace_bytes": spec.workspace_bytes,
                "optimization_level": spec.optimization_level,
                "calibration": spec.calibration
                if int8 is None
                else {**(spec.calibration or {}), "cache_sha256": int8.cache_sha256},
                # hit: the loaded cache really held timings (RTX caches never do: always false there);
                # status: loaded | empty | unreadable | mismatch (TensorRT refused it: started empty).
                "timing_cache": {
                    "path": str(tc_path),
                    "hit": bool(tc_data) and entries != 0 and described["timing_cache_status"] == "loaded",
                    "status": described.pop("timing_cache_status"),
                },
                "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                "build_s": round(build_s, 3),
                "agent_version": agent_version,
                "plan_sha256": hashlib.sha256(plan).hexdigest(),
                **described,
            },
            validation=None,
        )
        stored = store.write(model, spec.key, plan, manifest)
        progress("save", 1, 1)
    why = f" ({'; '.join(reasons)})" if reasons else (" (forced)" if force else "")
    return BuildResult(
        True,
        spec.key,
        store.plan_path_for(model, stored),
        stored,
        build_s,
        f"built engine {spec.key} of model {model!r} in {build_s:.2f} s{why}",
        reasons,
    )
