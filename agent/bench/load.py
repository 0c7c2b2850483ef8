"""Load for the benchmark: N streams into a ModelWorker, and one measured run of it.

A run warms up, then measures a window: frames offered / processed, frame age at delivery (capture ->
results handed to the sinks, the payload built as the daemon builds it), per-stage times, engine time,
process CPU per frame, and a timeline (throughput, age p95, RSS per window) that shows growth over long
runs. With camera readers (agent.bench.streams) also: the time from start to each camera streaming, and
each camera's own delivered rate.

Isolation (`RunSpec.flap`): besides the `streams` steady cameras, `flap` cameras whose source drops them
every few seconds; the steady cameras' own throughput and frame age are reported apart (``steady``).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from agent.bench.stats import pct
from agent.bench.streams import LoopedClip, Readers, Sources
from agent.bench.usage import camera_rates, cpu_by_role, cpu_by_stage, decode_window, thread_cpu
from agent.mqtt.topics import payload
from agent.results import detection_fields
from engines.runtimes.base import Backend
from pipelines.frames import stage_latencies_ms
from pipelines.models.base import ModelAdapter
from pipelines.scheduler import CameraRoute, ModelWorker, Result
from pipelines.sources import FrameSlot

STAGES = ("queue", "preprocess", "wait", "infer", "postprocess", "publish", "total")


@dataclass
class RunSpec:
    streams: int
    batch: int
    fps: float
    warmup_s: float
    duration_s: float
    iterations: int | None = None  # stop the window after this many processed frames instead
    max_age_ms: float = 500.0
    window_s: float = 10.0  # timeline granularity
    flap: int = 0  # cameras beside the steady ones whose source drops them every few seconds (flapNN)


@dataclass
class _Record:
    """What the sink keeps per delivered frame (appended from the delivery thread only). Packed doubles,
    8 bytes a value, and their size is reported with the RSS, so a long run's growth can be told apart
    from the agent's own."""

    t: array[float] = field(default_factory=lambda: array("d"))
    cam: array[int] = field(default_factory=lambda: array("H"))  # index of the frame's camera
    stages: dict[str, array[float]] = field(default_factory=lambda: {s: array("d") for s in STAGES})
    gpu_ms: array[float] = field(default_factory=lambda: array("d"))

    @property
    def mb(self) -> float:
        arrays = [self.t, self.cam, self.gpu_ms, *self.stages.values()]
        return sum(a.itemsize * len(a) for a in arrays) / 2**20


@dataclass
class _Counters:
    """The worker's, the sources' and the process's counters at one instant; a window is two of them."""

    busy_s: float
    offered: int
    frames: int
    batches: int
    fill: float
    dropped: int
    stale: int
    decode: dict[str, float] | None
    cpu_s: float
    threads: dict[int, tuple[str, float]]
    stage_cpu: dict[str, float]
    cameras: dict[str, tuple[int, int]] | None

    @classmethod
    def take(
        cls,
        worker: ModelWorker,
        routes: list[CameraRoute],
        sources: LoopedClip | Readers,
        backend: Backend,
        proc: psutil.Process,
    ) -> _Counters:
        cpu = proc.cpu_times()
        return cls(
            busy_s=getattr(backend, "busy_s", 0.0),
            offered=sources.offered,
            frames=worker.frames,
            batches=worker.batches,
            fill=worker.batch_fill_sum,
            dropped=sum(r.slot.dropped for r in routes),
            stale=worker.stale,
            decode=sources.decode_stats() if isinstance(sources, Readers) else None,
            cpu_s=cpu.user + cpu.system,
            threads=thread_cpu(proc),
            stage_cpu=dict(worker.cpu_s),
            cameras=sources.per_camera() if isinstance(sources, Readers) else None,
        )


