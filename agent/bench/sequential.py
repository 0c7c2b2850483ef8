"""One frame at a time: each stage on the clip with ONNX Runtime (`stages`), and the agent's own cost per
frame with inference replayed from recorded outputs (`overhead`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from agent.bench.args import BenchOptions
from agent.bench.stats import pct
from agent.bench.workload import Workload
from agent.mqtt.topics import payload
from agent.results import detection_fields
from engines.runtimes.ort import OrtBackend
from engines.runtimes.replay import ReplayBackend
from pipelines.frames import Frame
from pipelines.models import ModelAdapter
from pipelines.scheduler import CameraRoute, ModelWorker, Result

OVERHEAD_TARGET_MS = {"640x272": 0.6, "1920x1080": 1.0}  # issue 10: agent overhead per frame, CPU path
PCT = (50, 95)  # these sections' percentiles (bench.json has no p99 here)


def stages(opts: BenchOptions, ort: OrtBackend, adapter: ModelAdapter, labels: list[str]) -> dict[str, Any]:
    """Each stage of one frame at a time, ONNX Runtime on this CPU (the sequential baseline)."""
    import cv2

    cap = cv2.VideoCapture(str(opts.clip), cv2.CAP_FFMPEG)
    times: dict[str, list[float]] = {
        k: [] for k in ("decode", "preprocess", "infer", "postprocess", "publish")
    }
    n = 0
    t_start = time.perf_counter()
    try:
        while n < opts.frames:
            t0 = time.perf_counter()
            ok, img = cap.read()
            t1 = time.perf_counter()
            if not ok:
                break
            tensor, boxes = adapter.preprocess([img])
            t2 = time.perf_counter()
            outputs = ort.infer(tensor)
            t3 = time.perf_counter()
            dets = adapter.postprocess(outputs, boxes, score_threshold=0.4)
            t4 = time.perf_counter()
            result = Result(Frame("bench", n, img, time.time()), dets[0], "bench", ort.name, ort.precision, 1)
            body = payload("detections", **detection_fields(result, labels))
            t5 = time.perf_counter()
            assert body  # keep the serialisation from being optimised into nothing by a future refactor
            for k, a, b in (
                ("decode", t0, t1),
                ("preprocess", t1, t2),
                ("infer", t2, t3),
                ("postprocess", t3, t4),
                ("publish", t4, t5),
            ):
                times[k].append((b - a) * 1000)
            n += 1
    finally:
        cap.release()
    elapsed = time.perf_counter() - t_start
    return {
        "frames": n,
        "stages_ms": {k: pct(v, PCT) for k, v in times.items()},
        "fps_sequential": round(n / elapsed, 2),
    }


def overhead_report(opts: BenchOptions, work: Workload) -> dict[str, Any]:
    import cv2

    out = {}
    images = work.images
    sizes = {f"{images[0].shape[1]}x{images[0].shape[0]}": images}
    if "1920x1080" not in sizes:
        sizes["1920x1080"] = [cv2.resize(im, (1920, 1080)) for im in images[:32]]
    for label, imgs in sizes.items():
        replay = ReplayBackend(work.spec, work.recorded)
        replay.load()
        out[label] = _overhead(replay, work.adapter, work.labels, imgs)
    return out


def _overhead(
    replay: ReplayBackend,
    adapter: ModelAdapter,
    labels: list[str],
    images: list[np.ndarray],
    rounds: int = 10,
) -> dict[str, Any]:
    """One frame at a time through run_once (scheduler, preprocess, replayed infer, postprocess, payload)."""
    published = 0

    def sink(result: Result) -> None:
        nonlocal published
        body = payload("detections", **detection_fields(result, labels))
        result.frame.stamp("published")
        published += bool(body)

    worker = ModelWorker("bench", replay, adapter, [sink], batch_wait_s=0.0)
    slot = worker.new_slot()
    worker.add_camera(CameraRoute("bench", slot, None, 0.4))
    per_frame: list[float] = []
    parts: dict[str, list[float]] = {"preprocess": [], "postprocess": [], "publish": [], "sum": []}
    n = 0
    cpu0 = time.process_time()
    for _ in range(rounds):
        for img in images:
            frame = Frame("bench", n, img, time.time())
            t0 = time.perf_counter()
            frame.stamp("captured")
            slot.put(frame)
            worker.run_once(timeout=1.0)
            per_frame.append((time.perf_counter() - t0) * 1000)
            s = frame.stamps
            pre = (s["preprocessed"] - s["dequeued"]) * 1000
            post = (s["postprocessed"] - s["inferred"]) * 1000
            pub = (s["published"] - s["postprocessed"]) * 1000
            for k, v in (
                ("preprocess", pre),
                ("postprocess", post),
                ("publish", pub),
                ("sum", pre + post + pub),
            ):
                parts[k].append(v)
            n += 1
    cpu = time.process_time() - cpu0
    if published != n:
        raise RuntimeError(f"bench: {n} frames in, {published} payloads out")
    return {
        "per_frame": pct(per_frame, PCT),  # wall time of the whole run_once: what the agent adds per frame
        "cpu_ms_per_frame": round(cpu * 1000 / n, 3),
        **{k: pct(v, PCT) for k, v in parts.items()},
    }
