"""`edge-agent bench`: the whole pipeline under load, like trtexec for an engine.

    edge-agent bench                                              # stages, overhead, sweep (simulated engine)
    edge-agent bench --sections sweep --streams 16 --batch 8 --duration 300   # the long no-growth run
    edge-agent bench --engine ort --streams 4 --batch 1,4         # ONNX Runtime vs its bare loop
    edge-agent bench --resolution 1920x1080 --preprocess gpu --streams 16 --batch 8   # a GPU box
    edge-agent bench --rtsp 'rtsp://127.0.0.1:8554/cam{i}' --streams 4   # tools/rtsp_server.py --mounts 4
    edge-agent bench --sections sweep --decode --streams 6 --batch 8 --flap 1   # isolation: a flapping camera

Sections (`--sections`, all by default):
- stages: each stage of one frame at a time on the bundled clip with ONNX Runtime (decode, preprocess,
  infer, postprocess, publish) and the sequential frame rate;
- overhead: the agent's own cost per frame (scheduler, preprocess, postprocess, payload) with inference
  replayed from recorded outputs, one frame at a time, at the clip's size and at 1920x1080;
- sweep: N streams (N looped copies of the clip at --fps each, decoded once into memory; or real camera
  readers with --decode / --rtsp) into the pipelined worker, for every --streams x --batch, after a
  warm-up: offered and processed frames/s, frame age p50/p95/p99 at delivery, per-stage times, engine
  busy time (device time), process CPU per frame, a timeline (throughput, age p95, RSS) for growth.
  The engine is the simulated one (--engine sim: NanoDet outputs recorded with ONNX Runtime, replayed
  with a fixed --engine-ms per batch that releases the GIL, --slots batches at once) or ONNX Runtime
  itself (--engine ort, with its bare infer loop at the same batch as the baseline). With camera readers
  each run also has `startup` (seconds from start to each camera streaming) and `camera_fps` (each
  camera's own delivered rate); with --flap K each point runs twice, without and with K cameras whose
  RTSP source drops them every --flap-every s, and `isolation` compares the steady cameras' share;
- tracking (not in the default set): host CPU per frame of the tracker, of tracker + zones + lines, and
  of the whole per-camera events hook at 1, 20 and 100 objects; IDF1 / ID switches on synthetic scenes,
  also of the library trackers where installed; MQTT messages on the clip per configuration with
  `publish.detections: off` (agent/bench_tracking.py).

Writes bench.json and bench.png (throughput vs streams, latency vs batch; needs matplotlib) in --out and
prints a one-paragraph summary. `python -m agent.bench` runs it where the CLI's dependencies are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from agent.bench_args import BenchOptions, add_arguments, options_from_args
from agent.bench_load import LoopedClip, Readers, RunSpec, measure, measure_readers, read_clip
from agent.bench_plot import plot
from agent.results import detection_fields
from agent.topics import payload
from engines.runtimes.base import Backend, TensorSpec
from engines.runtimes.ort import OrtBackend
from engines.runtimes.replay import ReplayBackend
from pipelines.frames import Frame
from pipelines.models import ModelAdapter, make_adapter
from pipelines.postprocess import load_labels
from pipelines.scheduler import CameraRoute, ModelWorker, Result
from pipelines.sources import FrameSlot, SourceSpec

OVERHEAD_TARGET_MS = {"640x272": 0.6, "1920x1080": 1.0}  # issue 10: agent overhead per frame, CPU path
RECORDED_FRAMES = 16  # outputs recorded with ONNX Runtime for the simulated engine to replay


# ---- the run -----------------------------------------------------------------------------------------------
def run_bench(opts: BenchOptions) -> dict[str, Any]:
    labels = load_labels(opts.labels)
    if opts.postprocess == "graph":
        opts = replace(opts, model=_grafted(opts, len(labels)))
    ort = OrtBackend(str(opts.model), intra_threads=opts.threads)
    ort.load()
    input_spec = ort.input_spec
    adapter = make_adapter(opts.format, input_spec, len(labels))
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "load_avg": list(os.getloadavg()),
        },
        "model": opts.model.name,
        "clip": opts.clip.name,
        "options": _jsonable(opts),
    }
    try:
        if "stages" in opts.sections:
            report.update(_stages(opts, ort, adapter, labels))
        if "readers" in opts.sections:
            report["readers"] = _readers(opts)
        if "tracking" in opts.sections:
            from agent.bench_tracking import tracking_report  # needs the config's pydantic: only when asked

            report["tracking"] = tracking_report(str(opts.clip), ort, adapter, labels)
        if "overhead" in opts.sections or "sweep" in opts.sections:
            images = read_clip(opts.clip, max(opts.clip_frames, RECORDED_FRAMES), opts.resolution)
            recorded = [ort.infer(adapter.preprocess([im])[0]) for im in images[:RECORDED_FRAMES]]
            report["resolution"] = f"{images[0].shape[1]}x{images[0].shape[0]}"
        if not (opts.engine == "ort" and "sweep" in opts.sections):
            ort.close()  # its idle thread pool would only compete with (and be counted as) the agent
        if "overhead" in opts.sections:
            report["overhead_ms"] = _overhead_report(opts, input_spec, recorded, adapter, labels, images)
            report["overhead_target_ms"] = OVERHEAD_TARGET_MS
        if "decode" in opts.sections:
            report["decode_alone"] = _decode_alone(opts)
        if "sweep" in opts.sections:
            report["engine"] = _engine_description(opts)
            bare = ort if opts.engine == "ort" else None
            report["runs"] = _sweep(opts, input_spec, recorded, adapter, labels, images, bare)
            _against_decode(report)
            if opts.flap:
                report["isolation"] = _isolation(report["runs"], opts)
    finally:
        ort.close()
    report["summary"] = summary(report)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    report["plot"] = plot(report, opts.out / "bench.png")
    return report


def _grafted(opts: BenchOptions, classes: int) -> Path:
    """The model with decode + NMS grafted on (what `tools/graft_model.py` writes), in --out."""
    import onnx

    from pipelines.models.graft import graft_postprocess

    probe = OrtBackend(str(opts.model), intra_threads=1)
    probe.load()
    try:
        adapter = make_adapter(opts.format, probe.input_spec, classes)
    finally:
        probe.close()
    # The routes' min_score (0.4) is above the graph's threshold, as in the daemon (lowest camera min_score).
    model = graft_postprocess(onnx.load(str(opts.model)), adapter, score_threshold=0.35)
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"{opts.model.stem}-grafted.onnx"
    onnx.save(model, str(path))
    return path


def _stages(opts: BenchOptions, ort: OrtBackend, adapter: ModelAdapter, labels: list[str]) -> dict[str, Any]:
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
        "stages_ms": {k: _pct(v) for k, v in times.items()},
        "fps_sequential": round(n / elapsed, 2),
    }


def _overhead_report(
    opts: BenchOptions,
    spec: TensorSpec,
    recorded: list[dict[str, np.ndarray]],
    adapter: ModelAdapter,
    labels: list[str],
    images: list[np.ndarray],
) -> dict[str, Any]:
    import cv2

    out = {}
    sizes = {f"{images[0].shape[1]}x{images[0].shape[0]}": images}
    if "1920x1080" not in sizes:
        sizes["1920x1080"] = [cv2.resize(im, (1920, 1080)) for im in images[:32]]
    for label, imgs in sizes.items():
        replay = ReplayBackend(spec, recorded)
        replay.load()
        out[label] = _overhead(replay, adapter, labels, imgs)
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
        "per_frame": _pct(per_frame),  # wall time of the whole run_once: what the agent adds per frame
        "cpu_ms_per_frame": round(cpu * 1000 / n, 3),
        **{k: _pct(v) for k, v in parts.items()},
    }


def _bare_loop(
    ort: OrtBackend, adapter: ModelAdapter, images: list[np.ndarray], batch: int, seconds: float
) -> float:
    """ONNX Runtime's own throughput (frames/s) at `batch`: infer on a ready batch, nothing else."""
    tensor, _ = adapter.preprocess([images[i % len(images)] for i in range(batch)])
    for _ in range(2):
        ort.infer(tensor)  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ort.infer(tensor)
        n += batch
    return n / (time.perf_counter() - t0)


