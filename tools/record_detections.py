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
    import cv2

    from engines.runtimes.ort import OrtBackend
    from pipelines.models import make_adapter
    from pipelines.postprocess import load_labels

    ort = OrtBackend(str(model), intra_threads=1)
    ort.load()
    adapter = make_adapter("nanodet", ort.input_spec, len(load_labels(labels)))
    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    fps = cap.get(cv2.CAP_PROP_FPS)
    frame_of, boxes, scores, classes = [], [], [], []
    n = 0
    size = (0, 0)
    try:
        while True:
            ok, img = cap.read()
            if not ok:
                break
            size = (img.shape[1], img.shape[0])
            tensor, lb = adapter.preprocess([img])
            dets = adapter.postprocess(ort.infer(tensor), lb, score_threshold=SCORE_FLOOR, iou_threshold=0.5)[
                0
            ]
            frame_of.append(np.full(len(dets), n, np.int32))
            boxes.append(dets.boxes)
            scores.append(dets.scores)
            classes.append(dets.class_ids)
            n += 1
    finally:
        cap.release()
        ort.close()
    return {
        "frame": np.concatenate(frame_of),
        "boxes": np.concatenate(boxes).astype(np.float32),
        "scores": np.concatenate(scores).astype(np.float32),
        "class_ids": np.concatenate(classes).astype(np.int32),
        "frames": np.int64(n),
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
