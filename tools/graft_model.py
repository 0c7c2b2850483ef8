"""Graft decode + NMS onto a detector's ONNX file (pipelines.models.graft): its outputs become detections.

    python tools/graft_model.py agent/assets/nanodet-m-416.onnx --score 0.35 --out nanodet-grafted.onnx

Then point `models.M.onnx` at the grafted file (same `format`): ONNX Runtime and TensorRT builds run the
decode and NMS inside the model, and the agent reads det_boxes/det_scores/det_classes/det_count instead of
decoding heads on the host. The score threshold is part of the graph: use the lowest `min_score` of the
cameras on that model (cameras filter higher on the host). NanoDet, YOLOv8/YOLO11 and YOLOv5 layouts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import onnx

from pipelines.models import GraftParams, ModelSpec, formats
from pipelines.models.graft import graft_spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("onnx", type=Path)
    p.add_argument("--format", default="nanodet", choices=formats())
    p.add_argument("--classes", type=int, default=80)
    p.add_argument("--score", type=float, default=0.35, help="score threshold baked into the graph")
    p.add_argument("--iou", type=float, default=0.5)
    p.add_argument("--max-det", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from engines.runtimes.ort import OrtBackend

    backend = OrtBackend(str(args.onnx))
    backend.load()
    input_spec = backend.input_spec
    backend.close()
    # The agent's own graft (its record names the source); class names are not needed, only their count.
    labels = tuple(f"class{i}" for i in range(args.classes))
    spec = ModelSpec(args.onnx.stem, args.format.lower(), labels, input_spec, args.onnx, args.onnx)
    grafted = graft_spec(spec, GraftParams(args.score, args.iou, args.max_det))
    onnx.save(grafted, args.out)
    print(f"{args.out}: decode + NMS grafted (score >= {args.score}, IoU {args.iou}, {args.max_det} boxes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
