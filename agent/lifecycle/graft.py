"""`models.M.postprocess: graph`: the model's ONNX with decode + score threshold + NMS grafted on.

    onnx = grafted_onnx("detector", mcfg, engine_dir, adapter)   # made once, then reused

Everything after this (calibration, the accuracy gate, FP16/INT8 conversions, engine builds, ONNX Runtime
serving) takes the grafted graph as the model: the engine key follows its hash, so a changed threshold is a
rebuild. The grafted part is an FP32 island (engines.islands) through every precision route, and the
adapters read its det_* outputs as detections (pipelines.models.base.decode_grafted).

Cached at engine_dir/<model>/graft/<source sha256[:16]>-s<score>-i<iou>-k<max_det>.onnx (atomic write).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from agent.config import ConfigError, ModelConfig
from engines.fsutil import atomic_write_bytes
from engines.store import sha256_file
from pipelines.models import ModelAdapter
from pipelines.models.graft import graft_postprocess

log = logging.getLogger(__name__)


def grafted_onnx(name: str, mcfg: ModelConfig, engine_dir: Path, adapter: ModelAdapter) -> Path:
    """The grafted copy of models.<name>.onnx; ConfigError naming the key when it cannot be made."""
    source = Path(mcfg.onnx)
    try:
        digest = sha256_file(source)[:16]
    except OSError as e:
        raise ConfigError(f"models.{name}.onnx: cannot read {source} ({e.strerror or e})") from None
    params = f"s{mcfg.graph_score_threshold:g}-i{mcfg.iou_threshold:g}-k{adapter.max_det}"
    path = engine_dir / name / "graft" / f"{digest}-{params}.onnx"
    if path.is_file():
        return path
    try:
        model = onnx.load(str(source))
        grafted = graft_postprocess(
            model,
            adapter,
            score_threshold=mcfg.graph_score_threshold,
            iou_threshold=mcfg.iou_threshold,
            max_det=adapter.max_det,
        )
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
