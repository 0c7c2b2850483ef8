"""Candidate graphs: the ONNX an engine of a reduced precision is built from, made once and cached.

    cand = candidate_model(ctx, "int8", cset)         # Q/DQ graph calibrated on the calibration split
    path = cached_candidate(ctx, Step("fp16"), cset)   # the stored graph, or None (never makes one)

fp32 is the configured ONNX; fp16 its engines.precision.convert_fp16 copy; int8 an engines.build.quantize
Q/DQ graph. Derived graphs live in the calibration set's `models/` with a JSON sidecar naming the inputs
they were made from: a new calibration set, method or source ONNX makes them again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import ConfigError
from agent.lifecycle.calibration import CalibrationSet, calibration_batches, model_adapter
from agent.lifecycle.model import ModelContext
from engines.build.quantize import RECIPE, make_qdq_onnx, sha256_of
from engines.plan import Step
from engines.precision import Built, convert_fp16
from engines.store.fsutil import atomic_write_bytes
from pipelines.models import ModelAdapter

Progress = Callable[[str, int, int], None]  # (phase, step, total)


@dataclass(frozen=True)
class Candidate:
    precision: Built
    method: str | None
    onnx: Path
    info: dict[str, Any]


# ---- candidate models ----------------------------------------------------------------------------


def _cached(meta_path: Path, want: dict[str, Any], onnx_path: Path) -> dict[str, Any] | None:
    """The sidecar of a derived model when it was made from the same inputs and is intact."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("inputs") != want or not onnx_path.is_file():
        return None
    if sha256_of(onnx_path) != meta.get("info", {}).get("sha256"):
        return None
    return meta["info"]


PERCENTILE = 99.99  # the percentile method's clip point (engines.build.quantize's default)


def _candidate_spec(
    ctx: ModelContext,
    precision: Built,
    cset: CalibrationSet,
    method: str,
    exclude_nodes: list[str] | None,
    percentile: float,
    fold: bool,
) -> tuple[Path, dict[str, Any]]:
    """Where a derived graph lives and the inputs it is cached against (fp16 or int8)."""
    models = cset.directory / "models"
    if precision == "fp16":
        return models / "fp16.onnx", {"source_sha256": sha256_of(ctx.cfg.onnx)}
    if precision != "int8":
        raise ConfigError(f"models.{ctx.name}.precision: {precision!r} is not fp32, fp16 or int8")
    path = models / f"int8-{method}{'-folded' if fold else ''}.onnx"
    return path, {
        "source_sha256": sha256_of(ctx.cfg.onnx),
        "calibration_id": cset.id,
        "method": method,
        "exclude_nodes": exclude_nodes,
        "percentile": percentile,
        "recipe": RECIPE,
        "fold": fold,
    }


def cached_candidate(
    ctx: ModelContext, step: Step, cset: CalibrationSet, method: str | None = None
) -> Path | None:
    """The graph a step's engine is built from when it already exists intact (never makes one)."""
    if step.precision == "fp32":
        return ctx.cfg.onnx
    method = method or ctx.cfg.calibration.method
    path, want = _candidate_spec(ctx, step.precision, cset, method, None, PERCENTILE, step.folded)
    return path if _cached(path.with_suffix(".json"), want, path) is not None else None


def candidate_model(
    ctx: ModelContext,
    precision: Built,
    cset: CalibrationSet,
    method: str | None = None,
    exclude_nodes: list[str] | None = None,
    percentile: float = PERCENTILE,
    adapter: ModelAdapter | None = None,
    fold: bool = False,
    progress: Progress | None = None,
    phase: str = "",
) -> Candidate:
    """The ONNX an engine of `precision` is built from; derived ones are cached in the calibration dir.

    fp32: the configured ONNX. fp16: engines.precision.convert_fp16. int8: engines.build.quantize Q/DQ,
    calibrated on the calibration split only. `progress`: reported under `phase` (see Gate).
    """
    mcfg = ctx.cfg
    if precision == "fp32":
        return Candidate("fp32", None, mcfg.onnx, {})
    method = method or mcfg.calibration.method
    path, want = _candidate_spec(ctx, precision, cset, method, exclude_nodes, percentile, fold)
    info = _cached(path.with_suffix(".json"), want, path)
    if info is not None:
        return Candidate(precision, method if precision == "int8" else None, path, info)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda _phase, _step, _total: None)
    if precision == "fp16":
        report(f"{phase}convert graph", 0, 1)
        atomic_write_bytes(path, convert_fp16(mcfg.onnx))
        info = {"sha256": sha256_of(path)}
        report(f"{phase}convert graph", 1, 1)
    else:
        t0 = time.monotonic()
        total = len(cset.calibration_paths)
        report(f"{phase}calibrate", 0, total)
        info = make_qdq_onnx(
            mcfg.onnx,
            path,
            _counted(
                calibration_batches(cset, adapter or model_adapter(ctx)), f"{phase}calibrate", total, report
            ),
            method,  # type: ignore[arg-type]
            exclude_nodes,
            percentile,
            fold=fold,
        )
        info["quantize_s"] = round(time.monotonic() - t0, 2)
    write_json(path.with_suffix(".json"), {"inputs": want, "info": info})
    return Candidate(precision, method if precision == "int8" else None, path, info)


def _counted(
    batches: Iterator[np.ndarray], phase: str, total: int, progress: Progress
) -> Iterator[np.ndarray]:
    """`batches`, reporting the frames handed out so far."""
    done = 0
    for batch in batches:
        yield batch
        done += int(batch.shape[0])
        progress(phase, min(done, total), total)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())