def _sink(
    rec: _Record, measuring: threading.Event, labels: list[str], index: dict[str, int]
) -> Callable[[Result], None]:
    """The worker's sink: builds the payload as the daemon does; records each frame while `measuring`."""

    def sink(result: Result) -> None:
        body = payload("detections", **detection_fields(result, labels))  # what the daemon publishes
        frame = result.frame
        frame.stamp("published")
        if not measuring.is_set() or not body:
            return
        lat = stage_latencies_ms(frame)
        lat["publish"] = (frame.stamps["published"] - frame.stamps["postprocessed"]) * 1000.0
        rec.t.append(frame.stamps["published"])
        rec.cam.append(index[frame.camera])
        for stage in STAGES:
            if stage in lat:
                rec.stages[stage].append(lat[stage])
        if result.gpu_ms is not None:
            rec.gpu_ms.append(result.gpu_ms)

    return sink


def measure(
    spec: RunSpec,
    backend: Backend,
    adapter: ModelAdapter,
    labels: list[str],
    make_sources: Sources,
    gpu: Any = None,
    samples: bool = False,
) -> dict[str, Any]:
    """One run: `spec.streams` streams into a worker of batch `spec.batch` on `backend`; its report.
    `samples`: also every delivered frame's age (`samples_ms`), for merging runs of several processes."""
    rec = _Record()
    measuring = threading.Event()
    names = [f"cam{i:02d}" for i in range(spec.streams)] + [f"flap{i:02d}" for i in range(spec.flap)]
    sink = _sink(rec, measuring, labels, {name: i for i, name in enumerate(names)})
    worker = ModelWorker(
        "bench",
        backend,
        adapter,
        [sink],
        max_batch=spec.batch,
        max_age_ms=spec.max_age_ms,
        gpu_preprocess=gpu,
    )
    routes = []
    for name in names:
        routes.append(CameraRoute(name, worker.new_slot(), None, 0.4))
        worker.add_camera(routes[-1])
    sources = make_sources([(r.name, r.slot) for r in routes])
    proc = psutil.Process()
    worker.start()
    sources.start()
    try:
        time.sleep(spec.warmup_s)
        before = _Counters.take(worker, routes, sources, backend, proc)
        t0 = time.monotonic()
        measuring.set()
        timeline = _watch(spec, worker, proc, t0, before.frames, rec)
        measuring.clear()
        _add_age_p95(timeline, rec, t0)
        elapsed = time.monotonic() - t0
        after = _Counters.take(worker, routes, sources, backend, proc)
        decode = decode_window(sources, before.decode, elapsed)
        by_stage = cpu_by_stage(
            before.stage_cpu, after.stage_cpu, sources, before.decode, after.frames - before.frames
        )
        cameras = camera_rates(sources, before.cameras, elapsed)
    finally:
        sources.stop()
        worker.stop(timeout=10)
        worker.close_backends()
    return {
        **_report(spec, rec, before, after, elapsed, backend.slots),
        "cpu_ms_per_frame_by_stage": by_stage,
        "decode": decode,
        "timeline": timeline,
        **cameras,
        **({"steady": _steady(rec, spec, elapsed, cameras)} if cameras else {}),
        **({"samples_ms": rec.stages["total"].tolist()} if samples else {}),
    }


def _report(
    spec: RunSpec, rec: _Record, before: _Counters, after: _Counters, elapsed: float, slots: int
) -> dict[str, Any]:
    """The window's rates, counts, frame ages and CPU (bench.json's run fields, in their order)."""
    offered = after.offered - before.offered
    frames = after.frames - before.frames
    batches = after.batches - before.batches
    fill = after.fill - before.fill
    busy = after.busy_s - before.busy_s
    cpu_s = after.cpu_s - before.cpu_s
    # Frames still in flight when the window closed were offered in it but delivered after it.
    processed_ratio = frames / offered if offered else None
    return {
        "streams": spec.streams,
        "batch": spec.batch,
        "seconds": round(elapsed, 2),
        "offered_fps": round(offered / elapsed, 2),
        "nominal_fps": round(spec.streams * spec.fps, 2),
        "processed_fps": round(frames / elapsed, 2),
        "processed_ratio": round(processed_ratio, 4) if processed_ratio is not None else None,
        "dropped_in_slot": after.dropped - before.dropped,
        "dropped_stale": after.stale - before.stale,
        "batches": batches,
        "mean_batch": round(frames / batches, 2) if batches else None,
        "batch_fill": round(fill / batches, 3) if batches else None,
        "latency_ms": pct(rec.stages["total"]),  # frame age when its results reached the sinks
        "stages_ms": {s: pct(v) for s, v in rec.stages.items() if v},
        "device_ms": pct(rec.gpu_ms) if rec.gpu_ms else None,
        "engine_busy": round(busy / (elapsed * slots), 3) if busy else None,
        "cpu_ms_per_frame": round(cpu_s * 1000.0 / frames, 3) if frames else None,
        "cpu_percent": round(100.0 * cpu_s / elapsed, 1),
        "cpu_ms_per_frame_by_thread": cpu_by_role(before.threads, after.threads, cpu_s, frames),
    }


