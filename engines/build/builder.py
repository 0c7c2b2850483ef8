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
machine can see it: engines.runtimes.trt_layers.build_layer_summary). The TensorRT part (parse, configure,
build) is engines.build.trt_plan.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.build.calibrator import DEFAULT_QUANTILE, BatchSource, CalibrationCache, npy_batches
from engines.build.compat import BuildSpec, build_spec, check
from engines.build.int8 import Int8Request
from engines.build.power import jetson_power
from engines.build.trt_plan import build_plan, no_progress
from engines.cuda.buffers import Allocator
from engines.errors import BuildError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.manifest import BuildInfo, Manifest
from engines.precision import PreparedModel, prepare_model, require_precision
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.store.fsutil import atomic_write_bytes
from engines.trt import ProgressCallback, TrtApi, import_trt

if TYPE_CHECKING:
    from engines.build.trt_plan import TimingCacheHandle

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


def timing_cache_path(store: EngineStore, fp: Fingerprint) -> Path:
    """One cache per TensorRT and device (Fingerprint.timing_cache_name)."""
    return store.timing_dir / fp.timing_cache_name()


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
    power_probe: Callable[[Fingerprint], dict[str, Any] | None] = jetson_power,
) -> BuildResult:
    """Build (or confirm) the engine of `model`. See the module docstring.

    Calibrated INT8 (weakly typed TensorRT): `calibration_batches` is an iterable of float32 NCHW arrays
    (or a callable returning one), else settings.calibration_data is read; neither is needed when the
    stored calibration cache matches. `device_allocator` replaces cuda-python's cudaMalloc (tests).
    `locked`: the caller holds the model's build lock (store.lock) for longer than this build - a whole
    job: gate and build - so none is taken here; otherwise it is taken for the build (`lock_wait_s`).
    `power_probe`: the Jetson power mode and clock state recorded as build.jetson (engines.build.power;
    tests inject one).
    """
    progress = on_progress or no_progress
    api = api or import_trt()
    require_precision(api, settings.precision, f"model {model!r}")  # before check(): clear refusals
    fp = fingerprint or probe_fingerprint(api, target_compute_capability=settings.target_compute_capability)
    with contextlib.nullcontext() if locked else store.lock(model, wait_s=lock_wait_s):
        _clean_stale(store, model)
        current, reasons = _check(store, model, settings, fp, force)
        if current is not None:
            return current
        spec = build_spec(settings, fp)
        stored, build_s = _build_and_store(
            store,
            model,
            settings,
            spec,
            api,
            progress,
            agent_version,
            calibration_batches,
            device_allocator,
            power_probe,
        )
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


def _check(
    store: EngineStore, model: str, settings: BuildSettings, fp: Fingerprint, force: bool
) -> tuple[BuildResult | None, list[str]]:
    """The check step (under the lock): the "nothing to do" result where the stored engine fits, else
    None and why it does not (compat.check's reasons; none when forced, which builds without asking)."""
    if force:
        return None, []
    result = check(store, model, settings, fp)
    if not result.ok:
        return None, result.reasons
    assert result.plan_path is not None  # check() names the plan of an engine that fits
    message = f"engine {result.key} of model {model!r} is up to date; nothing to build (--force rebuilds)"
    return BuildResult(False, result.key, result.plan_path, result.manifest, 0.0, message), []


def _clean_stale(store: EngineStore, model: str) -> None:
    stale = store.clean_stale(model)
    if stale:
        log.info("removed %d stale files of killed or failed builds: %s", len(stale), [p.name for p in stale])


def _build_and_store(
    store: EngineStore,
    model: str,
    settings: BuildSettings,
    spec: BuildSpec,
    api: TrtApi,
    progress: ProgressCallback,
    agent_version: str,
    batches: BatchSource | None,
    allocator: Allocator | None,
    power_probe: Callable[[Fingerprint], dict[str, Any] | None] = jetson_power,
) -> tuple[Manifest, float]:
    """The build itself (under the lock): prepare, build the plan, save the timing cache, store the engine.
    Returns (the stored manifest, build seconds)."""
    if not spec.fingerprint.has_gpu and not api.aot_without_gpu:
        raise BuildError(f"{api.label} needs a CUDA GPU to build {model!r}; none is visible")
    prepared = prepare_model(api, settings.onnx, settings.precision, qdq_onnx=settings.qdq_onnx)
    int8 = _int8_request(store, model, settings, spec, prepared, batches, allocator)
    tc_path = timing_cache_path(store, spec.fingerprint)
    tc_data = tc_path.read_bytes() if tc_path.exists() else b""
    jetson = power_probe(spec.fingerprint)  # the power mode and clocks the tactics are timed under

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
    # hit: the loaded cache really held timings (RTX caches never do: always false there);
    # status: loaded | empty | unreadable | mismatch (TensorRT refused it: started empty).
    timing_cache = {
        "path": str(tc_path),
        "hit": bool(tc_data) and entries != 0 and described["timing_cache_status"] == "loaded",
        "status": described.pop("timing_cache_status"),
    }
    if jetson is not None:  # absent off a Jetson
        described["jetson"] = jetson
    manifest = _manifest(settings, spec, int8, timing_cache, plan, build_s, agent_version, described)
    stored = store.write(model, spec.key, plan, manifest)
    progress("save", 1, 1)
    return stored, build_s


def _manifest(
    settings: BuildSettings,
    spec: BuildSpec,
    int8: Int8Request | None,
    timing_cache: dict[str, Any],
    plan: bytes,
    build_s: float,
    agent_version: str,
    described: dict[str, Any],
) -> Manifest:
    """The manifest of the engine just built (DESIGN.md's "Engine store and manifest")."""
    return Manifest(
        fingerprint=spec.fingerprint.manifest_dict(),
        build=BuildInfo.from_dict(
            {
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
                "timing_cache": timing_cache,
                "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                "build_s": round(build_s, 3),
                "agent_version": agent_version,
                "plan_sha256": hashlib.sha256(plan).hexdigest(),
                **described,
                "key": spec.key,
            }
        ),
        validation=None,
    )
