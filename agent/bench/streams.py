"""The streams of a bench run: looped copies of a clip decoded once into memory, or camera readers.

Looped copies are put into the worker's slots at `fps` each by one clock thread (the agent's own cost,
without decoding); camera readers (`CameraReader`) decode the clip per stream, or read RTSP streams.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from agent.bench.args import BenchOptions
from pipelines.frames import Frame
from pipelines.sources import CameraReader, FrameSlot, SourceSpec, open_reader

Sources = Callable[[list[tuple[str, FrameSlot]]], "LoopedClip | Readers"]  # the cameras' (name, slot) -> them


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


def placed_frames(opts: BenchOptions, images: list[np.ndarray]) -> tuple[list[np.ndarray], list[Any]]:
    """The looped streams' frames; with GPU preprocessing, in pinned memory (as a decoder writing into
    pinned buffers would leave them: the upload then costs the CPU nothing)."""
    images = images[: opts.clip_frames]
    if opts.preprocess != "gpu":
        return images, []
    from engines.cuda.buffers import PinnedBuffer

    keep, placed = [], []
    for im in images:
        buf = PinnedBuffer(im.nbytes)
        view = buf.view(np.dtype(np.uint8), im.shape)
        view[...] = im
        keep.append(buf)
        placed.append(view)
    return placed, keep


def stream_sources(
    opts: BenchOptions, images: list[np.ndarray], flap_url: str | None = None, first: int = 1
) -> Sources:
    """The streams --rtsp / --decode / --decoder ask for (else `images` looped); cameras named flapNN read
    `flap_url`. `first`: the {i} of the first RTSP stream (a shard's share starts further on)."""

    def make(slots: list[tuple[str, FrameSlot]]) -> LoopedClip | Readers:
        if opts.rtsp is None and not opts.decode:
            return LoopedClip(images, slots, opts.fps)
        specs = []
        steady = first - 1
        # --fps 0: saturation; files as fast as they decode, nothing limited (RTSP: as the server sends).
        fps, realtime = (opts.fps, True) if opts.fps > 0 else (None, False)
        for cam, _ in slots:
            if cam.startswith("flap") and flap_url is not None:
                specs.append(SourceSpec(camera=cam, url=flap_url, fps=opts.fps))
            elif opts.rtsp is not None:
                steady += 1
                specs.append(SourceSpec(camera=cam, url=opts.rtsp.replace("{i}", str(steady)), fps=fps))
            else:
                clip = str(opts.clip)
                specs.append(SourceSpec(camera=cam, url=clip, fps=fps, loop=True, realtime=realtime))
        return Readers(specs, [s for _, s in slots], opts.decoder)

    return make
