"""One open connection to a camera through OpenCV: pictures, or encoded packets for a decoder of our own.

    capture = Capture(spec, target, packets=False, scrub=scrub)
    capture.open()                    # StreamInfo; OpenError with a credential-free reason
    unit = capture.read()             # Unit, or None: capture.error says why, capture.ended at end of file
    image = capture.retrieve()        # pictures mode: the grabbed unit as BGR (skipped for dropped frames)
    capture.rewind()                  # files: from the first frame again (seek, else reopen)
    capture.release()

Pictures mode is OpenCV's own decoding (FFmpeg for RTSP/HTTP/files, V4L2, GStreamer). Packets mode is
FFmpeg's demuxer only (``CAP_PROP_FORMAT -1``): one access unit per read, Annex-B with SPS/PPS before each
IDR (FFmpeg converts mp4/avcC), with the same open/read timeouts (measured on OpenCV 4.12-5.0 / FFmpeg 7;
the packet comes back as shape ``(1, N)``).

Rewinding: seeking to frame 0 works for containers (mp4) but not for raw H.264/H.265 files, where the seek
returns True and every later read fails (measured: bikes.h264 read 1 frame after the seek). So the first
read after a rewind that fails reopens the file once (2.5-3 ms); later loops reopen at once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from pipelines.rtsp_probe import diagnose
from pipelines.sources.bitstream import codec_name, fourcc_text
from pipelines.sources.spec import SourceSpec, Target, open_params


class OpenError(Exception):
    """The source could not be opened; the message is credential-free."""


@dataclass(frozen=True)
class StreamInfo:
    """What OpenCV reports after opening; zeros/"" where it does not know."""

    codec: str  # "h264" | "hevc" | FFmpeg's tag lower-cased (from CAP_PROP_FOURCC)
    pixel_format: str  # CAP_PROP_CODEC_PIXEL_FORMAT as text, e.g. "I420" (4:2:0 8-bit)
    width: int
    height: int
    fps: float | None  # None when FFmpeg has no usable rate (some cameras report 90000 or 0)
    open_s: float  # how long the open took


@dataclass(slots=True)
class Unit:
    """What one read gave: an encoded packet (packets mode) or a grabbed picture to retrieve."""

    data: np.ndarray | None  # packets: this read's own 1-D uint8 Annex-B array; pictures: None
    keyframe: bool  # packets: FFmpeg's key flag (IDR, or a recovery point)
    arrived: float  # time.monotonic() when the read returned: the frame's capture time
    arrived_wall: float  # time.time() of the same moment, for payloads


class Capture:
    """One connection; not thread-safe (one reader thread opens, reads and releases it)."""

    def __init__(
        self, spec: SourceSpec, target: Target, *, packets: bool, scrub: Callable[[str], str]
    ) -> None:
        if packets and not target.ffmpeg:
            raise ValueError(f"packet mode needs an FFmpeg source, not {target.kind}")
        self.spec, self.target, self.packets = spec, target, packets
        self._scrub = scrub
        self._cap: cv2.VideoCapture | None = None
        self.info: StreamInfo | None = None
        self.error = ""  # why the last read() gave nothing
        self.ended = False  # the last read() met the end of a file
        self._rewound = False  # a rewind happened and no read has succeeded since
        self._seek_works: bool | None = None  # None: not tried on this file yet

    @property
    def display(self) -> str:
        return self._scrub(self.spec.display)

    # -- open ---------------------------------------------------------------------------------------
    def open(self) -> StreamInfo:
        t = self.target
        if t.kind == "file" and not Path(str(t.target)).is_file():
            raise OpenError(self._scrub(f"no such file: {self.spec.display}"))
        start = time.monotonic()
        cap = self._new_capture()
        took = time.monotonic() - start
        if not cap.isOpened():
            cap.release()
            raise OpenError(self._why_not_opened(took))
        if self.packets and cap.get(cv2.CAP_PROP_FORMAT) != -1:
            # An OpenCV without packet mode hands out pictures: refuse rather than feed them to a decoder.
            cap.release()
            raise OpenError(f"this OpenCV does not support packet mode (CAP_PROP_FORMAT -1): {self.display}")
        self._cap = cap
        fps = cap.get(cv2.CAP_PROP_FPS)
        self.info = StreamInfo(
            codec=codec_name(fourcc_text(cap.get(cv2.CAP_PROP_FOURCC))),
            pixel_format=fourcc_text(cap.get(cv2.CAP_PROP_CODEC_PIXEL_FORMAT)),
            width=int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)),
            fps=fps if math.isfinite(fps) and 0 < fps <= 1000 else None,
            open_s=took,
        )
        return self.info

    def _new_capture(self) -> cv2.VideoCapture:
        t = self.target
        try:
            return cv2.VideoCapture(t.target, t.api, open_params(self.spec, t.api, self.packets))
        except cv2.error as exc:
            raise OpenError(self._scrub(f"cannot open {self.spec.display}: {exc}")) from None

    def _why_not_opened(self, took: float) -> str:
        """Why the open failed, in the agent's words: FFmpeg's and OpenCV's own log lines are off (spec.py),
        and OpenCV only answers "not opened" whatever the cause."""
        t, spec = self.target, self.spec
        timed_out = t.kind in ("rtsp", "stream") and took >= 0.9 * spec.open_timeout_s
        what = f"open timed out after {spec.open_timeout_s:g} s" if timed_out else "cannot open"
        if t.kind == "rtsp" and isinstance(spec.url, str):
            # Ask the camera itself (refused, timeout, unknown host, 401, 404, ...), as patiently as the open
            # was: one timeout in the message (a fixed 3 s probe read "timed out after 5 s: ... within 3 s").
            why = diagnose(spec.url, timeout=spec.open_timeout_s)
            return self._scrub(f"{what}: {self.display}: {why}")
        if timed_out:
            return self._scrub(f"{what}: {self.display}")
        why = self._local_why()
        return self._scrub(f"{what} {self.display}" + (f": {why}" if why else ""))

    def _local_why(self) -> str | None:
        """A file, a V4L2 device or a GStreamer pipeline that did not open: what the host tells about it."""
        t = self.target
        if t.kind == "file":
            path = str(t.target)
            try:
                size = os.path.getsize(path)
            except OSError as exc:
                return exc.strerror or "cannot read it"
            if not os.access(path, os.R_OK):
                return "permission denied"
            if size == 0:
                return "the file is empty"
            return "not a video FFmpeg can read (unknown format, damaged or incomplete)"
        if t.kind == "v4l2":
            device = t.target if isinstance(t.target, str) else f"/dev/video{t.target}"
            if not os.path.exists(device):
                return "no such device"
            if not os.access(device, os.R_OK | os.W_OK):
                return "permission denied (the video group; under systemd a DeviceAllow= drop-in)"
            return None
        if t.kind == "gstreamer":
            if not cv2.videoio_registry.hasBackend(cv2.CAP_GSTREAMER):
                return "this OpenCV has no GStreamer (on a Jetson use JetPack's cv2; else give a 'url')"
            return "GStreamer did not start the pipeline (OPENCV_LOG_LEVEL=WARNING shows its reason)"
        return None

    # -- read ---------------------------------------------------------------------------------------
    def read(self) -> Unit | None:
        """The next packet or grabbed picture; None at end of file, on a read error or a read timeout."""
        unit = self._read_once()
        if unit is None and self._rewound and self._seek_works is None:
            # The seek said yes but the file cannot be read from it (raw H.264/H.265): reopen instead.
            self._seek_works = False
            if self._reopen():
                unit = self._read_once()
        if unit is not None and self._rewound:
            self._rewound = False
            self._seek_works = self._seek_works if self._seek_works is not None else True
        return unit

    def _read_once(self) -> Unit | None:
        cap = self._cap
        self.ended = False
        if cap is None:
            self.error = "not open"
            return None
        try:
            if self.packets:
                ok, raw = cap.read()
            else:
                ok, raw = cap.grab(), None
        except cv2.error as exc:
            self.error = self._scrub(f"read error on {self.display}: {exc}")
            return None
        now, wall = time.monotonic(), time.time()
        if not ok or (self.packets and (raw is None or raw.size == 0)):
            self.ended = not self.target.live
            what = "end of file" if self.ended else "stream ended or read failed"
            self.error = self._scrub(f"{what}: {self.display}")
            return None
        if raw is None:
            return Unit(None, False, now, wall)
        key = bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME))
        return Unit(raw.reshape(-1), key, now, wall)

    def retrieve(self) -> np.ndarray | None:
        """Pictures mode: the grabbed picture as a contiguous BGR array this frame owns; None if it fails."""
        assert self._cap is not None and not self.packets
        ok, image = self._cap.retrieve()
        if not ok or image is None:
            return None
        if image.ndim == 2:
            image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
        return np.ascontiguousarray(image)

    # -- files --------------------------------------------------------------------------------------
    def rewind(self) -> bool:
        """Files: from the first frame again; False when neither seeking nor reopening works."""
        if self._cap is None:
            return False
        self._rewound = True
        if self._seek_works is not False and self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0):
            return True
        return self._reopen()

    def _reopen(self) -> bool:
        if self._cap is not None:
            self._cap.release()
            self._cap = None
        try:
            cap = self._new_capture()
        except OpenError as exc:
            self.error = str(exc)
            return False
        if not cap.isOpened():
            cap.release()
            self.error = self._scrub(f"cannot reopen {self.display}")
            return False
        self._cap = cap
        return True

    def release(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None
