#!/usr/bin/env python3
"""Reproduce docs/BENCHMARKS.md's precision table: precision x method -> agreement with FP32, ORT latency.

    .venv/bin/python tools/precision_report.py [--samples 100] [--held-out 40] [--out report.json]

Bundled NanoDet-m on the bundled clip: a calibration set from bikes.mp4 (calibration frames + held-out
frames, as `edge-agent calibrate` makes it) in a temp engine_dir, then the accuracy gate per candidate
on ONNX Runtime (CPU). Agreement is reported twice: with the gate's default candidate slack and strict
(candidate cut at the same score threshold). Latency is ORT inference per frame (preprocess excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.config import parse_config  # noqa: E402
from agent.lifecycle.capture import capture_calibration_set  # noqa: E402
from agent.lifecycle.gate import CANDIDATE_SLACK, run_gate  # noqa: E402
from agent.lifecycle.model import ModelContext  # noqa: E402

ASSETS = REPO / "agent" / "assets"
ROWS = (("fp32", None), ("fp16", None), ("int8", "entropy"), ("int8", "minmax"), ("int8", "percentile"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--held-out", type=int, default=40)
    ap.add_argument("--score", type=float, default=0.4, help="camera min_score (reference threshold)")
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: default)")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="precision-report-") as tmp:
        cfg = parse_config(
            {
                "engine_dir": tmp,
                "models": {
                    "nanodet": {
                        "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                        "format": "nanodet",
                        "labels": str(ASSETS / "coco.names"),
                        "backend": "onnxruntime",
                        "threads": {"intra": args.threads},
                    }
                },
                "cameras": {
                    "street": {"url": str(ASSETS / "bikes.mp4"), "model": "nanodet", "min_score": args.score}
                },
                "mqtt": {"enabled": False},
            },
            "<precision_report>",
        )
        cset = capture_calibration_set(
            cfg, "nanodet", samples=args.samples, held_out=args.held_out, progress=False
        )
        ctx = ModelContext.from_config(cfg, "nanodet")
        rows = []
        for precision, method in ROWS:
            t0 = time.monotonic()
            r = run_gate(ctx, precision, method=method, min_agreement=0.0)
            strict = run_gate(ctx, precision, method=method, min_agreement=0.0, candidate_slack=1.0)
            rows.append(
                {
                    "precision": precision,
                    "method": method,
                    "map50": r.value,
                    "mean_iou": r.mean_iou,
                    "map50_strict": strict.value,
                    "infer_ms": r.tried[0].infer_ms,
                    "seconds": round(time.monotonic() - t0, 1),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
        report = {
            "model": "nanodet-m-416",
            "clip": "bikes.mp4",
            "calibration_frames": cset.manifest["samples"],
            "held_out_frames": cset.manifest["held_out_count"],
            "score_threshold": args.score,
            "candidate_slack": CANDIDATE_SLACK,
            "cpu_count": os.cpu_count(),
            "rows": rows,
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
