"""What a measured window used and delivered: host CPU by thread and by stage, the decoders' work, and each
camera's start-up and rate."""

from __future__ import annotations

import threading
from typing import Any

import psutil

from agent.bench.streams import LoopedClip, Readers


# Thread name -> the stages it runs (pipelines.sources / nvdec readers, pipelines.scheduler's threads).
def thread_role(name: str) -> str:
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


def thread_cpu(proc: psutil.Process) -> dict[int, tuple[str, float]]:
    """Native thread id -> (role, CPU seconds) for this process's threads (psutil reads /proc per thread)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        threads = proc.threads()
    except psutil.Error:
        return {}
    return {t.id: (thread_role(names.get(t.id, "")), t.user_time + t.system_time) for t in threads}


def cpu_by_role(
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


def cpu_by_stage(
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


def decode_window(sources: LoopedClip | Readers, before: dict[str, float] | None, elapsed: float) -> Any:
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


def camera_rates(
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