def _readers(opts: BenchOptions) -> list[dict[str, Any]]:
    """The readers section: every --streams count of camera readers alone (the clip's file, or --rtsp)."""
    out = []
    for streams in opts.streams:
        run_spec = RunSpec(streams, 0, opts.fps, opts.warmup_s, opts.duration_s)
        run = measure_readers(run_spec, _sources(replace(opts, decode=True), []))
        up, fps = run["startup"], run["camera_fps"]
        print(
            f"bench: {streams} readers ({opts.decoder}): {run['offered_fps']} fps in all, per camera "
            f"{fps['min']}-{fps['max']} fps, all streaming {up['all_streaming_s']} s after start, "
            f"{run['cpu_ms_per_frame']} ms CPU per frame",
            file=sys.stderr,
            flush=True,
        )
        out.append(run)
    return out


def _decode_alone(opts: BenchOptions) -> list[dict[str, Any]]:
    """The decode section: the readers' decoders alone, unpaced, per --streams count over --shards."""
    from agent.bench_shards import decode_alone

    out = []
    for streams in opts.streams:
        run = decode_alone(opts, streams)
        print(
            f"bench: {streams} streams decoded alone ({opts.decoder}, {run['shards']} process"
            f"{'es' if run['shards'] > 1 else ''}): {run['decoded_fps']} frames/s, "
            f"{run['cpu_ms_per_frame']} ms CPU per frame",
            file=sys.stderr,
            flush=True,
        )
        out.append(run)
    return out


