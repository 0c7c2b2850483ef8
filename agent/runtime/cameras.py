"""A running camera as the daemon keeps it, and the class mask of its route."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from agent.config import CameraConfig, ConfigError
from agent.events import CameraEvents
from agent.telemetry import RateCounter
from pipelines.sources import CameraReader


@dataclass
class CameraRuntime:
    name: str
    cfg: CameraConfig
    reader: CameraReader
    state: str = "starting"
    reason: str | None = None
    fps_in: RateCounter = field(default_factory=RateCounter)
    fps_out: RateCounter = field(default_factory=RateCounter)
    last_frame_in: int = 0
    last_capture_ts: float | None = None  # wall-clock capture time of the newest frame published
    # Detections delivered since start and the ages (ms) of the last results at delivery: a deployment's
    # watch reads them (agent.runtime.deploy_host).
    detections_out: int = 0
    ages_ms: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    events: CameraEvents | None = None  # tracking, zones, lines and their events (tracking.enabled)
    # publish.detections on_change: what the last published detections held, and when (monotonic).
    last_signature: bytes | None = None
    last_published: float = -1e9


def class_mask(cam_name: str, cam: CameraConfig, labels: list[str], labels_src: str) -> np.ndarray | None:
    if not cam.classes:
        return None
    index = {name: i for i, name in enumerate(labels)}
    unknown = [c for c in cam.classes if c not in index]
    if unknown:
        raise ConfigError(f"cameras.{cam_name}.classes: unknown class {unknown[0]!r} (labels: {labels_src})")
    mask = np.zeros(len(labels), dtype=bool)
    mask[[index[c] for c in cam.classes]] = True
    return mask
