"""Load for the benchmark: N streams into a ModelWorker, and one measured run of it.

Streams are either looped copies of a clip decoded once into memory and put into the worker's slots at
`fps` each by one clock thread (the agent's own cost, without decoding), or real camera readers
(`CameraReader`: the clip decoded per stream, or RTSP streams). A run warms up, then measures a window:
frames offered / processed, frame age at delivery (capture -> results handed to the sinks, the payload
built as the daemon builds it), per-stage times, engine time, process CPU per frame, and a timeline
(throughput, age p95, RSS per window) that shows growth over long runs. With readers also: the time from
start to each camera streaming, and each camera's own delivered rate.

Isolation (`RunSpec.flap`): besides the `streams` steady cameras, `flap` cameras whose source drops them
every few seconds; the steady cameras' own throughput and frame age are reported apart (``steady``).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from agent.results import detection_fields
from agent.topics import payload
from engines.runtimes.base import Backend
from pipelines.frames import Frame, stage_latencies_ms
from pipelines.models.base import ModelAdapter
from pipelines.scheduler import CameraRoute, ModelWorker, Result
from pipelines.sources import CameraReader, FrameSlot, SourceSpec, open_reader

STAGES = ("queue", "preprocess", "wait", "infer", "postprocess", "publish", "total")


def read_clip(clip: Path, limit: int, size: tuple[int, int] | None = None) -> list[np.ndarray]:
    """The first `limit` frames of a video, resized to `size` (w, h) if given."""
    import cv2

    cap = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    frames: list[np.ndarray] = []
    try:
        while len(frames) < limit:
            ok, img = cap.read()
            if not ok:
                break
            frames.append(img if size is None else cv2.resize(img, size, interpolation=cv2.INTER_LINEAR))
    finally:
        cap.release()
    if not frames:
        raise RuntimeError(f"{clip}: no frames decoded")
    return frames


class LoopedClip:
    """N cameras replaying the same frames at `fps` each. One clock thread puts every frame, the cameras'
    phases spread over the frame period as independent cameras' would be; each starts at another frame."""

    def __init__(self, images: list[np.ndarray], slots: list[tuple[str, FrameSlot]], fps: float) -> None:
        self._images, self._slots, self._fps = images, slots, fps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-clock", daemon=True)
        self.offered = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        n = len(self._slots)
        tick = 1.0 / (self._fps * n)
        t0 = time.monotonic()
        k = 0
        while not self._stop.is_set():
            delay = t0 + k * tick - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            cam, slot = self._slots[k % n]
            i = k // n
            frame = Frame(cam, i, self._images[(i + 7 * (k % n)) % len(self._images)], time.time())
            frame.stamp("captured")
            slot.put(frame)
            self.offered += 1
            k += 1


