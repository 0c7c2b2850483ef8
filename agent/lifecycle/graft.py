"""`models.M.postprocess: graph`: the model's ONNX with decode + score threshold + NMS grafted on.

    onnx = grafted_onnx(spec, params, engine_dir)   # made once, then reused (model.resolve_spec)

Everything after this (calibration, the accuracy gate, FP16/INT8 conversions, engine builds, ONNX Runtime
serving) takes the grafted graph as the model: the engine key follows its hash, so a changed threshold is a
rebuild. The grafted part is an FP32 island (engines.build.islands) through every precision route, and the
adapters of the resolved model read its det_* outputs as detections (pipelines.models.base.decode_grafted).
The grafted ONNX records how it was made in its metadata (pipelines.models.spec.GraftRecord).

Cached at engine_dir/<model>/graft/<source sha256[:16]>-s<score>-i<iou>-k<max_det>.onnx (atomic write).
"""

from __future__ import annotations

import logging
from pathlib import Path

from agent.config import ConfigError
from engines.store import sha256_file
from engines.store.fsutil import atomic_write_bytes
from pipelines.models import GraftParams, ModelSpec
from pipelines.models.graft import graft_spec

log = logging.getLogger(__name__)


def grafted_onnx(spec: ModelSpec, params: GraftParams, engine_dir: Path) -> Path:
    """The grafted copy of the (host) model `spec`; ConfigError naming the key when it cannot be made."""
    name, source = spec.name, spec.source_onnx
    try:
        digest = sha256_file(source)[:16]
    except OSError as e:
        raise ConfigError(f"models.{name}.onnx: cannot read {source} ({e.strerror or e})") from None
    path = engine_dir / name / "graft" / f"{digest}-{params.tag}.onnx"
    if path.is_file():
        return path
    try:
        grafted = graft_spec(spec, params)
    except Exception as e:  # onnx raises its own types; the graft raises ValueError naming what it lacks
        raise ConfigError(
            f"models.{name}.postprocess: graph: cannot graft decode + NMS onto {source}: {e}"
        ) from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, grafted.SerializeToString())
    except OSError as e:
        why = e.strerror or e
        raise ConfigError(f"models.{name}.postprocess: graph: cannot write {path} ({why})") from None
    log.info("model %s: decode + NMS grafted onto %s -> %s", name, source, path)
    return path
