"""`bench --shards N`: a sweep point's streams split over N processes, and decode alone as the reference.

Each shard process is a complete pipeline for its share of the streams (readers, decode, preprocess, a
worker over its own engine), as a shard of the daemon is; one interpreter lock per shard. The shards start
their measured windows together (a barrier once every backend is loaded); the point is the sum: frames
offered and processed over all shards, frame age percentiles over every delivered frame of every shard,
and host CPU per processed frame summed over all processes (the parent included).

`--gpus 0,1`: shard k runs on GPU gpus[k % len(gpus)] (CUDA_VISIBLE_DEVICES set before it starts).

The `decode` section measures what the decoders alone deliver for the same streams, unpaced (files as fast
as they decode, nothing consumes the frames), in the same number of processes: the ceiling the sweep is
compared with (`vs_decode_alone`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import psutil

from agent.bench.args import BenchOptions
from agent.bench.engine import gpu_letterbox, make_backend
from agent.bench.load import RunSpec, measure
from agent.bench.stats import pct
from agent.bench.streams import Readers, placed_frames, read_clip, stream_sources
from pipelines.sources import FrameSlot, SourceSpec

BARRIER_S = 300.0  # every shard loads its engine and CUDA state before the windows start together


def split(streams: int, shards: int) -> list[int]:
    """Streams per shard, as even as it goes (the first ones take the remainder); no empty shard."""
    shards = max(1, min(shards, streams))
    base, extra = divmod(streams, shards)
    return [base + (1 if k < extra else 0) for k in range(shards)]


@contextlib.contextmanager
def _on_gpu(gpus: list[int] | None, k: int) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for a child started inside (spawn copies the environment at start)."""
    if not gpus:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus[k % len(gpus)])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _run_children(target: Any, args_of: list[tuple], gpus: list[int] | None) -> tuple[list[dict], float]:
    """Start one process per args tuple (its last two arguments: the barrier and the result queue are
    appended), collect one result each; the parent's own CPU seconds meanwhile."""
    ctx = mp.get_context("spawn")  # no fork: the parent may hold threads and CUDA state
    barrier = ctx.Barrier(len(args_of))
    results = ctx.Queue()
    procs = []
    me = psutil.Process()
    cpu0 = me.cpu_times()
    try:
        for k, args in enumerate(args_of):
            with _on_gpu(gpus, k):
                p = ctx.Process(target=target, args=(*args, barrier, results), name=f"bench-shard-{k}")
                p.start()
            procs.append(p)
        out: dict[int, dict] = {}
        while len(out) < len(procs):
            try:
                k, run = results.get(timeout=5.0)
            except Exception:  # queue.Empty: is anyone still alive?
                if not any(p.is_alive() for p in procs):
                    dead = [k for k in range(len(procs)) if k not in out]
                    raise RuntimeError(f"bench shard(s) {dead} exited without a result") from None
                continue
            if "error" in run:
                raise RuntimeError(f"bench shard {k}: {run['error']}")
            out[k] = run
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    cpu1 = me.cpu_times()
    return [out[k] for k in range(len(procs))], (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)


# ---- the sweep point ---------------------------------------------------------------------------------------
def _point_child(
    k: int,
    opts: BenchOptions,
    run_spec: RunSpec,
    spec: Any,
    recorded: list[dict[str, np.ndarray]],
    labels: list[str],
    first: int,
    barrier: Any,
    results: Any,
) -> None:
    try:
        import logging

        from pipelines.models import make_adapter

        logging.basicConfig(level=logging.WARNING)
        adapter = make_adapter(opts.format, spec, len(labels), grafted=opts.postprocess == "graph")
        images: list[np.ndarray] = []
        keep: list[Any] = []
        if opts.rtsp is None and not opts.decode:  # looped copies in memory: this process's own
            images, keep = placed_frames(opts, read_clip(opts.clip, opts.clip_frames, opts.resolution))
        backend = make_backend(opts, spec, recorded)
        gpu = gpu_letterbox() if opts.preprocess == "gpu" else None
        barrier.wait(BARRIER_S)
        sources = stream_sources(opts, images, first=first)
        run = measure(run_spec, backend, adapter, labels, sources, gpu, samples=True)
        for buf in keep:
            buf.free()
        results.put((k, run))
    except BaseException as exc:  # the parent reports it; a child's traceback would be lost
        results.put((k, {"error": f"{type(exc).__name__}: {exc}"}))


def sharded_point(
    opts: BenchOptions, run_spec: RunSpec, spec: Any, recorded: list[dict[str, np.ndarray]], labels: list[str]
) -> dict[str, Any]:
    """One sweep point over opts.shards processes; the merged run (bench.json's run fields) + `shards`."""
    shares = split(run_spec.streams, opts.shards)
    args, first = [], 1
    for k, n in enumerate(shares):
        args.append((k, opts, replace(run_spec, streams=n), spec, recorded, labels, first))
        first += n
    runs, parent_cpu_s = _run_children(_point_child, args, opts.gpus)
    return merge(runs, run_spec, parent_cpu_s, opts.gpus)


