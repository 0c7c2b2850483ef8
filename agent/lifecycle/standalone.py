"""`edge-agent build`: an engine from an ONNX file without agent.yaml (trtexec-like), into an engine store.

    result = build_standalone(StandaloneBuild(onnx=Path("yolo.onnx"), precision="fp16"), progress)
    result.plan, result.manifest                 # {out}/{model}/{key}-{sha[:12]}.plan and {key}.json

The same store layout and manifest as the daemon's builds (engines.build.builder), with the daemon's defaults
for everything the command line does not set (workspace 1024 MiB, optimisation level 3, batch 1, two
execution contexts: `models.M.streams`), so an engine built here for the ONNX file and precision a
config names has the key the daemon looks for. There is no accuracy gate (no labels, no cameras):
`best` keeps the first of int8 -> fp16 -> fp32 that builds and says so; int8 needs `--calib DIR`.

Calibration data (`--calib DIR`): `.npy` files of preprocessed float32 NCHW (or CHW) tensors, used as
they are; or images, preprocessed like inference with the adapter of `--format`. Strongly typed TensorRT
(RTX, 11) builds INT8 from a Q/DQ ONNX made from them (engines.build.quantize, kept under
`{out}/{model}/qdq/`); weakly typed TensorRT (<= 10) calibrates with them. The calibration record
{method, samples, data_id (sha256 of the data)} is part of the engine key.

The model's build lock is held for the whole command (quantisation and build), as for `rebuild`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import EngineConfig, ModelConfig
from agent.lifecycle.calib_folder import CalibData, UsageError, calibration_data
from engines.build.builder import BuildResult, build
from engines.errors import BuildError, EngineError, StoreError, UnavailableError
from engines.fingerprint import probe_fingerprint
from engines.plan import Step, plan_steps
from engines.precision import Precision
from engines.settings import BuildSettings, Profile, Shapes
from engines.store import EngineStore, sha256_file
from engines.store.lock import process_command
from engines.trt import TrtApi, import_trt

Progress = Callable[[str, int, int], None]
# The daemon's defaults, so a build here gets the key a config names (read from the config schema).
DEFAULT_STREAMS: int = ModelConfig.model_fields["streams"].default
DEFAULT_WORKSPACE_MB: int = EngineConfig.model_fields["workspace_mb"].default
_DIMS_RE = re.compile(r"^\d+(x\d+)*$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class StandaloneBuild:
    onnx: Path
    precision: Precision = "fp32"
    shapes: tuple[Profile, ...] | None = None  # one profile (explicit shapes), else from the ONNX
    calib: Path | None = None
    calib_method: str = "minmax"
    format: str | None = None  # images in --calib: preprocess like this model format
    out: Path = Path("engines")
    backend: str | None = None  # tensorrt | tensorrt_rtx | None: whichever is importable
    name: str | None = None
    streams: int = DEFAULT_STREAMS
    workspace_mb: int = DEFAULT_WORKSPACE_MB
    optimization_level: int = 3
    target_compute_capability: str | None = None
    force: bool = False
    wait_s: float | None = 0.0


@dataclass
class StandaloneResult:
    model: str
    key: str
    precision: str
    built: bool
    plan: Path
    manifest: Path
    build_s: float
    message: str
    device: str
    previous: Path | None = None  # the plan this build replaced, kept for rollback
    tried: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "key": self.key,
            "precision": self.precision,
            "built": self.built,
            "plan": str(self.plan),
            "plan_bytes": self.plan.stat().st_size if self.plan.is_file() else None,
            "manifest": str(self.manifest),
            "build_s": self.build_s,
            "message": self.message,
            "device": self.device,
            "previous": None if self.previous is None else str(self.previous),
            "tried": self.tried,
        }


# ---- command-line values ----------------------------------------------------------------------------


def model_name(onnx: Path) -> str:
    """The store directory of an ONNX file: its stem, made a safe directory name."""
    name = _SAFE.sub("-", onnx.stem).strip("-.") or "model"
    return name if name[0].isalnum() else f"m{name}"


def parse_shapes(text: str) -> Profile:
    """`input:1x3x416x416` (static) or `input:1x3x640x640/4x3x640x640/8x3x640x640` (min/opt/max), several
    inputs comma-separated; the name may hold ':' (`input_1:0:1x3x416x416`: split at the last one)."""
    profile: Profile = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, dims = part.rpartition(":")
        sizes = dims.split("/")
        if not sep or not name or len(sizes) not in (1, 3) or not all(_DIMS_RE.match(s) for s in sizes):
            raise UsageError(
                f"--shapes {part!r}: expected NAME:DIMS or NAME:MIN/OPT/MAX with DIMS like 1x3x416x416"
            )
        if name in profile:
            raise UsageError(f"--shapes: input {name!r} given twice")
        shapes = [tuple(int(d) for d in s.split("x")) for s in sizes]
        if any(d < 1 for s in shapes for d in s):
            raise UsageError(f"--shapes {part!r}: every dimension must be at least 1")
        lo, opt, hi = shapes if len(shapes) == 3 else shapes * 3
        profile[name] = Shapes(lo, opt, hi)
    return profile


# ---- calibration data -------------------------------------------------------------------------------


# ---- the build --------------------------------------------------------------------------------------


def _steps(precision: Precision, api: TrtApi, calib: CalibData | None) -> tuple[list[Step], list[str]]:
    """The steps to try and notes on what was left out. `best` walks int8 -> fp16 -> fp32 (int8 only with
    calibration data); an explicit precision is that precision only (int8: the folded Q/DQ graph too)."""
    notes: list[str] = []
    steps = plan_steps(precision, api)
    if precision != "best":
        steps = [s for s in steps if s.precision == precision]
        if not steps:
            raise UnavailableError(
                f"precision {precision!r} is not available on {api.label} (it builds "
                f"{', '.join(api.precisions())})"
            )
    if calib is None and any(s.precision == "int8" for s in steps):
        if precision == "int8":
            raise UsageError("--precision int8 needs --calib DIR (calibration tensors or images)")
        steps = [s for s in steps if s.precision != "int8"]
        notes.append("no --calib DIR (calibration data)")
    return steps, notes


def _settings(req: StandaloneBuild, step: Step) -> BuildSettings:
    return BuildSettings(
        onnx=req.onnx,
        precision=step.precision,
        profiles=req.shapes,
        workspace_bytes=req.workspace_mb << 20,
        optimization_level=req.optimization_level,
        target_compute_capability=req.target_compute_capability,
        contexts=req.streams,
    )


def _int8_settings(
    req: StandaloneBuild,
    step: Step,
    calib: CalibData,
    store: EngineStore,
    model: str,
    progress: Progress | None,
) -> tuple[BuildSettings, Callable[[], Iterator[np.ndarray]] | None]:
    """INT8 settings: a Q/DQ ONNX (strongly typed; made here, cached by its inputs) or the calibrator's
    batches (weakly typed)."""
    record = {"method": req.calib_method, "samples": calib.samples, "data_id": calib.data_id}
    settings = replace(_settings(req, step), calibration=record)
    if step.calibrator:
        return settings, calib.batches
    from engines.build.quantize import RECIPE, make_qdq_onnx

    onnx_sha = sha256_file(req.onnx)
    want = {"source_sha256": onnx_sha, **record, "recipe": RECIPE, "fold": step.folded}
    tag = hashlib.sha256(json.dumps(want, sort_keys=True).encode()).hexdigest()[:16]
    qdq = (
        store.model_dir(model)
        / "qdq"
        / f"int8-{req.calib_method}{'-folded' if step.folded else ''}-{tag}.onnx"
    )
    meta = qdq.with_suffix(".json")
    try:
        cached = json.loads(meta.read_text()) if meta.is_file() and qdq.is_file() else None
    except (OSError, ValueError):
        cached = None
    if not (isinstance(cached, dict) and cached.get("sha256") == sha256_file(qdq)):
        qdq.parent.mkdir(parents=True, exist_ok=True)
        batches = _counted(calib.batches(), f"quantize {step.label}: calibrate", calib.samples, progress)
        info = make_qdq_onnx(req.onnx, qdq, batches, req.calib_method, fold=step.folded)  # type: ignore[arg-type]
        from engines.store.fsutil import atomic_write_bytes

        atomic_write_bytes(meta, (json.dumps({"inputs": want, **info}, indent=2) + "\n").encode())
    return replace(settings, qdq_onnx=qdq), None


def _counted(
    batches: Iterator[np.ndarray], phase: str, total: int, progress: Progress | None
) -> Iterator[np.ndarray]:
    done = 0
    if progress:
        progress(phase, 0, total)
    for batch in batches:
        yield batch
        done += int(batch.shape[0]) if batch.ndim == 4 else 1
        if progress:
            progress(phase, min(done, total), total)


def build_standalone(
    req: StandaloneBuild, progress: Progress | None = None, version: str = "unknown"
) -> StandaloneResult:
    """Build (or find up to date) the engine `req` asks for. Raises EngineError (UsageError for bad
    values) naming the option, file or path."""
    onnx = req.onnx
    if not onnx.is_file():
        raise UsageError(f"--onnx {onnx}: " + ("is not a file" if onnx.exists() else "does not exist"))
    model = req.name or model_name(onnx)
    api = import_trt(req.backend)
    calib = None if req.calib is None else calibration_data(req.calib, req.format, onnx)
    steps, notes = _steps(req.precision, api, calib)
    try:
        store = EngineStore(req.out)
    except StoreError as e:
        raise UsageError(f"--out {req.out}: {e}") from None
    fp = probe_fingerprint(api, target_compute_capability=req.target_compute_capability)
    # Left out before building (no calibration data): "skipped"; a step that failed has only its reason.
    tried: list[dict[str, Any]] = [
        {"precision": "int8", "built": False, "reason": n, "skipped": True} for n in notes
    ]
    command = f"{process_command()} [edge-agent build: model {model}, precision {req.precision}]"
    with store.lock(model, wait_s=req.wait_s, command=command):
        failed_build = False
        for i, step in enumerate(steps):
            if step.only_if_build_failed and not failed_build:
                continue
            failed_build = False
            try:
                result, before = _build_step(req, step, calib, store, model, fp, api, progress, version)
            except (BuildError, UnavailableError) as exc:
                tried.append({"precision": step.label, "built": False, "reason": str(exc)})
                if i == len(steps) - 1:
                    raise
                failed_build = True
                continue
            tried.append({"precision": step.label, "built": result.built, "reason": None})
            return _result(store, model, step, result, before, fp, tried)
    raise BuildError(f"nothing to build for {onnx}: {'; '.join(notes) or 'no step'}")


def _build_step(
    req: StandaloneBuild,
    step: Step,
    calib: CalibData | None,
    store: EngineStore,
    model: str,
    fp: Any,
    api: TrtApi,
    progress: Progress | None,
    version: str,
) -> tuple[BuildResult, Path | None]:
    """One step's build (under the model's lock, held by the caller) and the plan its key had before."""
    batches = None
    if step.precision == "int8":
        assert calib is not None
        settings, batches = _int8_settings(req, step, calib, store, model, progress)
    else:
        settings = _settings(req, step)
    before = _current_plan(store, model, settings, fp)
    result = build(
        store,
        model,
        settings,
        fingerprint=fp,
        api=api,
        force=req.force,
        on_progress=progress,
        agent_version=version,
        calibration_batches=batches,
        locked=True,
    )
    return result, before


def _result(
    store: EngineStore,
    model: str,
    step: Step,
    result: BuildResult,
    before: Path | None,
    fp: Any,
    tried: list[dict[str, Any]],
) -> StandaloneResult:
    previous = store.previous(model, result.key)
    kept = previous.plan if previous is not None and before is not None and previous.plan == before else None
    return StandaloneResult(
        model,
        result.key,
        step.precision,
        result.built,
        result.plan_path,
        store.manifest_path(model, result.key),
        round(result.build_s, 3),
        result.message,
        fp.describe(),
        kept,
        tried,
    )


def _current_plan(store: EngineStore, model: str, settings: BuildSettings, fp: Any) -> Path | None:
    """The plan of the engine key of `settings` now (None: none yet): did a build replace one?"""
    from engines.build.compat import build_spec

    try:
        m = store.manifest(model, build_spec(settings, fp).key)
    except EngineError:
        return None
    return None if m is None else store.plan_path_for(model, m)
