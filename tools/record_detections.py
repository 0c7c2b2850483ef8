"""Record the bundled detector's detections on every frame of a clip (for tracker tests and the bench).

    python3 tools/record_detections.py     # agent/assets/bikes.mp4 -> tests/data/bikes_detections.npz

Scores down to 0.1 (the tracker's default second-stage floor), NMS IoU 0.5, ONNX Runtime on the CPU, one
thread (deterministic). The .npz holds ``frame`` (per detection: its frame index), ``boxes`` (N, 4) float32
x1y1x2y2 in source pixels, ``scores`` (N,) float32, ``class_ids`` (N,) int32, ``frames`` (the clip's frame
count), ``fps`` and ``size`` (w, h); agent.bench.track_eval.load_recorded gives them back per frame.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ASSETS = REPO / "agent" / "assets"
DEFAULT_OUT = REPO / "tests" / "data" / "bikes_detections.npz"
SCORE_FLOOR = 0.1


def record(clip: Path, model: Path, labels: Path) -> dict[str, np.ndarray]:
    from agent.bench.tracking import record_clip  # the bench's clip section runs the same loop
    from engines.runtimes.ort import OrtBackend
    from pipelines.models import make_adapter
    from pipelines.postprocess import load_labels

    ort = OrtBackend(str(model), intra_threads=1)
    ort.load()
    try:
        adapter = make_adapter("nanodet", ort.input_spec, len(load_labels(labels)))
        per_frame, fps, size = record_clip(str(clip), ort, adapter)  # scores down to SCORE_FLOOR
    finally:
        ort.close()
    return {
        "frame": np.concatenate([np.full(len(d), n, np.int32) for n, d in enumerate(per_frame)]),
        "boxes": np.concatenate([d.boxes for d in per_frame]).astype(np.float32),
        "scores": np.concatenate([d.scores for d in per_frame]).astype(np.float32),
        "class_ids": np.concatenate([d.class_ids for d in per_frame]).astype(np.int32),
        "frames": np.int64(len(per_frame)),
        "fps": np.float64(fps),
        "size": np.asarray(size, np.int64),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clip", type=Path, default=ASSETS / "bikes.mp4")
    p.add_argument("--model", type=Path, default=ASSETS / "nanodet-m-416.onnx")
    p.add_argument("--labels", type=Path, default=ASSETS / "coco.names")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    data = record(args.clip, args.model, args.labels)
    np.savez_compressed(args.out, **data)
    print(f"{args.out}: {int(data['frames'])} frames, {len(data['scores'])} detections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
