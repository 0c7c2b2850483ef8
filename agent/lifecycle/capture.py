"""Capturing a calibration set: frames from a folder, the model's cameras, or the daemon's pipeline.

    cset = capture_calibration_set(cfg, "detector")                  # CLI: from the model's cameras
    cset = capture_calibration_set(cfg, "detector", folder=Path("frames/"))
    cset = capture_from_frames(ctx, tap.frames(...), samples=0, held_out=40)   # daemon: its own pipeline

The set's layout and how it is read: agent.lifecycle.calibration. A new capture replaces the whole
directory (built in a temp dir and renamed), so old frames never mix with new ones and derived INT8
models stored inside go with it.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from agent.config import AgentConfig, CameraConfig, ConfigError
from agent.config.reader import camera_reader, source_spec
from agent.lifecycle.calibration import (
    JPEG_QUALITY,
    MANIFEST,
    SCHEMA,
    CalibrationError,
    CalibrationSet,
    default_held_out,
)
from agent.lifecycle.model import ModelContext
from engines.store.fsutil import atomic_write_bytes, fsync_dir
from pipelines.frames import host_image
from pipelines.sources import CameraReader, FrameSlot

log = logging.getLogger("agent.lifecycle.calibration")  # the name its lines always had

IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})
VIDEO_EXTS = frozenset({".mp4", ".avi", ".mkv", ".mov", ".m4v", ".webm", ".ts", ".mpg", ".mpeg"})


# ---- capture -------------------------------------------------------------------------------------


class _Writer:
    """Numbered JPEGs into the temp directory, with a progress bar."""

    def __init__(self, directory: Path, total: int, desc: str, progress: bool) -> None:
        from tqdm import tqdm

        self.directory = directory
        self.items: list[dict[str, str]] = []
        self.total = total
        self.bar = tqdm(total=total, desc=desc, unit="frame", disable=not progress, leave=False)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.total

    def add(self, image: np.ndarray, origin: str) -> None:
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise CalibrationError(f"cannot encode a frame from {origin} as JPEG")
        name = f"{len(self.items):06d}.jpg"
        (self.directory / name).write_bytes(buf.tobytes())
        self.items.append({"file": name, "origin": origin})
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _uniform(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (all of them when k >= n)."""
    if k >= n:
        return list(range(n))
    return sorted({int(x) for x in np.rint(np.linspace(0, n - 1, k))})


def _video_frames(path: Path) -> int:
    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise CalibrationError(f"cannot open video {path}")
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        if n <= 0:  # some containers do not say: count by grabbing (no decode)
            while cap.grab():
                n += 1
        return n
    finally:
        cap.release()


def _sample_video(path: Path, wanted: list[int], writer: _Writer, origin: str) -> int:
    """Decode `path` once, keeping the frames at the sorted indices `wanted`; returns how many."""
    wanted_set, got = set(wanted), 0
    cap = cv2.VideoCapture(str(path))
    try:
        for idx in range(wanted[-1] + 1 if wanted else 0):
            if writer.full or not cap.grab():
                break
            if idx in wanted_set:  # retrieve (decode + convert) only the frames kept
                ok, img = cap.retrieve()
                if ok and img is not None:
                    writer.add(img, f"{origin}#{idx}")
                    got += 1
    finally:
        cap.release()
    return got


def _capture_folder(folder: Path, writer: _Writer) -> list[str]:
    """Images whole, videos sampled uniformly over their length; returns the files used."""
    if not folder.is_dir():
        raise CalibrationError(f"calibration folder {folder} does not exist or is not a directory")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTS]
    videos = [p for p in files if p.suffix.lower() in VIDEO_EXTS]
    if not images and not videos:
        raise CalibrationError(
            f"calibration folder {folder} holds no images ({', '.join(sorted(IMAGE_EXTS))}) "
            f"or videos ({', '.join(sorted(VIDEO_EXTS))})"
        )
    want = writer.total
    pick_images = [images[i] for i in _uniform(len(images), want)]
    counts = {v: _video_frames(v) for v in videos}
    left = max(0, want - len(pick_images))
    total_frames = sum(counts.values())
    plan: dict[Path, list[int]] = {}
    for v, n in counts.items():
        if left and n:  # proportional to length, at least one frame per video
            plan[v] = _uniform(n, max(1, round(left * n / total_frames)))
    used: list[str] = []
    for p in pick_images:
        img = cv2.imread(str(p), cv2.IMREAD_COLOR)
        if img is None:
            log.warning("calibration: skipping unreadable image %s", p)
            continue
        writer.add(img, str(p.relative_to(folder)))
        used.append(str(p.relative_to(folder)))
    for v, wanted in plan.items():
        if _sample_video(v, wanted, writer, str(v.relative_to(folder))):
            used.append(str(v.relative_to(folder)))
        else:
            log.warning("calibration: no frame could be read from video %s", v)
    if not writer.items:
        raise CalibrationError(f"calibration folder {folder}: none of its images or videos could be read")
    return used


