"""Calibration sets: frames for INT8 calibration plus a held-out split for the accuracy gate.

    cset = load_calibration_set(ctx)
    for batch in calibration_batches(cset, model_adapter(ctx)): ...  # float32 NCHW
    counts = frames_to_capture(ctx, calibration=True)                # what a job must capture first

Layout: `{engine_dir}/{model}/calibration/` holds `000000.jpg ...` (JPEG quality 95) and
`calibration.json` (schema edge-agent/calibration-set/1: source, cameras, samples, created_at, frames,
held_out). The held-out frames are spread evenly over the capture and are never fed to calibration:
the accuracy gate measures on them. A set may hold held-out frames only (samples 0): FP16 needs nothing
else. Capturing one: agent.lifecycle.capture.

The daemon never opens its cameras a second time: a FrameTap on the model's results samples the frames
its pipeline already decodes. Only the CLI (no pipeline running) reads the cameras itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from agent.lifecycle.model import ModelContext
from pipelines.frames import host_image
from pipelines.models import ModelAdapter
from pipelines.scheduler import Result

log = logging.getLogger(__name__)

SCHEMA = "edge-agent/calibration-set/1"
MANIFEST = "calibration.json"
JPEG_QUALITY = 95
MIN_HELD_OUT = 20


class CalibrationError(RuntimeError):
    """Capturing or reading a calibration set failed; the message names the folder, file or camera."""


def default_held_out(samples: int) -> int:
    """Held-out frames on top of `samples`: every 10th frame of the capture, at least MIN_HELD_OUT."""
    return max(MIN_HELD_OUT, math.ceil(samples / 9))


@dataclass(frozen=True)
class CalibrationSet:
    directory: Path
    manifest: dict[str, Any]

    @property
    def calibration_paths(self) -> list[Path]:
        return [self.directory / f["file"] for f in self.manifest["frames"]]

    @property
    def held_out_paths(self) -> list[Path]:
        return [self.directory / f["file"] for f in self.manifest["held_out"]]

    @property
    def id(self) -> str:
        """Identity of this capture (derived models are cached against it)."""
        key = json.dumps([self.manifest["created_at"], self.manifest["frames"], self.manifest["held_out"]])
        return hashlib.sha256(key.encode()).hexdigest()[:16]


# ---- the model side: adapter and batches ---------------------------------------------------------


def model_adapter(ctx: ModelContext) -> ModelAdapter:
    """The adapter inference uses for the model, sized from its ONNX input (no runtime session needed)."""
    return ctx.spec.adapter()


def read_frames(paths: Iterable[Path]) -> Iterator[np.ndarray]:
    for p in paths:
        img = cv2.imread(str(p), cv2.IMREAD_COLOR)
        if img is None:
            raise CalibrationError(f"cannot read calibration frame {p} (run edge-agent calibrate again)")
        yield img


def calibration_batches(
    cset: CalibrationSet, adapter: ModelAdapter, batch_size: int = 1, split: str = "calibration"
) -> Iterator[np.ndarray]:
    """Preprocessed float32 NCHW batches of the calibration frames (never the held-out ones)."""
    if split not in ("calibration", "held_out"):
        raise ValueError(f"split must be 'calibration' or 'held_out', got {split!r}")
    paths = cset.calibration_paths if split == "calibration" else cset.held_out_paths
    frames = read_frames(paths)
    while chunk := list(itertools.islice(frames, batch_size)):
        yield adapter.preprocess(chunk)[0]


def load_calibration_set(ctx: ModelContext) -> CalibrationSet:
    model, d = ctx.name, ctx.calibration_dir
    path = d / MANIFEST
    if not path.is_file():
        raise CalibrationError(
            f"model {model}: no calibration set in {d}: run edge-agent calibrate --model {model} first"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{path}: unreadable calibration manifest ({e}); run calibrate again") from e
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise CalibrationError(f"{path}: not a {SCHEMA} manifest; run edge-agent calibrate again")
    for key in ("frames", "held_out", "created_at"):
        if key not in manifest:
            raise CalibrationError(f"{path}: field {key!r} is missing; run edge-agent calibrate again")
    if not manifest["held_out"]:
        raise CalibrationError(f"{path}: no held-out frames; run edge-agent calibrate first")
    return CalibrationSet(d, manifest)


def frames_to_capture(ctx: ModelContext, calibration: bool) -> tuple[int, int] | None:
    """(samples, held_out) a job must capture first, or None when the stored set serves.

    The gate needs held-out frames only; INT8 (`calibration`) needs calibration frames too, so a
    held-out-only set is replaced by a full one."""
    try:
        cset = load_calibration_set(ctx)
        if not calibration or cset.calibration_paths:
            return None
    except CalibrationError:
        pass  # none yet (or unreadable): capture one
    samples = ctx.cfg.calibration.samples
    return (samples if calibration else 0), default_held_out(samples)


# ---- the daemon side: frames of the running pipeline ----------------------------------------------


class FrameTap:
    """A result sink that hands frames of a model's pipeline to a calibration capture.

    Idle (one attribute read per result) until `frames()` runs; then it keeps at most one frame per
    camera per `interval_s` and copies only the frames it keeps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[np.ndarray, str]] | None = None
        self._interval_s = 1.0
        self._next: dict[str, float] = {}

    def __call__(self, result: Result) -> None:
        q = self._queue
        if q is None:
            return
        frame = result.frame
        with self._lock:
            if frame.ts_capture < self._next.get(frame.camera, 0.0) or q.full():
                return
            self._next[frame.camera] = frame.ts_capture + 0.9 * self._interval_s
        # Never block the model's worker: a full queue (the capture stopped reading) drops the frame.
        with contextlib.suppress(queue.Full):
            q.put_nowait((host_image(frame.image).copy(), f"camera:{frame.camera}#{frame.frame_id}"))

    def frames(
        self, total: int, interval_s: float, timeout_s: float, stop: threading.Event | None = None
    ) -> Iterator[tuple[np.ndarray, str]]:
        """Up to `total` (image, origin) pairs as the pipeline delivers them; fewer on timeout or stop."""
        with self._lock:
            if self._queue is not None:
                raise CalibrationError("a calibration capture is already running for this model")
            self._interval_s, self._next = interval_s, {}
            self._queue = q = queue.Queue(maxsize=8)
        deadline = time.monotonic() + timeout_s
        try:
            for _ in range(total):
                while True:
                    if stop is not None and stop.is_set():
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning("calibration capture: timed out after %.0f s", timeout_s)
                        return
                    try:
                        item = q.get(timeout=min(0.5, left))
                        break
                    except queue.Empty:
                        continue
                yield item
        finally:
            with self._lock:
                self._queue = None
