"""The sweep (every --streams x --batch into the pipelined worker), and the camera readers and decoders
alone on the same streams (the `readers` and `decode` sections)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from agent.bench.args import BenchOptions
from agent.bench.engine import gpu_letterbox, make_backend
from agent.bench.isolation import flapping_sources
from agent.bench.load import RunSpec, measure, measure_readers
from agent.bench.shards import decode_alone, sharded_point
from agent.bench.streams import placed_frames, stream_sources
from agent.bench.workload import Workload
from engines.runtimes.ort import OrtBackend
from pipelines.models import ModelAdapter


def sweep(opts: BenchOptions, work: Workload, bare: OrtBackend | None) -> list[dict[str, Any]]:
    """Every --streams x --batch. With ONNX Runtime, its bare loop at the same batch is measured right
    before and right after each run (the machine's load drifts), and the run compared with their mean."""
    images, keep = placed_frames(opts, work.images)
    work = replace(work, images=images)
    runs = []
    with flapping_sources(opts) as variants:
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
                        run = _point(opts, run_spec, work, bare, extra_url)
                        run["variant"] = variant
                        print(run_line(run, opts.engine == "sim"), file=sys.stderr, flush=True)
                        runs.append(run)
        finally:
            for buf in keep:
                buf.free()
    return runs


def _point(
    opts: BenchOptions, run_spec: RunSpec, work: Workload, bare: OrtBackend | None, flap_url: str | None
) -> dict[str, Any]:
    """One measured run; with ONNX Runtime, between two runs of its bare loop."""
    spec, recorded, adapter, labels, images = work.spec, work.recorded, work.adapter, work.labels, work.images
    if opts.shards > 1:
        return sharded_point(opts, run_spec, spec, recorded, labels)
    seconds = max(3.0, opts.duration_s / 3)
    batch = run_spec.batch
    before = _bare_loop(bare, adapter, images, batch, seconds) if bare is not None else None
    backend = make_backend(opts, spec, recorded)
    gpu = gpu_letterbox() if opts.preprocess == "gpu" else None
    run = measure(run_spec, backend, adapter, labels, stream_sources(opts, images, flap_url), gpu)
    run["flap"] = run_spec.flap
    if bare is not None and before is not None:
        after = _bare_loop(bare, adapter, images, batch, seconds)
        run["bare_loop_fps"] = [round(before, 2), round(after, 2)]
        run["vs_bare_loop"] = round(2 * run["processed_fps"] / (before + after), 3)
    return run


# Isolation variants of each point: the steady cameras alone; beside K more RTSP cameras that stay up (the


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


def readers_section(opts: BenchOptions) -> list[dict[str, Any]]:
    """The readers section: every --streams count of camera readers alone (the clip's file, or --rtsp)."""
    out = []
    for streams in opts.streams:
        run_spec = RunSpec(streams, 0, opts.fps, opts.warmup_s, opts.duration_s)
        run = measure_readers(run_spec, stream_sources(replace(opts, decode=True), []))
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


def decode_section(opts: BenchOptions) -> list[dict[str, Any]]:
    """The decode section: the readers' decoders alone, unpaced, per --streams count over --shards."""
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


def against_decode(report: dict[str, Any]) -> None:
    """Each sweep run's processed rate against the decoders alone on the same streams (same run)."""
    alone = {d["streams"]: d["decoded_fps"] for d in report.get("decode_alone") or [] if d["decoded_fps"]}
    for run in report["runs"]:
        ref = alone.get(run["streams"])
        if ref:
            run["vs_decode_alone"] = round(run["processed_fps"] / ref, 3)


def run_line(run: dict[str, Any], simulated: bool = False) -> str:
    lat = run["latency_ms"]
    flap = f" + {run['flap']} {run['variant']}" if run.get("flap") else ""
    line = (
        f"bench: {'simulated engine: ' if simulated else ''}{run['streams']:>2} streams{flap}, "
        f"batch <= {run['batch']}: "
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