def _is_file_source(cam: CameraConfig) -> bool:
    url = cam.url
    if url is None or url.isdigit() or url.startswith("/dev/video"):
        return False
    return "://" not in url or url.startswith("file://")


def _capture_cameras(
    cameras: dict[str, CameraConfig], writer: _Writer, interval_s: float, timeout_s: float | None
) -> list[str]:
    """Frames spread over cameras and time; returns the cameras that delivered.

    File sources (demo/test clips) are decoded directly and sampled uniformly over their length: a
    reader at file speed would only give "whatever frame is newest" to a slower consumer. Live
    sources go through CameraReader + FrameSlot, round-robin (a camera takes a frame only while it is
    not ahead of the others), at most one frame per camera per `interval_s`.
    """
    quota = math.ceil(writer.total / len(cameras))
    used: list[str] = []
    live: dict[str, CameraConfig] = {}
    for name, cam in cameras.items():
        if not _is_file_source(cam):
            live[name] = cam
            continue
        path = Path(cam.url.removeprefix("file://"))  # type: ignore[union-attr]
        if not path.is_file():
            raise CalibrationError(f"cameras.{name}: video file {path} does not exist")
        n = _video_frames(path)
        if _sample_video(path, _uniform(n, quota), writer, f"camera:{name}"):
            used.append(name)
        else:
            raise CalibrationError(f"cameras.{name}: no frame could be read from {path}")
    if live and not writer.full:
        used += _capture_live(live, writer, interval_s, timeout_s)
    return sorted(used)


def _capture_live(
    cameras: dict[str, CameraConfig], writer: _Writer, interval_s: float, timeout_s: float | None
) -> list[str]:
    readers: dict[str, CameraReader] = {}
    for name, cam in cameras.items():
        # The daemon's spec and decoder; the reader drops frames above the rate before decoding them.
        spec = replace(source_spec(name, cam), fps=1.0 / interval_s, max_failures=3)
        readers[name] = camera_reader(spec, cam, FrameSlot(), None)
    quota = math.ceil((writer.total - len(writer.items)) / len(cameras))
    if timeout_s is None:
        timeout_s = 60.0 + 3.0 * quota * interval_s
    deadline = time.monotonic() + timeout_s
    counts = dict.fromkeys(readers, 0)
    next_ts = dict.fromkeys(readers, 0.0)
    errors: dict[str, str] = {}
    active = set(readers)
    for r in readers.values():
        r.start()
    try:
        while active and not writer.full and time.monotonic() < deadline:
            for name in sorted(active):
                reader = readers[name]
                frame = reader.slot.get(timeout=0.05)
                if frame is None:
                    if reader.state == "failed" or not reader.is_alive():
                        errors[name] = f"cameras.{name} ({reader.display}): {reader.reason or 'failed'}"
                        active.discard(name)
                    continue
                if counts[name] > min(counts[n] for n in active) or frame.ts_capture < next_ts[name]:
                    continue  # ahead of another camera (round-robin), or too soon after its last frame
                writer.add(host_image(frame.image), f"camera:{name}#{frame.frame_id}")
                counts[name] += 1
                next_ts[name] = frame.ts_capture + 0.9 * interval_s
                if writer.full:
                    break
    finally:
        for r in readers.values():
            r.request_stop()
        for r in readers.values():
            r.stop()
    if not any(counts.values()):
        detail = "; ".join(errors.values()) or f"no frame within {timeout_s:g} s"
        raise CalibrationError(f"calibration: no frames captured from cameras {sorted(cameras)}: {detail}")
    for msg in errors.values():
        log.warning("calibration: %s", msg)
    return [n for n, c in counts.items() if c]


def _check_counts(model: str, samples: int, held_out: int) -> None:
    if samples < 0:
        raise CalibrationError(f"model {model}: samples must be >= 0, got {samples}")
    if held_out < 1:
        raise CalibrationError(f"model {model}: held_out must be >= 1, got {held_out}")


