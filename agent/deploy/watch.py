"""After a promotion, for watch_s: roll back by itself when the new version makes things worse.

    reason = judge(before, now, cfg)      # pure: health before the promotion vs now -> a reason or None
    reason, figures = watch(sample, before, cfg, watch_s, cancel)   # the loop

A rollback when, on the model's cameras:
- the engine errors (the error count grew since the promotion);
- a camera that was running fails (its state becomes failed/stopped/error);
- the frame age p95 grows beyond `age_p95_factor` x its value before the promotion (a floor of
  AGE_FLOOR_MS keeps an idle fast camera's 2 ms -> 7 ms from counting);
- detections per frame collapse below `detections_collapse_ratio` x the value before, on a camera that had
  traffic (detections) before and processes frames now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.config.deploy import DeployWatchConfig
from agent.deploy.host import CameraHealth

AGE_FLOOR_MS = 50.0
BAD_STATES = frozenset({"failed", "error", "stopped", "offline"})
INTERVAL_S = 1.0


def judge(
    before: Mapping[str, CameraHealth], now: Mapping[str, CameraHealth], cfg: DeployWatchConfig
) -> str | None:
    """Why the promoted version must go (one line), or None."""
    for cam, h in sorted(now.items()):
        b = before.get(cam)
        if b is None:
            continue
        if h.errors > b.errors:
            return f"watch: engine errors on camera {cam} ({h.errors - b.errors} since the promotion)"
        if h.state in BAD_STATES and b.state not in BAD_STATES:
            return f"watch: camera {cam} {h.state} after the promotion (was {b.state})"
        if b.age_p95_ms is not None and h.age_p95_ms is not None:
            limit = cfg.age_p95_factor * max(b.age_p95_ms, AGE_FLOOR_MS)
            if h.age_p95_ms > limit:
                return (
                    f"watch: camera {cam} frame age p95 {h.age_p95_ms:.0f} ms > {cfg.age_p95_factor:g}x "
                    f"its {b.age_p95_ms:.0f} ms before the promotion"
                )
        had_traffic = b.frames > 0 and b.detections_per_frame > 0
        if had_traffic and h.frames > 0:
            floor = cfg.detections_collapse_ratio * b.detections_per_frame
            if h.detections_per_frame < floor:
                return (
                    f"watch: camera {cam} detections per frame collapsed to {h.detections_per_frame:.2f} "
                    f"from {b.detections_per_frame:.2f} before the promotion"
                )
    return None


def figures(
    before: Mapping[str, CameraHealth], now: Mapping[str, CameraHealth], samples: int
) -> dict[str, Any]:
    """The watch's figures for the state's checks.watch."""
    cams = {}
    for cam, h in sorted(now.items()):
        b = before.get(cam)
        cams[cam] = {
            "state": h.state,
            "age_p95_ms": h.age_p95_ms,
            "age_p95_ms_before": None if b is None else b.age_p95_ms,
            "detections_per_frame": round(h.detections_per_frame, 3),
            "detections_per_frame_before": None if b is None else round(b.detections_per_frame, 3),
            "errors": h.errors - (b.errors if b else 0),
        }
    return {"samples": samples, "cameras": cams}


def watch(
    sample: Callable[[], Mapping[str, CameraHealth]],
    before: Mapping[str, CameraHealth],
    cfg: DeployWatchConfig,
    watch_s: float,
    cancel: threading.Event,
    interval_s: float = INTERVAL_S,
    on_sample: Callable[[float, dict[str, Any]], None] | None = None,
) -> tuple[str | None, dict[str, Any]]:
    """Sample the health every `interval_s` for `watch_s` (or until `cancel`): the first reason to roll
    back and the figures of the last sample. `on_sample(progress, figures)` after each sample."""
    start = time.monotonic()
    samples = 0
    last: dict[str, Any] = figures(before, before, 0)
    while True:
        now = sample()
        samples += 1
        last = figures(before, now, samples)
        reason = judge(before, now, cfg)
        if reason is not None:
            return reason, last
        elapsed = time.monotonic() - start
        if on_sample is not None:
            on_sample(min(1.0, elapsed / watch_s) if watch_s > 0 else 1.0, last)
        if elapsed >= watch_s or cancel.wait(min(interval_s, max(0.0, watch_s - elapsed))):
            return None, last