def merge(runs: list[dict[str, Any]], run_spec: RunSpec, parent_cpu_s: float, gpus: list[int] | None) -> dict:
    """The shards' runs as one: sums of rates and counts, percentiles over all their delivered frames,
    CPU per frame over every process."""
    frames = [r["processed_fps"] * r["seconds"] for r in runs]
    offered = [r["offered_fps"] * r["seconds"] for r in runs]
    cpu_s = sum(r["cpu_percent"] / 100.0 * r["seconds"] for r in runs) + parent_cpu_s
    ages = np.concatenate([np.asarray(r.pop("samples_ms"), dtype=np.float64) for r in runs])
    batches = sum(r["batches"] for r in runs)
    seconds = float(np.mean([r["seconds"] for r in runs]))
    total = sum(frames)
    merged: dict[str, Any] = {
        "streams": run_spec.streams,
        "batch": run_spec.batch,
        "seconds": round(seconds, 2),
        "offered_fps": round(sum(r["offered_fps"] for r in runs), 2),
        "nominal_fps": round(run_spec.streams * run_spec.fps, 2),
        "processed_fps": round(sum(r["processed_fps"] for r in runs), 2),
        "processed_ratio": round(total / sum(offered), 4) if sum(offered) else None,
        "dropped_in_slot": sum(r["dropped_in_slot"] for r in runs),
        "dropped_stale": sum(r["dropped_stale"] for r in runs),
        "batches": batches,
        "mean_batch": round(total / batches, 2) if batches else None,
        "latency_ms": pct(ages.tolist()),
        "cpu_ms_per_frame": round(cpu_s * 1000.0 / total, 3) if total else None,
        "cpu_percent": round(100.0 * cpu_s / seconds, 1) if seconds else None,
        "cpu_parent_s": round(parent_cpu_s, 3),
        "shards": [
            {
                "shard": k,
                "gpu": gpus[k % len(gpus)] if gpus else None,
                "streams": r["streams"],
                "processed_fps": r["processed_fps"],
                "processed_ratio": r["processed_ratio"],
                "age_p95_ms": r["latency_ms"]["p95"],
                "cpu_ms_per_frame": r["cpu_ms_per_frame"],
                "engine_busy": r.get("engine_busy"),
                "decode": r.get("decode"),
                "cpu_ms_per_frame_by_thread": r.get("cpu_ms_per_frame_by_thread"),
                "offered_fps": r.get("offered_fps"),
            }
            for k, r in enumerate(runs)
        ],
    }
    cams = [r for r in runs if r.get("camera_fps")]
    if cams:
        merged["camera_fps"] = {
            "min": min(r["camera_fps"]["min"] for r in cams),
            "max": max(r["camera_fps"]["max"] for r in cams),
        }
        ups = [r["startup"] for r in cams]
        last = [u["all_streaming_s"] for u in ups]
        merged["startup"] = {
            "cameras": sum(u["cameras"] for u in ups),
            "all_streaming_s": None if None in last else max(last),
        }
    return merged


# ---- decode alone ------------------------------------------------------------------------------------------
def _decode_child(k: int, opts: BenchOptions, streams: int, first: int, barrier: Any, results: Any) -> None:
    try:
        specs = []
        for i in range(first, first + streams):
            url = opts.rtsp.replace("{i}", str(i)) if opts.rtsp else str(opts.clip)
            # Files unpaced (realtime False) and no fps limit: as fast as the decoder gives pictures.
            specs.append(SourceSpec(camera=f"cam{i:03d}", url=url, loop=True, realtime=False))
        readers = Readers(specs, [FrameSlot() for _ in specs], opts.decoder)
        proc = psutil.Process()
        barrier.wait(BARRIER_S)
        readers.start()
        try:
            time.sleep(opts.warmup_s)
            n0, cpu0, t0 = readers.offered, proc.cpu_times(), time.monotonic()
            time.sleep(opts.duration_s)
            n1, cpu1, t1 = readers.offered, proc.cpu_times(), time.monotonic()
        finally:
            readers.stop()
        cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        results.put((k, {"frames": n1 - n0, "seconds": t1 - t0, "cpu_s": cpu_s}))
    except BaseException as exc:
        results.put((k, {"error": f"{type(exc).__name__}: {exc}"}))


def decode_alone(opts: BenchOptions, streams: int) -> dict[str, Any]:
    """Decoders alone for `streams` streams over opts.shards processes: pictures/s in all."""
    shares = split(streams, opts.shards)
    args, first = [], 1
    for k, n in enumerate(shares):
        args.append((k, opts, n, first))
        first += n
    runs, parent_cpu_s = _run_children(_decode_child, args, opts.gpus)
    frames = sum(r["frames"] for r in runs)
    seconds = float(np.mean([r["seconds"] for r in runs]))
    cpu_s = sum(r["cpu_s"] for r in runs) + parent_cpu_s
    return {
        "streams": streams,
        "shards": len(shares),
        "decoder": opts.decoder,
        "seconds": round(seconds, 2),
        "decoded_fps": round(frames / seconds, 1) if seconds else None,
        "per_shard_fps": [round(r["frames"] / r["seconds"], 1) for r in runs],
        "cpu_ms_per_frame": round(cpu_s * 1000.0 / frames, 3) if frames else None,
    }