def _against_decode(report: dict[str, Any]) -> None:
    """Each sweep run's processed rate against the decoders alone on the same streams (same run)."""
    alone = {d["streams"]: d["decoded_fps"] for d in report.get("decode_alone") or [] if d["decoded_fps"]}
    for run in report["runs"]:
        ref = alone.get(run["streams"])
        if ref:
            run["vs_decode_alone"] = round(run["processed_fps"] / ref, 3)


def _engine_description(opts: BenchOptions) -> dict[str, Any]:
    if opts.engine == "ort":
        return {"kind": "onnxruntime", "threads": opts.threads}
    return {"kind": "simulated", "ms_per_batch": opts.engine_ms, "slots": opts.slots}


def _sweep(
    opts: BenchOptions,
    spec: TensorSpec,
    recorded: list[dict[str, np.ndarray]],
    adapter: ModelAdapter,
    labels: list[str],
    images: list[np.ndarray],
    bare: OrtBackend | None,
) -> list[dict[str, Any]]:
    """Every --streams x --batch. With ONNX Runtime, its bare loop at the same batch is measured right
    before and right after each run (the machine's load drifts), and the run compared with their mean."""
    images, keep = _placed(opts, images)
    runs = []
    with _flapping_sources(opts) as variants:
        try:
            for batch in opts.batch:
                for streams in opts.streams:
                    for variant, extra_url in variants * opts.repeat:
                        run_spec = RunSpec(
                            streams,
                            batch,
                            opts.fps,
                            opts.warmup_s,
                            opts.duration_s,
                            opts.iterations,
                            opts.max_age_ms,
                            opts.window_s,
                            opts.flap if extra_url else 0,
                        )
                        run = _point(opts, run_spec, spec, recorded, adapter, labels, images, bare, extra_url)
                        run["variant"] = variant
                        print(_run_line(run), file=sys.stderr, flush=True)
                        runs.append(run)
        finally:
            for buf in keep:
                buf.free()
    return runs


