"""Benchmark: per-stage latency on the bundled clip, and the pipeline's own cost with inference excluded.

A report, not a test: writes `bench.json` (and `bench.png` when matplotlib is installed).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from agent.results import detection_fields
from agent.topics import payload
from engines.runtimes.ort import OrtBackend
from engines.runtimes.replay import ReplayBackend
from pipelines.frames import Frame
from pipelines.models import make_adapter
from pipelines.postprocess import load_labels
from pipelines.scheduler import CameraRoute, ModelWorker, Result

ASSETS = Path(__file__).resolve().parent / "assets"


def _pct(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(a, 50)), 3),
        "p95": round(float(np.percentile(a, 95)), 3),
        "mean": round(float(a.mean()), 3),
        "n": int(a.size),
    }


def _decode_all(clip: Path, limit: int) -> tuple[list[np.ndarray], list[float]]:
    import cv2

    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    frames, times = [], []
    try:
        while len(frames) < limit:
            t0 = time.perf_counter()
            ok, img = cap.read()
            t1 = time.perf_counter()
            if not ok:
                break
            frames.append(img)
            times.append((t1 - t0) * 1000)
    finally:
        cap.release()
    if not frames:
        raise RuntimeError(f"{clip}: no frames decoded")
    return frames, times


def run_bench(
    out_dir: Path,
    frames_limit: int = 200,
    model: Path | None = None,
    clip: Path | None = None,
    threads: int = 0,
) -> dict:
    model = model or ASSETS / "nanodet-m-416.onnx"
    clip = clip or ASSETS / "bikes.mp4"
    labels = load_labels(ASSETS / "coco.names")
    images, decode_ms = _decode_all(clip, frames_limit)

    backend = OrtBackend(str(model), intra_threads=threads)
    backend.load()
    adapter = make_adapter("nanodet", backend.input_spec, len(labels))

    # 1) Full pipeline, stage by stage, with ONNX Runtime on this machine's CPU.
    stages: dict[str, list[float]] = {k: [] for k in ("preprocess", "infer", "postprocess", "publish")}
    recorded: list[dict[str, np.ndarray]] = []
    t_start = time.perf_counter()
    for i, img in enumerate(images):
        t0 = time.perf_counter()
        tensor, boxes = adapter.preprocess([img])
        t1 = time.perf_counter()
        outputs = backend.infer(tensor)
        t2 = time.perf_counter()
        dets = adapter.postprocess(outputs, boxes, score_threshold=0.4)
        t3 = time.perf_counter()
        frame = Frame("bench", i, img, time.time())
        body = payload(
            "detections",
            **detection_fields(Result(frame, dets[0], "nanodet", backend.name, backend.precision, 1), labels),
        )
        t4 = time.perf_counter()
        assert body  # keep the serialisation from being optimised into nothing by a future refactor
        for k, a, b in (
            ("preprocess", t0, t1),
            ("infer", t1, t2),
            ("postprocess", t2, t3),
            ("publish", t3, t4),
        ):
            stages[k].append((b - a) * 1000)
        if len(recorded) < 64:
            recorded.append({k: v.copy() for k, v in outputs.items()})
    elapsed = time.perf_counter() - t_start
    input_spec = backend.input_spec
    backend.close()

    report: dict = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
        },
        "model": model.name,
        "clip": clip.name,
        "frames": len(images),
        "stages_ms": {"decode": _pct(decode_ms), **{k: _pct(v) for k, v in stages.items()}},
        "fps_sequential": round(len(images) / elapsed, 2),
    }

    # 2) The agent's own cost per frame: scheduler + preprocess + postprocess + payload, model replayed.
    import cv2

    replay = ReplayBackend(input_spec, recorded)
    replay.load()
    report["overhead_ms"] = {}
    for label, size in (("640x272", None), ("1920x1080", (1920, 1080))):
        imgs = images if size is None else [cv2.resize(im, size) for im in images[:64]]
        report["overhead_ms"][label] = _overhead(replay, adapter, labels, imgs)
    report["overhead_target_ms"] = 1.0

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "bench.png")
    return report


def _overhead(
    replay: ReplayBackend, adapter: object, labels: list[str], images: list[np.ndarray], rounds: int = 2
) -> dict:
    published: list[bytes] = []

    def sink(result: Result) -> None:
        published.append(payload("detections", **detection_fields(result, labels)))

    worker = ModelWorker("bench", replay, adapter, [sink], batch_wait_s=0.0)  # type: ignore[arg-type]
    slot = worker.new_slot()
    worker.add_camera(CameraRoute("bench", slot, None, 0.4))
    per_frame, breakdown = [], {"preprocess": [], "postprocess": []}
    n = 0
    for _ in range(rounds):
        for img in images:
            frame = Frame("bench", n, img, time.time())
            t0 = time.perf_counter()
            frame.stamp("captured")
            slot.put(frame)
            worker.run_once(timeout=1.0)
            per_frame.append((time.perf_counter() - t0) * 1000)
            s = frame.stamps
            breakdown["preprocess"].append((s["preprocessed"] - s["dequeued"]) * 1000)
            breakdown["postprocess"].append((s["postprocessed"] - s["inferred"]) * 1000)
            n += 1
    if len(published) != n:
        raise RuntimeError(f"bench: {n} frames in, {len(published)} payloads out")
    return {"per_frame": _pct(per_frame), **{k: _pct(v) for k, v in breakdown.items()}}


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["stages_ms"])
    x = np.arange(len(names))
    a1.bar(x - 0.2, [report["stages_ms"][k]["p50"] for k in names], 0.4, label="p50")
    a1.bar(x + 0.2, [report["stages_ms"][k]["p95"] for k in names], 0.4, label="p95")
    a1.set_xticks(x, names)
    a1.set_ylabel("ms per frame")
    a1.set_title(f"Stages, {report['model']} on {report['clip']} (ONNX Runtime CPU)")
    a1.legend()
    res = list(report["overhead_ms"])
    x2 = np.arange(len(res))
    a2.bar(x2 - 0.2, [report["overhead_ms"][r]["per_frame"]["p50"] for r in res], 0.4, label="p50")
    a2.bar(x2 + 0.2, [report["overhead_ms"][r]["per_frame"]["p95"] for r in res], 0.4, label="p95")
    a2.axhline(report["overhead_target_ms"], color="red", linestyle="--", label="target")
    a2.set_xticks(x2, res)
    a2.set_title("Agent overhead per frame, inference replayed")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