def measure_readers(spec: RunSpec, make_sources: Sources) -> dict[str, Any]:
    """Camera readers alone (no model): start-up to streaming, each camera's delivered rate, CPU per frame.
    What the readers can do on this machine, apart from the pipeline that shares its cores."""
    sources = make_sources([(f"cam{i:02d}", FrameSlot()) for i in range(spec.streams)])
    if not isinstance(sources, Readers):
        raise ValueError("the readers section needs camera readers (--decode or --rtsp)")
    proc = psutil.Process()
    sources.start()
    try:
        time.sleep(spec.warmup_s)
        cams0, offered0, cpu0 = sources.per_camera(), sources.offered, proc.cpu_times()
        t0 = time.monotonic()
        time.sleep(spec.duration_s)
        elapsed = time.monotonic() - t0
        cpu1, offered = proc.cpu_times(), sources.offered - offered0
        cameras = camera_rates(sources, cams0, elapsed)
    finally:
        sources.stop()
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {
        "streams": spec.streams,
        "seconds": round(elapsed, 2),
        "offered_fps": round(offered / elapsed, 2),
        "nominal_fps": round(spec.streams * spec.fps, 2),
        "cpu_ms_per_frame": round(cpu_s * 1000.0 / offered, 3) if offered else None,
        "cpu_percent": round(100.0 * cpu_s / elapsed, 1),
        **cameras,
    }


def _watch(
    spec: RunSpec,
    worker: ModelWorker,
    proc: psutil.Process,
    t0: float,
    f0: int,
    rec: _Record,
) -> list[dict[str, float]]:
    """Wait out the window (duration or iterations), sampling throughput and RSS every window_s."""
    timeline: list[dict[str, float]] = []
    last_t, last_f = t0, f0
    end = t0 + spec.duration_s
    while True:
        now = time.monotonic()
        done = (
            worker.frames - f0 >= spec.iterations if spec.iterations else now >= end
        ) or not worker.running
        if done or now - last_t >= spec.window_s:
            timeline.append(
                {
                    "t_s": round(now - t0, 1),
                    "processed_fps": round((worker.frames - last_f) / max(now - last_t, 1e-9), 2),
                    "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                    "records_mb": round(rec.mb, 1),  # the bench's own per-frame records, part of rss_mb
                }
            )
            last_t, last_f = now, worker.frames
        if done:
            return timeline
        time.sleep(0.05)


def _add_age_p95(windows: list[dict[str, float]], rec: _Record, t0: float) -> None:
    """Each timeline window's frame-age p95 (ms), from the per-frame records (t and total are appended
    together, so they align)."""
    at = np.asarray(rec.t) - t0
    age = np.asarray(rec.stages["total"])
    lo = 0.0
    for w in windows:
        sel = age[(at >= lo) & (at < w["t_s"])]
        w["age_p95_ms"] = round(float(np.percentile(sel, 95)), 2) if sel.size else None
        lo = w["t_s"]


def _steady(rec: _Record, spec: RunSpec, elapsed: float, cameras: dict) -> dict[str, Any]:
    """The steady cameras' own share of the run: what a flapping neighbour must not take from them."""
    cam = np.asarray(rec.cam)
    mine = cam < spec.streams
    age = np.asarray(rec.stages["total"])[mine]
    return {
        "cameras": spec.streams,
        "processed_fps": round(int(mine.sum()) / elapsed, 2),
        "latency_ms": pct(age.tolist()),
        "camera_fps": cameras.get("camera_fps"),
    }