def _point(
    opts: BenchOptions,
    run_spec: RunSpec,
    spec: TensorSpec,
    recorded: list[dict[str, np.ndarray]],
    adapter: ModelAdapter,
    labels: list[str],
    images: list[np.ndarray],
    bare: OrtBackend | None,
    flap_url: str | None,
) -> dict[str, Any]:
    """One measured run; with ONNX Runtime, between two runs of its bare loop."""
    if opts.shards > 1:
        from agent.bench_shards import sharded_point

        return sharded_point(opts, run_spec, spec, recorded, labels)
    seconds = max(3.0, opts.duration_s / 3)
    batch = run_spec.batch
    before = _bare_loop(bare, adapter, images, batch, seconds) if bare is not None else None
    backend = _backend(opts, spec, recorded)
    gpu = _gpu() if opts.preprocess == "gpu" else None
    run = measure(run_spec, backend, adapter, labels, _sources(opts, images, flap_url), gpu)
    run["flap"] = run_spec.flap
    if bare is not None and before is not None:
        after = _bare_loop(bare, adapter, images, batch, seconds)
        run["bare_loop_fps"] = [round(before, 2), round(after, 2)]
        run["vs_bare_loop"] = round(2 * run["processed_fps"] / (before + after), 3)
    return run


# Isolation variants of each point: the steady cameras alone; beside K more RTSP cameras that stay up (the
# control: what K more cameras cost on this machine); beside K cameras whose source drops them every few s.
VARIANTS = ("without", "control", "flapping")


