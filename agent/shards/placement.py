"""Which shard runs which camera, and how many shards `pipeline.shards: auto` means.

Load of a camera: the frames per second it is expected to deliver (its `fps` limit, else DEFAULT_FPS),
scaled by its picture size where the config gives one (`frame_size`, relative to 1080p). A camera keeps
the shard it had (reloads do not move running cameras); `cameras.C.shard` pins it (a move on purpose);
new cameras go to the least loaded shard, the heaviest first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from agent.config import AgentConfig, CameraConfig

DEFAULT_FPS = 25.0  # a camera without an fps limit: what most RTSP cameras send
# What one shard carries comfortably (1080p frames/s): measured on the H100 box, one process stopped near
# 1,100 frames/s and 4 shards of 400 (64 x 1080p25) delivered 99.4 % at 1.13 ms CPU per frame.
LOAD_PER_SHARD = 400.0
CORES_PER_SHARD = 4  # a shard's readers, worker, MQTT and interpreter: never more shards than cores / 4


def camera_load(cam: CameraConfig) -> float:
    fps = cam.fps or DEFAULT_FPS
    if cam.frame_size is not None:
        return fps * cam.frame_size.w * cam.frame_size.h / (1920 * 1080)
    return fps


@dataclass(frozen=True)
class ShardPlan:
    count: int
    gpus: tuple[int | None, ...]  # per shard: its GPU index (None: the process sees what CUDA gives it)
    cameras: Mapping[str, int]  # enabled camera -> shard
    why: str  # how the count was chosen, for the log and `status`

    def of(self, shard: int) -> list[str]:
        return [c for c, k in self.cameras.items() if k == shard]


def gpu_list(cfg: AgentConfig, gpus_seen: int = 0) -> list[int] | None:
    """The GPUs shards run on: pipeline.gpus, else every GPU the driver shows when there are several
    (`gpus_seen`: the caller's count, 0 where CUDA_VISIBLE_DEVICES already chose), else None."""
    if cfg.pipeline.gpus:
        return list(cfg.pipeline.gpus)
    return list(range(gpus_seen)) if gpus_seen > 1 else None


def shard_count(cfg: AgentConfig, cores: int | None = None, gpus_seen: int = 0) -> tuple[int, str]:
    """pipeline.shards as a number, and why. `auto`: by load, at least one per GPU, at most cores / 4 and
    never more than the enabled cameras."""
    cams = {n: c for n, c in cfg.cameras.items() if c.enabled}
    pinned = max((c.shard for c in cams.values() if c.shard is not None), default=-1) + 1
    setting = cfg.pipeline.shards
    if setting != "auto":
        return int(setting), f"pipeline.shards: {setting}"
    cores = cores or os.cpu_count() or 1
    load = sum(camera_load(c) for c in cams.values())
    gpus = len(gpu_list(cfg, gpus_seen) or [])
    by_load = math.ceil(load / LOAD_PER_SHARD) if load else 1
    n = max(1, min(by_load, max(1, cores // CORES_PER_SHARD), len(cams) or 1), pinned)
    if gpus > 1:
        n = max(n, min(gpus, len(cams) or 1))
        if n >= gpus:  # the same number of shards on every GPU, as far as there are cameras for them
            n = max(min(math.ceil(n / gpus) * gpus, len(cams)), pinned)
    why = (
        f"pipeline.shards: auto -> {n} ({len(cams)} cameras, {load:.0f} frames/s expected, "
        f"{LOAD_PER_SHARD:g} per shard, {cores} cores{f', {gpus} GPUs' if gpus else ''})"
    )
    return n, why


def place(
    cfg: AgentConfig,
    previous: Mapping[str, int] | None = None,
    cores: int | None = None,
    count: int | None = None,
    gpus_seen: int = 0,
) -> ShardPlan:
    """The shard of every enabled camera: pinned ones where pinned, running ones where they run, new ones
    on the least loaded shard (heaviest camera first; ties: the lower shard). `count`: the running number
    of shards (a reload keeps it; `pipeline` changes need a restart)."""
    if count is None:
        count, why = shard_count(cfg, cores, gpus_seen)
    else:
        why = f"{count} shards (kept while running)"
    bad = [
        f"cameras.{n}.shard: {c.shard}"
        for n, c in cfg.cameras.items()
        if c.shard is not None and c.shard >= count
    ]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not a shard (0..{count - 1})")
    cams = {n: c for n, c in cfg.cameras.items() if c.enabled}
    out: dict[str, int] = {}
    load = [0.0] * count
    for name, cam in cams.items():
        k = cam.shard if cam.shard is not None else (previous or {}).get(name)
        if k is not None and 0 <= k < count:
            out[name] = k
            load[k] += camera_load(cam)
    new = sorted((n for n in cams if n not in out), key=lambda n: (-camera_load(cams[n]), n))
    for name in new:
        k = min(range(count), key=lambda i: (load[i], i))
        out[name] = k
        load[k] += camera_load(cams[name])
    gpus = gpu_list(cfg, gpus_seen)
    per_gpu = tuple(gpus[k % len(gpus)] if gpus else None for k in range(count))
    return ShardPlan(count, per_gpu, dict(sorted(out.items())), why)
