"""Host decode + NMS vs decode + NMS grafted onto the graph (pipelines.models.graft), as JSON on stdout.

    .venv/bin/python tools/bench_graft.py [--frames 100] [--no-trt] [--no-onnx2torch]

ONNX Runtime on the CPU, the bundled NanoDet, batch 1, the same preprocessed frames of the bundled clip for
every variant: ms per frame for model + host postprocess, and for each grafted NMS tail (model only, plus
the tiny decode_grafted). Bytes per frame that would cross device -> host (all outputs). Then whether
TensorRT-RTX parses and builds the grafted graph (CPU-only ahead-of-time build, as engines.build.builder does)
and whether onnx2torch converts it (needs torch; reported, not required).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.models.graft import decode_grafted, graft_postprocess  # noqa: E402
from pipelines.models.nanodet import NanoDetAdapter  # noqa: E402

MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
CLIP = REPO / "agent" / "assets" / "bikes.mp4"
SCORE, IOU, MAX_DET = 0.35, 0.5, 100


def _frames(count: int) -> list[np.ndarray]:
    """`count` frames spread over the clip (it is read once; short clips repeat)."""
    cap = cv2.VideoCapture(str(CLIP))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    if not frames:
        raise RuntimeError(f"cannot read {CLIP}")
    idx = np.linspace(0, len(frames) - 1, count).round().astype(int)
    return [frames[i] for i in idx]


def _session(model: bytes | str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def _time(fn: Any, inputs: list[Any]) -> dict[str, float]:
    for x in inputs[:5]:  # warm-up: allocator, thread pool
        fn(x)
    ms = []
    for x in inputs:
        t0 = time.perf_counter()
        fn(x)
        ms.append(1000 * (time.perf_counter() - t0))
    return {"mean_ms": round(float(np.mean(ms)), 3), "median_ms": round(float(np.median(ms)), 3)}


def _trt_build(path: Path) -> dict[str, Any]:
    """A real fp32 TensorRT-RTX build through engines.build.builder (no GPU needed: ahead of time)."""
    try:
        from engines.build.builder import build
        from engines.fingerprint import probe_fingerprint
        from engines.settings import BuildSettings
        from engines.store import EngineStore
        from engines.trt import import_trt

        api = import_trt("tensorrt_rtx")
        fp = probe_fingerprint(api)
    except Exception as e:  # reported, not fatal: the bench runs without TensorRT too
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        try:
            result = build(
                EngineStore(Path(root)),
                "graft",
                BuildSettings(onnx=path, precision="fp32"),
                api=api,
                fingerprint=fp,
                agent_version="bench",
            )
        except Exception as e:  # the failure text is the result
            return {"ok": False, "s": round(time.perf_counter() - t0, 2), "error": str(e)[:600]}
        return {
            "ok": True,
            "s": round(time.perf_counter() - t0, 2),
            "plan_bytes": result.plan_path.stat().st_size,
            "trt": f"{fp.trt_flavor} {fp.trt_version}",
        }


def _onnx2torch(model: onnx.ModelProto) -> dict[str, Any]:
    try:
        import onnx2torch
    except Exception as e:  # torch or onnx2torch missing is an answer, not an error
        return {"ok": False, "error": f"not importable: {type(e).__name__}: {e}"}
    try:
        onnx2torch.convert(model)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--no-trt", action="store_true")
    p.add_argument("--no-onnx2torch", action="store_true")
    args = p.parse_args(argv)

    adapter = NanoDetAdapter((416, 416), 80)
    batches = [adapter.preprocess([f]) for f in _frames(args.frames)]
    host = _session(str(MODEL))
    in_name = host.get_inputs()[0].name
    out_names = [o.name for o in host.get_outputs()]

    def host_path(item: tuple[np.ndarray, list]) -> list:
        outputs = dict(zip(out_names, host.run(None, {in_name: item[0]}), strict=True))
        return adapter.postprocess(outputs, item[1], SCORE, IOU)

    def model_only(item: tuple[np.ndarray, list]) -> list:
        return host.run(None, {in_name: item[0]})

    raw = host.run(None, {in_name: batches[0][0]})
    report: dict[str, Any] = {
        "model": MODEL.name,
        "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
        "frames": len(batches),
        "batch": 1,
        "thresholds": {"score": SCORE, "iou": IOU, "max_det": MAX_DET},
        "host": {
            "model_only": _time(model_only, batches),
            "model_plus_postprocess": _time(host_path, batches),
            "bytes_per_frame": int(sum(a.nbytes for a in raw)),
        },
        "grafted": {},
    }
    base = onnx.load(MODEL)
    matrix_path = None
    for nms in ("matrix", "onnx"):
        grafted = graft_postprocess(
            base, adapter, score_threshold=SCORE, iou_threshold=IOU, max_det=MAX_DET, nms=nms
        )
        session = _session(grafted.SerializeToString())
        names = [o.name for o in session.get_outputs()]

        def graft_path(
            item: tuple[np.ndarray, list], s: ort.InferenceSession = session, n: list = names
        ) -> list:
            return decode_grafted(dict(zip(n, s.run(None, {in_name: item[0]}), strict=True)), item[1])

        out = session.run(None, {in_name: batches[0][0]})
        counts = [len(graft_path(b)[0]) for b in batches]
        report["grafted"][nms] = {
            "model_plus_decode": _time(graft_path, batches),
            "bytes_per_frame": int(sum(a.nbytes for a in out)),
            "detections": int(sum(counts)),
        }
        if nms == "matrix":
            matrix_path = Path(tempfile.mkdtemp()) / "nanodet-grafted.onnx"
            onnx.save(grafted, matrix_path)
            if not args.no_onnx2torch:
                report["onnx2torch"] = _onnx2torch(grafted)
    report["host"]["detections"] = int(sum(len(host_path(b)[0]) for b in batches))
    if not args.no_trt and matrix_path is not None:
        report["tensorrt_rtx_build"] = {"raw": _trt_build(MODEL), "grafted_matrix": _trt_build(matrix_path)}
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