@contextlib.contextmanager
def _flapping_sources(opts: BenchOptions) -> Iterator[list[tuple[str, str | None]]]:
    """--flap: two RTSP servers (tools/annexb_rtsp_server.py) serving the clip, one of them dropping every
    client after --flap-every seconds; yields (variant, URL of the K extra cameras or None) to run."""
    if not opts.flap:
        yield [("without", None)]
        return
    script = Path(__file__).resolve().parents[1] / "tools" / "annexb_rtsp_server.py"
    if not script.is_file():
        raise RuntimeError(f"--flap needs {script} (run the bench from a repository checkout)")
    stream = opts.clip
    if stream.suffix.lower() not in (".h264", ".264", ".h265", ".265", ".hevc"):
        opts.out.mkdir(parents=True, exist_ok=True)
        stream = opts.out / f"{opts.clip.stem}.h264"
        cmd = [sys.executable, str(script), "--from-mp4", str(opts.clip), "--write-annexb", str(stream)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    servers = []
    try:
        urls = []
        for close_after in (0.0, opts.flap_every_s):
            cmd = [sys.executable, str(script), str(stream), "--port", "0", "--fps", f"{opts.fps:g}"]
            cmd += ["--close-after", f"{close_after:g}"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            servers.append(proc)
            out = proc.stdout
            port = out.readline().strip() if out is not None else ""  # its first line; "" when it exited
            if not port.isdigit():
                raise RuntimeError(f"an RTSP server for --flap did not start: {' '.join(cmd)}")
            urls.append(f"rtsp://127.0.0.1:{port}/extra")
        yield list(zip(VARIANTS, [None, *urls], strict=True))
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)


def _placed(opts: BenchOptions, images: list[np.ndarray]) -> tuple[list[np.ndarray], list[Any]]:
    """The looped streams' frames; with GPU preprocessing, in pinned memory (as a decoder writing into
    pinned buffers would leave them: the upload then costs the CPU nothing)."""
    images = images[: opts.clip_frames]
    if opts.preprocess != "gpu":
        return images, []
    from engines.cuda_buffers import PinnedBuffer

    keep, placed = [], []
    for im in images:
        buf = PinnedBuffer(im.nbytes)
        view = buf.view(np.dtype(np.uint8), im.shape)
        view[...] = im
        keep.append(buf)
        placed.append(view)
    return placed, keep


def _backend(opts: BenchOptions, spec: TensorSpec, recorded: list[dict[str, np.ndarray]]) -> Backend:
    backend: Backend
    if opts.engine == "ort":
        backend = OrtBackend(str(opts.model), intra_threads=opts.threads)
    else:
        backend = ReplayBackend(spec, recorded, latency_ms=opts.engine_ms, slots=opts.slots)
    backend.load()
    return backend


def _gpu() -> Any:
    from pipelines.preprocess_gpu import GpuLetterbox

    return GpuLetterbox()


def _sources(
    opts: BenchOptions, images: list[np.ndarray], flap_url: str | None = None, first: int = 1
) -> Any:
    """`first`: the {i} of the first RTSP stream (a shard's share starts further on)."""

    def make(slots: list[tuple[str, FrameSlot]]) -> LoopedClip | Readers:
        if opts.rtsp is None and not opts.decode:
            return LoopedClip(images, slots, opts.fps)
        specs = []
        steady = first - 1
        # --fps 0: saturation; files as fast as they decode, nothing limited (RTSP: as the server sends).
        fps, realtime = (opts.fps, True) if opts.fps > 0 else (None, False)
        for cam, _ in slots:
            if cam.startswith("flap") and flap_url is not None:
                specs.append(SourceSpec(camera=cam, url=flap_url, fps=opts.fps))
            elif opts.rtsp is not None:
                steady += 1
                specs.append(SourceSpec(camera=cam, url=opts.rtsp.replace("{i}", str(steady)), fps=fps))
            else:
                clip = str(opts.clip)
                specs.append(SourceSpec(camera=cam, url=clip, fps=fps, loop=True, realtime=realtime))
        return Readers(specs, [s for _, s in slots], opts.decoder)

    return make


# ---- reporting ---------------------------------------------------------------------------------------------
def _pct(samples: list[float]) -> dict[str, float | int | None]:
    a = np.asarray(samples, dtype=np.float64)
    if not a.size:
        return {"p50": None, "p95": None, "mean": None, "n": 0}
    return {
        "p50": round(float(np.percentile(a, 50)), 3),
        "p95": round(float(np.percentile(a, 95)), 3),
        "mean": round(float(a.mean()), 3),
        "n": int(a.size),
    }


def _run_line(run: dict[str, Any]) -> str:
    lat = run["latency_ms"]
    flap = f" + {run['flap']} {run['variant']}" if run.get("flap") else ""
    line = (
        f"bench: {run['streams']:>2} streams{flap}, batch <= {run['batch']}: "
        f"offered {run['offered_fps']:.1f} fps, processed {run['processed_fps']:.1f} "
        f"({100 * (run['processed_ratio'] or 0):.1f} %), "
        f"age p50/p95/p99 {lat['p50']}/{lat['p95']}/{lat['p99']} ms, "
        f"mean batch {run['mean_batch']}, CPU {run['cpu_ms_per_frame']} ms/frame"
    )
    if run.get("camera_fps"):
        up = run["startup"]
        line += (
            f"; per camera {run['camera_fps']['min']}-{run['camera_fps']['max']} fps, all streaming "
            f"{up['all_streaming_s']} s after start"
        )
    if run.get("steady") and run.get("flap"):
        st = run["steady"]
        line += (
            f"; steady cameras {st['processed_fps']} fps processed, age p99 {st['latency_ms']['p99']} ms, "
            f"{run['flap_reconnects']} reconnects of the {run['variant']} ones"
        )
    return line


def _isolation(runs: list[dict[str, Any]], opts: BenchOptions) -> list[dict[str, Any]]:
    """Each point's steady cameras alone, beside K cameras that stay up (control), and beside K that flap
    (medians over --repeat rounds): what the flapping costs them is `vs_control` (`vs_without` adds the
    load of K more cameras)."""
    points: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        points.setdefault((run["streams"], run["batch"]), {}).setdefault(run["variant"], []).append(run)
    out = []
    for (streams, batch), by in points.items():
        steady = {name: _median_steady(by[name]) for name in VARIANTS}
        out.append(
            {
                "streams": streams,
                "batch": batch,
                "flap": opts.flap,
                "flap_every_s": opts.flap_every_s,
                "rounds": len(by["flapping"]),
                "flap_reconnects": sum(r["flap_reconnects"] or 0 for r in by["flapping"]),
                **steady,
                "vs_control": _delta(steady["control"], steady["flapping"]),
                "vs_without": _delta(steady["without"], steady["flapping"]),
            }
        )
    return out


def _median_steady(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The steady cameras' processed frames/s and frame age percentiles, medians over the rounds."""
    st = [r["steady"] for r in runs]
    return {
        "processed_fps": float(np.median([s["processed_fps"] for s in st])),
        "latency_ms": {
            q: round(float(np.median([s["latency_ms"][q] for s in st])), 3) for q in ("p50", "p95", "p99")
        },
        "p99_per_round": [s["latency_ms"]["p99"] for s in st],
    }


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """Steady cameras' processed frames (relative change) and frame age p99 (ms) from run a to run b."""
    pa, pb = a["latency_ms"]["p99"], b["latency_ms"]["p99"]
    return {
        "processed_change": round(b["processed_fps"] / a["processed_fps"] - 1, 4)
        if a["processed_fps"]
        else None,
        "age_p99_delta_ms": round(pb - pa, 2) if pa is not None and pb is not None else None,
    }


def summary(report: dict[str, Any]) -> str:
    """One paragraph: what ran, the headline numbers, where the report is."""
    parts = []
    eng = report.get("engine")
    runs = report.get("runs") or []
    if runs and eng:
        what = (
            f"simulated engine {eng['ms_per_batch']:g} ms per batch ({eng['slots']} slot"
            f"{'s' if eng['slots'] > 1 else ''})"
            if eng["kind"] == "simulated"
            else "ONNX Runtime on this CPU"
        )
        opts = report["options"]
        src = "RTSP" if opts["rtsp"] else ("decoded by camera readers" if opts["decode"] else "decoded once")
        if opts["decode"] or opts["rtsp"]:
            src += f", {opts.get('decoder', 'cpu').upper()} decoding"
        # RTSP streams are whatever the server sends; the clip then only fed the recorded engine outputs.
        feed = f"{opts['rtsp']}" if opts["rtsp"] else f"{report['clip']} at {report['resolution']}"
        post = ", decode + NMS in the model" if opts.get("postprocess") == "graph" else ""
        parts.append(
            f"{what}, {feed} ({src}) at {opts['fps']:g} fps per stream, "
            f"{opts['preprocess'].upper()} preprocessing{post}, max age {opts['max_age_ms']:g} ms."
        )
        best = max(runs, key=lambda r: (r["streams"], r["batch"]))
        lat = best["latency_ms"]
        line = (
            f" {best['streams']} streams, batch <= {best['batch']}: "
            f"offered {best['offered_fps']:.1f} frames/s, "
            f"processed {best['processed_fps']:.1f} ({100 * (best['processed_ratio'] or 0):.1f} %), "
            f"frame age p50 {lat['p50']} / p95 {lat['p95']} / p99 {lat['p99']} ms, mean batch "
            f"{best['mean_batch']}, agent CPU {best['cpu_ms_per_frame']} ms per frame"
        )
        if best.get("engine_busy") is not None:
            line += f", engine busy {100 * best['engine_busy']:.0f} %"
        if best.get("shards"):
            line += f", {len(best['shards'])} shard processes"
        if best.get("vs_decode_alone") is not None:
            line += f", {best['vs_decode_alone']:.2f}x the decoders alone on the same streams"
        if best.get("vs_bare_loop") is not None:
            line += f", {best['vs_bare_loop']:.2f}x the bare ONNX Runtime loop"
        parts.append(line + ".")
        grew = _growth(best)
        if grew:
            parts.append(" " + grew)
        if best.get("camera_fps"):
            up = best["startup"]
            parts.append(
                f" Each camera delivered {best['camera_fps']['min']}-{best['camera_fps']['max']} fps; all "
                f"{up['cameras']} were streaming {up['all_streaming_s']} s after start."
            )
    for iso in report.get("isolation") or []:
        ctl, alone = iso["vs_control"], iso["vs_without"]
        p99 = [iso[v]["latency_ms"]["p99"] for v in ("without", "control", "flapping")]
        parts.append(
            f" Isolation, {iso['streams']} steady cameras beside {iso['flap']} whose source drops them "
            f"every {iso['flap_every_s']:g} s ({iso['flap_reconnects']} reconnects in {iso['rounds']} "
            f"round{'s' if iso['rounds'] > 1 else ''}, medians): against {iso['flap']} "
            f"that stay up, steady frames processed {100 * (ctl['processed_change'] or 0):+.2f} %, "
            f"frame age p99 {ctl['age_p99_delta_ms']:+} ms; against none, "
            f"{100 * (alone['processed_change'] or 0):+.2f} % "
            f"and {alone['age_p99_delta_ms']:+} ms (p99 alone / control / flapping: {p99[0]} / {p99[1]} / "
            f"{p99[2]} ms)."
        )
    for run in report.get("decode_alone") or []:
        parts.append(
            f" {run['streams']} streams decoded alone ({run['decoder'].upper()}, {run['shards']} process"
            f"{'es' if run['shards'] > 1 else ''}, unpaced): {run['decoded_fps']} frames/s."
        )
    for run in report.get("readers") or []:
        fps, up = run["camera_fps"], run["startup"]
        parts.append(
            f" {run['streams']} camera readers alone ({report['options']['decoder'].upper()} decoding): "
            f"{fps['min']}-{fps['max']} fps each (nominal {report['options']['fps']:g}), all streaming "
            f"{up['all_streaming_s']} s after start, {run['cpu_ms_per_frame']} ms CPU per frame."
        )
    if "overhead_ms" in report:
        o = report["overhead_ms"]
        each = ", ".join(
            f"{k}: {v['per_frame']['p50']} ms p50 (pre+post+publish {v['sum']['p50']} ms)"
            for k, v in o.items()
        )
        parts.append(f" Agent overhead per frame, inference replayed, one frame at a time: {each}.")
    if "fps_sequential" in report:
        infer = report["stages_ms"]["infer"]["p50"]
        parts.append(f" Sequential ONNX Runtime: {report['fps_sequential']} fps (infer p50 {infer} ms).")
    if "tracking" in report:
        from agent.bench_tracking import summary as tracking_summary

        parts.append(" " + tracking_summary(report["tracking"]))
    return "".join(parts).strip()


def _growth(run: dict[str, Any]) -> str:
    tl = [w for w in run.get("timeline", []) if w.get("age_p95_ms") is not None]
    if len(tl) < 3:
        return ""
    first, last = tl[0], tl[-1]
    own = (last["rss_mb"] - last["records_mb"]) - (first["rss_mb"] - first["records_mb"])
    return (
        f"Over {last['t_s']:g} s: RSS {first['rss_mb']} -> {last['rss_mb']} MB ({own:+.1f} MB without the "
        f"bench's own per-frame records), frame age p95 {first['age_p95_ms']} -> {last['age_p95_ms']} ms "
        f"(first -> last window of {tl[0]['t_s']:g} s)."
    )


def _jsonable(opts: BenchOptions) -> dict[str, Any]:
    out = {}
    for k, v in vars(opts).items():
        out[k] = str(v) if isinstance(v, Path) else (list(v) if isinstance(v, tuple) else v)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m agent.bench`: `edge-agent bench` where the CLI's dependencies are missing."""
    import logging

    p = argparse.ArgumentParser(prog="python -m agent.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"edge-agent bench: {exc}", file=sys.stderr)
        return 2
    report = run_bench(opts)
    print(report["summary"])
    print(f"report: {opts.out / 'bench.json'}" + (f", plot: {report['plot']}" if report["plot"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