def capture_calibration_set(
    cfg: AgentConfig,
    model: str,
    folder: Path | None = None,
    samples: int | None = None,
    held_out: int | None = None,
    interval_s: float | None = None,
    timeout_s: float | None = None,
    progress: bool = True,
) -> CalibrationSet:
    """Capture `samples` calibration frames plus `held_out` gate frames for `model` and store them.

    Source: `folder` (or `models.M.calibration.folder` when its source is `folder`), else the enabled
    cameras whose `model` is `model`, opened here (the CLI; the daemon uses capture_from_frames).
    """
    ctx = ModelContext.from_config(cfg, model)
    mcfg = ctx.cfg
    samples = samples if samples is not None else mcfg.calibration.samples
    held_out = held_out if held_out is not None else default_held_out(samples)
    _check_counts(model, samples, held_out)
    interval_s = interval_s if interval_s is not None else mcfg.calibration.interval_s
    if folder is None and mcfg.calibration.source == "folder":
        if mcfg.calibration.folder is None:
            raise ConfigError(f"models.{model}.calibration.folder: required when source is 'folder'")
        folder = mcfg.calibration.folder
    cameras = {n: c for n, c in cfg.cameras.items() if c.model == model and c.enabled}
    if folder is None and not cameras:
        raise CalibrationError(
            f"model {model}: no enabled camera uses it; give a folder (edge-agent calibrate --from DIR)"
        )

    def fill(writer: _Writer) -> dict[str, Any]:
        if folder is not None:
            used = _capture_folder(Path(folder), writer)
            return {"source": "folder", "folder": str(folder), "files": used, "cameras": []}
        used = _capture_cameras(cameras, writer, interval_s, timeout_s)
        return {"source": "cameras", "folder": None, "cameras": used}

    return _store_set(ctx, samples, held_out, fill, progress, folder or sorted(cameras))


def capture_from_frames(
    ctx: ModelContext, frames: Iterable[tuple[np.ndarray, str]], samples: int, held_out: int
) -> CalibrationSet:
    """Store a set from (image, origin) pairs, e.g. FrameTap.frames() of the running pipeline."""
    _check_counts(ctx.name, samples, held_out)
    cameras: set[str] = set()

    def fill(writer: _Writer) -> dict[str, Any]:
        for image, origin in frames:
            writer.add(image, origin)
            cameras.add(origin.split("#", 1)[0].removeprefix("camera:"))
            if writer.full:
                break
        if not writer.items:
            raise CalibrationError(f"model {ctx.name}: no frame arrived from its cameras")
        return {"source": "pipeline", "folder": None, "cameras": sorted(cameras)}

    return _store_set(ctx, samples, held_out, fill, False, "its cameras")


def _store_set(
    ctx: ModelContext,
    samples: int,
    held_out: int,
    fill: Callable[[_Writer], dict[str, Any]],
    progress: bool,
    what: object,
) -> CalibrationSet:
    """Fill a temp dir, split calibration / held-out, write the manifest, swap it in (atomic rename)."""
    final = ctx.calibration_dir
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".calibration.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    writer = _Writer(tmp, samples + held_out, f"calibrate {ctx.name}", progress)
    try:
        sources = fill(writer)
        writer.close()
        manifest = _manifest(ctx.name, sources, writer.items, samples, held_out, what)
        atomic_write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        _swap_in(tmp, final)
    except BaseException:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "calibration set for %s: %d + %d held-out frames in %s",
        ctx.name,
        manifest["samples"],
        manifest["held_out_count"],
        final,
    )
    return CalibrationSet(final, manifest)


def _manifest(
    model: str,
    sources: dict[str, Any],
    items: list[dict[str, str]],
    samples: int,
    held_out: int,
    what: object,
) -> dict[str, Any]:
    """The manifest of the frames captured: held-out positions spread evenly over the capture (every
    k-th frame: all scenes and cameras), the rest for calibration."""
    n, total = len(items), samples + held_out
    n_held = held_out if n >= total else min(round(held_out * n / total), n - 1)
    if samples == 0:
        n_held = n  # a held-out-only set (FP16 gate)
    if n_held < 1:
        raise CalibrationError(
            f"model {model}: only {n} frame(s) from {what}: need at least 2 (one calibration, one held-out)"
        )
    if n < total:
        log.warning("calibration of %s: got %d of %d frames (source ran out)", model, n, total)
    held_idx = set(_uniform(n, n_held)) if n_held < n else set(range(n))
    return {
        "schema": SCHEMA,
        "model": model,
        **sources,
        "samples": n - len(held_idx),
        "held_out_count": len(held_idx),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "jpeg_quality": JPEG_QUALITY,
        "frames": [f for i, f in enumerate(items) if i not in held_idx],
        "held_out": [f for i, f in enumerate(items) if i in held_idx],
    }


def _swap_in(tmp: Path, final: Path) -> None:
    """Swap directories: the old set (and INT8 models derived from it) goes as a whole."""
    old = None
    if final.exists():
        old = final.with_name(f".calibration.old-{secrets.token_hex(4)}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