class Readers:
    """N camera readers (FFmpeg or NVDEC decode of a looped file, or RTSP), as the daemon runs them."""

    def __init__(self, specs: list[SourceSpec], slots: list[FrameSlot], decoder: str = "cpu") -> None:
        self.decoder = decoder
        self._readers: list[CameraReader] = [
            open_reader(s, slot, None, decoder=decoder) for s, slot in zip(specs, slots, strict=True)
        ]
        self.started: float | None = None

    def startup(self) -> dict[str, Any]:
        """Seconds from start() to each camera's first frame: first, median, last (None until all stream)."""
        t0 = self.started or 0.0
        times = sorted(r.streaming_at - t0 for r in self._readers if r.streaming_at is not None)
        everyone = len(times) == len(self._readers)
        return {
            "cameras": len(self._readers),
            "streaming": len(times),
            "first_s": round(times[0], 3) if times else None,
            "median_s": round(times[len(times) // 2], 3) if times else None,
            "all_streaming_s": round(times[-1], 3) if everyone else None,
        }

    def per_camera(self) -> dict[str, tuple[int, int]]:
        """Camera -> (frames handed over, reconnects) so far."""
        return {r.spec.camera: (r.frames_in, r.reconnects) for r in self._readers}

    def decode_stats(self) -> dict[str, float]:
        """NVDEC sessions' totals: packets, pictures, errors, host seconds inside Decode()."""
        out = {
            "packets": 0.0,
            "frames": 0.0,
            "errors": 0.0,
            "decode_s": 0.0,
            "demux_cpu_s": 0.0,
            "decode_cpu_s": 0.0,
        }
        for r in self._readers:
            totals = getattr(r, "decode_totals", None)
            stats = totals() if totals is not None else None
            if stats is not None:
                for k in out:
                    out[k] += float(getattr(stats, k))
        return out

    def start(self) -> None:
        self.started = time.monotonic()
        for r in self._readers:
            r.start()

    def stop(self) -> None:
        for r in self._readers:
            r.request_stop()
        for r in self._readers:
            r.stop()

    @property
    def offered(self) -> int:
        return sum(r.frames_in for r in self._readers)


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


def _pct(values: array[float] | list[float]) -> dict[str, float | int | None]:
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {
        "p50": round(float(p50), 3),
        "p95": round(float(p95), 3),
        "p99": round(float(p99), 3),
        "mean": round(float(a.mean()), 3),
        "n": int(a.size),
    }


def measure(
    spec: RunSpec,
    backend: Backend,
    adapter: ModelAdapter,
    labels: list[str],
    make_sources: Callable[[list[tuple[str, FrameSlot]]], LoopedClip | Readers],
    gpu: Any = None,
    samples: bool = False,
) -> dict[str, Any]:
    """One run: `spec.streams` streams into a worker of batch `spec.batch` on `backend`; its report.
    `samples`: also every delivered frame's age (`samples_ms`), for merging runs of several processes."""
    rec = _Record()
    measuring = threading.Event()
    names = [f"cam{i:02d}" for i in range(spec.streams)] + [f"flap{i:02d}" for i in range(spec.flap)]
    index = {name: i for i, name in enumerate(names)}

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
        busy0 = getattr(backend, "busy_s", 0.0)
        offered0, frames0, batches0, fill0 = (
            sources.offered,
            worker.frames,
            worker.batches,
            worker.batch_fill_sum,
        )
        dropped0 = sum(r.slot.dropped for r in routes)
        stale0 = worker.stale
        dec0 = sources.decode_stats() if isinstance(sources, Readers) else None
        cpu0 = proc.cpu_times()
        threads0 = _thread_cpu(proc)
        stage_cpu0 = dict(worker.cpu_s)
        cams0 = sources.per_camera() if isinstance(sources, Readers) else None
        t0 = time.monotonic()
        measuring.set()
        timeline = _watch(spec, worker, sources, proc, t0, frames0, rec)
        measuring.clear()
        _add_age_p95(timeline, rec, t0)
        elapsed = time.monotonic() - t0
        cpu1 = proc.cpu_times()
        threads1 = _thread_cpu(proc)
        stage_cpu1 = dict(worker.cpu_s)
        offered = sources.offered - offered0
        frames = worker.frames - frames0
        batches = worker.batches - batches0
        fill = worker.batch_fill_sum - fill0
        dropped = sum(r.slot.dropped for r in routes) - dropped0
        stale = worker.stale - stale0
        busy = getattr(backend, "busy_s", 0.0) - busy0
        decode = _decode_window(sources, dec0, elapsed)
        by_stage = _by_stage(stage_cpu0, stage_cpu1, sources, dec0, frames)
        cameras = _cameras(sources, cams0, elapsed)
    finally:
        sources.stop()
        worker.stop(timeout=10)
        worker.close_backends()
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
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
        "dropped_in_slot": dropped,
        "dropped_stale": stale,
        "batches": batches,
        "mean_batch": round(frames / batches, 2) if batches else None,
        "batch_fill": round(fill / batches, 3) if batches else None,
        "latency_ms": _pct(rec.stages["total"]),  # frame age when its results reached the sinks
        "stages_ms": {s: _pct(v) for s, v in rec.stages.items() if v},
        "device_ms": _pct(rec.gpu_ms) if rec.gpu_ms else None,
        "engine_busy": round(busy / (elapsed * backend.slots), 3) if busy else None,
        "cpu_ms_per_frame": round(cpu_s * 1000.0 / frames, 3) if frames else None,
        "cpu_percent": round(100.0 * cpu_s / elapsed, 1),
        "cpu_ms_per_frame_by_thread": _by_role(threads0, threads1, cpu_s, frames),
        "cpu_ms_per_frame_by_stage": by_stage,
        "decode": decode,
        "timeline": timeline,
        **cameras,
        **({"steady": _steady(rec, spec, elapsed, cameras)} if cameras else {}),
        **({"samples_ms": rec.stages["total"].tolist()} if samples else {}),
    }


def measure_readers(
    spec: RunSpec, make_sources: Callable[[list[tuple[str, FrameSlot]]], LoopedClip | Readers]
) -> dict[str, Any]:
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
        cameras = _cameras(sources, cams0, elapsed)
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


# Thread name -> the stages it runs (pipelines.sources / nvdec readers, pipelines.scheduler's threads).
def _role(name: str) -> str:
    if name.startswith("reader-"):
        return "demux_decode"
    if name.startswith("model-") and "-infer-" in name:
        return "infer"
    if name.startswith("model-") and name.endswith("-out"):
        return "postprocess_publish"
    if name.startswith("model-"):
        return "batch_preprocess"
    if name == "bench-clock":
        return "clock"
    return "other"


def _thread_cpu(proc: psutil.Process) -> dict[int, tuple[str, float]]:
    """Native thread id -> (role, CPU seconds) for this process's threads (psutil reads /proc per thread)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        threads = proc.threads()
    except psutil.Error:
        return {}
    return {t.id: (_role(names.get(t.id, "")), t.user_time + t.system_time) for t in threads}


def _by_role(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], total_s: float, frames: int
) -> dict[str, float] | None:
    """Host CPU ms per processed frame by stage group; threads that ended in the window count as "other"
    (the remainder of the process total)."""
    if not frames or not after:
        return None
    out: dict[str, float] = {}
    for tid, (role, cpu) in after.items():
        spent = cpu - before.get(tid, (role, 0.0))[1]
        out[role] = out.get(role, 0.0) + spent
    out["other"] = out.get("other", 0.0) + max(0.0, total_s - sum(out.values()))
    return {k: round(v * 1000.0 / frames, 3) for k, v in sorted(out.items())}


def _by_stage(
    before: dict[str, float],
    after: dict[str, float],
    sources: LoopedClip | Readers,
    dec0: dict[str, float] | None,
    frames: int,
) -> dict[str, float] | None:
    """Host CPU ms per processed frame of each stage, from time.thread_time() around it: demux and decode
    (NVDEC readers; a CPU reader's read() does both and shows as demux_decode by thread), preprocess,
    postprocess, publish (the sinks: payload and MQTT hand-off)."""
    if not frames:
        return None
    out = {k: after[k] - before.get(k, 0.0) for k in after}
    if isinstance(sources, Readers) and dec0 is not None and sources.decoder == "nvdec":
        dec1 = sources.decode_stats()
        out["demux"] = dec1["demux_cpu_s"] - dec0["demux_cpu_s"]
        out["decode"] = dec1["decode_cpu_s"] - dec0["decode_cpu_s"]
    return {k: round(v * 1000.0 / frames, 3) for k, v in out.items()}


def _decode_window(sources: LoopedClip | Readers, before: dict[str, float] | None, elapsed: float) -> Any:
    """Decoder, decode fps and host ms per decoded picture (NVDEC: time inside Decode()) in the window."""
    if not isinstance(sources, Readers) or before is None:
        return None
    after = sources.decode_stats()
    frames = after["frames"] - before["frames"]
    out: dict[str, Any] = {"decoder": sources.decoder}
    if sources.decoder == "nvdec":
        out.update(
            decode_fps=round(frames / elapsed, 1),
            decode_call_ms=round(1000.0 * (after["decode_s"] - before["decode_s"]) / frames, 3)
            if frames
            else None,
            errors=int(after["errors"] - before["errors"]),
        )
    return out


def _watch(
    spec: RunSpec,
    worker: ModelWorker,
    sources: LoopedClip | Readers,
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


def _cameras(
    sources: LoopedClip | Readers, before: dict[str, tuple[int, int]] | None, elapsed: float
) -> dict:
    """Readers: start-up to streaming, and each camera's delivered rate in the window (min/median/max)."""
    if not isinstance(sources, Readers) or before is None:
        return {}
    after = sources.per_camera()
    steady = sorted((after[c][0] - before[c][0]) / elapsed for c in after if c.startswith("cam"))
    flapping = [c for c in after if c.startswith("flap")]
    return {
        "startup": sources.startup(),
        "camera_fps": {
            "min": round(steady[0], 2),
            "median": round(steady[len(steady) // 2], 2),
            "max": round(steady[-1], 2),
        }
        if steady
        else None,
        "flap_reconnects": sum(after[c][1] - before[c][1] for c in flapping) if flapping else None,
    }


def _steady(rec: _Record, spec: RunSpec, elapsed: float, cameras: dict) -> dict[str, Any]:
    """The steady cameras' own share of the run: what a flapping neighbour must not take from them."""
    cam = np.asarray(rec.cam)
    mine = cam < spec.streams
    age = np.asarray(rec.stages["total"])[mine]
    return {
        "cameras": spec.streams,
        "processed_fps": round(int(mine.sum()) / elapsed, 2),
        "latency_ms": _pct(age.tolist()),
        "camera_fps": cameras.get("camera_fps"),
    }
