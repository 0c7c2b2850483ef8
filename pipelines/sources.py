"""Camera sources: one reader thread per camera filling a latest-frame-wins slot.

A reader opens its source with OpenCV (FFmpeg for RTSP, HTTP and files, V4L2 for /dev/videoN, GStreamer for
a pipeline ending in appsink), stamps every frame it keeps, and on any failure releases the capture and
reopens it with exponential backoff and full jitter. State changes go to ``on_state(camera, state, reason)``:

    starting -> streaming -> reconnecting -> streaming ... ; reconnecting -> failed (after max_failures)

Credentials never leave this module: every log line, ``last_error`` and exception text goes through
:func:`pipelines.urls.mask_url` (and the reader's own scrubber, which also knows the raw password).
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import cv2
import numpy as np

from pipelines.frames import DeviceImage, Frame
from pipelines.rtsp_probe import diagnose
from pipelines.urls import mask_url, secrets_of

log = logging.getLogger(__name__)

StateCallback = Callable[[str, str, str | None], None]

# --- FFmpeg capture options -------------------------------------------------------------------------------
# OpenCV's FFmpeg backend reads OPENCV_FFMPEG_CAPTURE_OPTIONS with getenv() inside every open() (measured:
# changing it between two opens in one process changes the second open), so it must be set before the
# open. Writing the environment while another thread's open() calls getenv() is a data race in libc, so
# it is written once, here at import, before any reader thread exists, and never changed afterwards; it
# applies to every FFmpeg open of the process (file demuxers ignore the rtsp options).
# - rtsp_transport tcp: no UDP loss/NAT trouble; OpenCV's own default is only "prefer_tcp".
# - analyzeduration 0.5 s: without it, opening the test RTSP stream took 5.0 s (FFmpeg probes 5 s of
#   stream; the open timeout cut it short), with 1 s it took 1.05 s, with 0.5 s 0.57 s. Cameras send
#   SPS/PPS in the SDP, so half a second is plenty to find the video parameters.
FFMPEG_CAPTURE_OPTIONS = "rtsp_transport;tcp|analyzeduration;500000"
_ENV_OPTIONS = "OPENCV_FFMPEG_CAPTURE_OPTIONS"


def _configure_ffmpeg_options() -> None:
    current = os.environ.get(_ENV_OPTIONS)
    if current is None:
        os.environ[_ENV_OPTIONS] = FFMPEG_CAPTURE_OPTIONS
    elif "rtsp_transport" not in current:
        # The operator's own options win, but RTSP over TCP is part of this module's contract.
        os.environ[_ENV_OPTIONS] = f"rtsp_transport;tcp|{current}" if current else "rtsp_transport;tcp"


_configure_ffmpeg_options()


# --- frame slot -------------------------------------------------------------------------------------------
class FrameSlot:
    """A single-frame mailbox: the newest frame wins, an unread older one is dropped and counted.

    The reader never waits on the consumer and memory never grows: a slow detector sees fresh frames, not
    a backlog.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._put_at = 0.0
        self.dropped = 0  # frames replaced before anyone read them

    def put(self, frame: Frame) -> None:
        with self._cond:
            if self._frame is not None:
                self.dropped += 1
            self._frame = frame
            self._put_at = time.monotonic()
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Frame | None:
        """Take the newest frame, waiting up to ``timeout`` seconds (None: forever); None on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._frame is not None, timeout):
                return None
            frame, self._frame = self._frame, None
            return frame

    @property
    def last_put(self) -> float:
        """time.monotonic() of the latest put (0.0: never): tells a live camera from a silent one."""
        return self._put_at

    def peek_age(self) -> float | None:
        """Seconds the unread frame has been waiting in the slot, or None when the slot is empty."""
        with self._cond:
            return None if self._frame is None else time.monotonic() - self._put_at

    def __len__(self) -> int:
        with self._cond:
            return 0 if self._frame is None else 1


# --- source description --------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class SourceSpec:
    """What to open and how patiently. Give exactly one of ``url`` and ``pipeline``.

    ``url``: ``rtsp://``/``rtsps://`` (FFmpeg over TCP), other ``scheme://`` network streams (FFmpeg), a file
    path or ``file://`` URL (FFmpeg), ``/dev/videoN`` or a device index (V4L2). ``pipeline``: a GStreamer
    pipeline ending in ``appsink`` (Jetson hardware decode), opened with ``cv2.CAP_GSTREAMER``.
    """

    camera: str
    url: str | int | None = None
    pipeline: str | None = None
    fps: float | None = None  # keep at most this many frames per second (None: all)
    loop: bool = False  # files: start again at the end instead of reconnecting
    realtime: bool = True  # files: pace to the file's own fps, like a live camera (False: as fast as decoded)
    open_timeout_s: float = 5.0
    read_timeout_s: float = 2.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_failures: int | None = None  # consecutive failed attempts before "failed"; None: retry forever

    def __post_init__(self) -> None:
        if (self.url is None) == (self.pipeline is None):
            raise ValueError(f"camera {self.camera!r}: give exactly one of url and pipeline")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"camera {self.camera!r}: fps must be > 0 or None, got {self.fps}")
        if not (self.open_timeout_s > 0 and self.read_timeout_s > 0):
            raise ValueError(f"camera {self.camera!r}: open_timeout_s and read_timeout_s must be > 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(f"camera {self.camera!r}: need 0 < backoff_initial_s <= backoff_max_s")
        if self.max_failures is not None and self.max_failures < 1:
            raise ValueError(f"camera {self.camera!r}: max_failures must be >= 1 or None")

    @property
    def display(self) -> str:
        """The source as it may be shown: credentials masked."""
        return mask_url(str(self.pipeline if self.pipeline is not None else self.url))

    def __repr__(self) -> str:
        # The generated repr would print the URL with its password into any log or traceback.
        return f"SourceSpec(camera={self.camera!r}, source={self.display!r}, fps={self.fps})"


@dataclass(frozen=True)
class _Target:
    kind: str  # rtsp | stream | file | v4l2 | gstreamer
    target: str | int  # what cv2.VideoCapture gets
    api: int


def _resolve(spec: SourceSpec) -> _Target:
    if spec.pipeline is not None:
        return _Target("gstreamer", spec.pipeline, cv2.CAP_GSTREAMER)
    url = spec.url
    if isinstance(url, int) or (isinstance(url, str) and url.isdigit()):
        return _Target("v4l2", int(url), cv2.CAP_V4L2)
    assert isinstance(url, str)
    if url.startswith("/dev/video"):
        return _Target("v4l2", url, cv2.CAP_V4L2)
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("rtsp", "rtsps"):
        return _Target("rtsp", url, cv2.CAP_FFMPEG)
    if scheme == "file":
        return _Target("file", url2pathname(urlsplit(url).path), cv2.CAP_FFMPEG)
    if scheme:
        return _Target("stream", url, cv2.CAP_FFMPEG)
    return _Target("file", url, cv2.CAP_FFMPEG)


def open_params(spec: SourceSpec, api: int) -> list[int]:
    """The cv2.VideoCapture open parameters for ``spec`` on backend ``api``: FFmpeg's open/read timeouts.

    Shared by :class:`CameraReader` and :mod:`pipelines.demux` (packet mode adds its own flag).
    """
    if api != cv2.CAP_FFMPEG:
        # Only FFmpeg takes both timeouts; OpenCV refuses an open with parameters a backend leaves unused.
        return []
    return [
        cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
        round(spec.open_timeout_s * 1000),
        cv2.CAP_PROP_READ_TIMEOUT_MSEC,
        round(spec.read_timeout_s * 1000),
    ]


# --- the reader -----------------------------------------------------------------------------------------
class CameraReader(threading.Thread):
    """Reads one camera into its :class:`FrameSlot` until :meth:`stop`.

    Nothing here holds a lock shared with other readers during open or read (OpenCV releases the GIL in
    both), so a hung camera stalls only its own thread.
    """

    decoder = "cpu"  # what decodes the pictures (pipelines.nvdec.NvdecReader: nvdec, or cpu after a fallback)
    decoder_reason: str | None = None  # why a camera configured for NVDEC decodes on the CPU

    def __init__(
        self,
        spec: SourceSpec,
        slot: FrameSlot | None = None,
        on_state: StateCallback | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name=f"reader-{spec.camera}", daemon=True)
        self.spec = spec
        self.slot = slot if slot is not None else FrameSlot()
        self.on_state = on_state
        self._target = _resolve(spec)
        self._secrets = secrets_of(str(spec.pipeline if spec.pipeline is not None else spec.url))
        self._rng = rng or random.Random()
        self._stopping = threading.Event()
        self._next_id = 0
        self.state: str = "starting"
        self.reason: str | None = None
        self._reported: tuple[str, str | None] | None = None
        self.frames_read = 0  # frames grabbed from the source, including those the fps limit dropped
        self.frames_in = 0  # frames put into the slot
        self.reconnects = 0  # open attempts after the first one
        self.last_error: str | None = None
        self.last_open_s: float | None = None  # how long the last successful open took

    # -- public ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the reader to finish without waiting (to stop many cameras in parallel, then join them)."""
        self._stopping.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the reader to finish and wait for it; True when the thread has ended.

        A read in progress ends within the read timeout, an open in progress within the open timeout; the
        reader releases its capture itself (releasing from another thread while it reads would be unsafe).
        """
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            if timeout is None:
                timeout = max(self.spec.read_timeout_s, self.spec.open_timeout_s) + 1.0
            self.join(timeout)
        return not self.is_alive()

    @property
    def display(self) -> str:
        return self._scrub(self.spec.display)

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state,
            "reason": self.reason,
            "frames_read": self.frames_read,
            "frames_in": self.frames_in,
            "dropped": self.slot.dropped,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
        }

    # -- thread body -----------------------------------------------------------------------------------
    def run(self) -> None:
        self._set_state("starting", None)
        failures = 0  # consecutive attempts that delivered no frame
        first = True
        try:
            while not self._stopping.is_set():
                if not first:
                    self.reconnects += 1
                first = False
                cap, error = self._open()
                delivered = 0
                if cap is not None:
                    try:
                        delivered, error = self._stream(cap)
                    finally:
                        cap.release()
                if self._stopping.is_set():
                    break
                failures = 0 if delivered else failures + 1
                self.last_error = error
                if self.spec.max_failures is not None and failures >= self.spec.max_failures:
                    self._set_state("failed", f"{error} ({failures} attempt{'s' if failures > 1 else ''})")
                    return
                self._set_state("reconnecting", error)
                self._stopping.wait(self._backoff(failures))
        except Exception as exc:  # a bug must not kill the thread silently or leak a URL in a traceback
            self.last_error = self._scrub(f"reader crashed: {type(exc).__name__}: {exc}")
            log.error("camera %s: %s", self.spec.camera, self.last_error)
            self._set_state("failed", self.last_error)
        finally:
            log.debug("camera %s: reader ended", self.spec.camera)

    def _backoff(self, failures: int) -> float:
        # Full jitter (uniform in [0, cap]): many cameras behind one dead switch do not reconnect in step.
        cap = min(self.spec.backoff_max_s, self.spec.backoff_initial_s * 2.0 ** max(failures - 1, 0))
        return self._rng.uniform(0.0, cap)

    def _open(self) -> tuple[cv2.VideoCapture | None, str]:
        t = self._target
        if t.kind == "file" and not Path(str(t.target)).is_file():
            return None, self._scrub(f"no such file: {self.spec.display}")
        start = time.monotonic()
        try:
            cap = cv2.VideoCapture(t.target, t.api, self._open_params())
        except cv2.error as exc:
            return None, self._scrub(f"cannot open {self.spec.display}: {exc}")
        took = time.monotonic() - start
        if not cap.isOpened():
            cap.release()
            timed_out = t.kind in ("rtsp", "stream") and took >= 0.9 * self.spec.open_timeout_s
            what = f"open timed out after {self.spec.open_timeout_s:g} s" if timed_out else "cannot open"
            if t.kind == "rtsp" and self.spec.url is not None:
                # FFmpeg says nothing about why: ask the camera (refused, timeout, 401, 404, ...).
                why = diagnose(self.spec.url, timeout=min(3.0, self.spec.open_timeout_s))
                return None, self._scrub(f"{what}: {self.display}: {why}")
            return None, self._scrub(f"{what}: {self.display}" if timed_out else f"{what} {self.display}")
        self.last_open_s = took
        log.debug("camera %s: opened %s in %.3f s", self.spec.camera, self.display, took)
        return cap, ""

    def _open_params(self) -> list[int]:
        return open_params(self.spec, self._target.api)

    def _stream(self, cap: cv2.VideoCapture) -> tuple[int, str]:
        """Read until failure or stop; return (frames delivered, why it ended)."""
        spec, kind = self.spec, self._target.kind
        is_file = kind == "file"
        pace = 0.0
        if is_file and spec.realtime:
            native = cap.get(cv2.CAP_PROP_FPS)
            if math.isfinite(native) and 0 < native <= 1000:
                pace = 1.0 / native
        limit = 1.0 / spec.fps if spec.fps else 0.0
        # A grab that takes about the read timeout means OpenCV's interrupt fired; FFmpeg then drains the
        # decoder, so a few more grabs "succeed" a read-timeout apart with stale frames (measured: 3 x 1 s
        # with read_timeout 1 s after SIGSTOP). Treat the first such grab as a dead stream. The interrupt
        # fires only once the timeout has passed, so a grab shorter than it is never a stall.
        stall_s = spec.read_timeout_s
        next_pace = time.monotonic()
        next_emit: float | None = None
        delivered = 0
        in_pass = 0  # frames since the file (re)started, to tell a loop point from an unreadable file
        while not self._stopping.is_set():
            if pace:
                delay = next_pace - time.monotonic()
                if delay > 0 and self._stopping.wait(delay):
                    break
                # Do not burst to catch up after a hiccup: at most one period behind.
                next_pace = max(next_pace + pace, time.monotonic() - pace)
            t0 = time.monotonic()
            try:
                ok = cap.grab()
            except cv2.error as exc:
                return delivered, self._scrub(f"read error on {self.display}: {exc}")
            t1 = time.monotonic()
            if not ok:
                if is_file and spec.loop and in_pass:
                    # Seeking to 0 is cheap; if the container refuses, reopen the same object.
                    if not cap.set(cv2.CAP_PROP_POS_FRAMES, 0):
                        cap.open(self._target.target, self._target.api, self._open_params())
                    in_pass = 0
                    continue
                if is_file:
                    what = "end of file" if in_pass else "cannot read"
                    return delivered, self._scrub(f"{what}: {self.display}")
                if t1 - t0 >= stall_s:
                    return delivered, self._scrub(f"no frame for {spec.read_timeout_s:g} s: {self.display}")
                return delivered, self._scrub(f"stream ended or read failed: {self.display}")
            if not is_file and t1 - t0 >= stall_s:
                return delivered, self._scrub(f"no frame for {spec.read_timeout_s:g} s: {self.display}")
            in_pass += 1
            self.frames_read += 1
            if limit:
                if next_emit is not None and t1 < next_emit:
                    continue  # too early: skip retrieve() (no colour conversion or copy for dropped frames)
                # Keep a schedule rather than "limit after the last one", or 25 fps -> 10 fps gives 8.3.
                next_emit = t1 + limit if next_emit is None or t1 - next_emit > limit else next_emit + limit
            ok, image = cap.retrieve()
            if not ok or image is None:
                return delivered, self._scrub(f"cannot decode a frame from {self.display}")
            if image.ndim == 2:
                image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
            delivered += 1
            self._hand_over(np.ascontiguousarray(image), time.time(), time.monotonic(), delivered == 1)
        return delivered, "stopped"

    # -- helpers ---------------------------------------------------------------------------------------
    def _hand_over(
        self, image: np.ndarray | DeviceImage, ts_wall: float, captured: float, first: bool
    ) -> None:
        """One frame into the slot (the newest wins there); the first of a connection makes it streaming."""
        frame = Frame(self.spec.camera, self._next_id, image, ts_wall)
        frame.stamps["captured"] = captured  # monotonic, as Frame.stamp
        self._next_id += 1
        self.frames_in += 1
        if first:
            self._set_state("streaming", None)
        self.slot.put(frame)

    def _scrub(self, text: str) -> str:
        text = mask_url(text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _set_state(self, state: str, reason: str | None) -> None:
        reason = None if reason is None else self._scrub(reason)
        self.state, self.reason = state, reason
        if self._reported == (state, reason):
            return
        self._reported = (state, reason)
        level = logging.WARNING if state in ("reconnecting", "failed") else logging.INFO
        log.log(level, "camera %s: %s%s", self.spec.camera, state, f" ({reason})" if reason else "")
        if self.on_state is not None:
            try:
                self.on_state(self.spec.camera, state, reason)
            except Exception:  # a broken subscriber must not stop the camera
                log.exception("camera %s: on_state callback failed", self.spec.camera)
