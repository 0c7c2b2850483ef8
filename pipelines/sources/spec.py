"""What a camera is (SourceSpec), where OpenCV opens it (Target), and the process-wide FFmpeg settings.

Credentials never leave this package: every log line, ``last_error`` and exception text goes through
:func:`pipelines.urls.mask_url` (and the reader's own scrubber, which also knows the raw password).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit
from urllib.request import url2pathname

import cv2

from pipelines.urls import mask_url

# --- process-wide FFmpeg settings ---------------------------------------------------------------------
# OpenCV's FFmpeg backend reads these with getenv() inside every open() (measured: changing one between two
# opens in one process changes the second open), so they must be set before the first open. Writing the
# environment while another thread's open() calls getenv() is a data race in libc, so they are written once,
# here at import, before any reader thread exists, and never changed afterwards.
# - rtsp_transport tcp: no UDP loss/NAT trouble; OpenCV's own default is only "prefer_tcp".
# - analyzeduration 0.5 s: without it, opening the test RTSP stream took 5.0 s (FFmpeg probes 5 s of
#   stream; the open timeout cut it short), with 1 s it took 1.05 s, with 0.5 s 0.57 s. Cameras send
#   SPS/PPS in the SDP, so half a second is plenty to find the video parameters.
FFMPEG_CAPTURE_OPTIONS = "rtsp_transport;tcp|analyzeduration;500000"
_ENV_OPTIONS = "OPENCV_FFMPEG_CAPTURE_OPTIONS"
# OpenCV holds one process-wide mutex across every FFmpeg open() (connect, probe, codec open) unless this is
# set: 8 RTSP cameras then became ready 0.65 s apart, one after another (5.2 s for the last); with it all 8
# opened in 0.66 s. FFmpeg itself is thread-safe here (>= 4.0: no lock manager, codec init locked inside).
_ENV_THREAD_SAFE = "OPENCV_FFMPEG_IS_THREAD_SAFE"
_ENV_FFMPEG_LOG = "OPENCV_FFMPEG_LOGLEVEL"
FFMPEG_QUIET = "-8"  # AV_LOG_QUIET


def _configure_ffmpeg() -> None:
    current = os.environ.get(_ENV_OPTIONS)
    if current is None:
        os.environ[_ENV_OPTIONS] = FFMPEG_CAPTURE_OPTIONS
    elif "rtsp_transport" not in current:
        # The operator's own options win, but RTSP over TCP is part of this module's contract.
        os.environ[_ENV_OPTIONS] = f"rtsp_transport;tcp|{current}" if current else "rtsp_transport;tcp"
    os.environ.setdefault(_ENV_THREAD_SAFE, "1")  # an operator's explicit 0 keeps OpenCV's lock
    # OpenCV's and FFmpeg's own lines on stderr ("[tcp @ 0x...] Connection to tcp://... failed: Connection
    # refused", "[mov,mp4,... @ 0x...] moov atom not found", "[ WARN:0@0.1] global cap_ffmpeg_impl.hpp ...",
    # "[ERROR:0@0.02] ... unsupported parameters") came at every attempt of a failing camera, in their words,
    # without the camera's name: the journal filled with them. The camera state and the agent's one line per
    # change say why (capture.py, rtsp_probe.py). Silent unless the operator set the variables to debug:
    if "OPENCV_LOG_LEVEL" not in os.environ:
        # With the lock off, OpenCV also prints a WARNING line at every open (a looping file, a reconnect).
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    if _ENV_FFMPEG_LOG not in os.environ and "OPENCV_FFMPEG_DEBUG" not in os.environ:
        # OpenCV reads it with getenv() at every FFmpeg open (its default is AV_LOG_ERROR, which prints the
        # lines above); written here once, before any reader thread, like the options above.
        os.environ[_ENV_FFMPEG_LOG] = FFMPEG_QUIET


_configure_ffmpeg()


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
    loop: bool = False  # files: start again at the end (seamlessly); False: the camera ends ("ended")
    realtime: bool = True  # files: play at their own rate, like a live camera (False: as fast as decoded)
    open_timeout_s: float = 5.0
    read_timeout_s: float = 2.0  # no picture for this long: the camera is stalled and reconnects
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

    @property
    def raw(self) -> str:
        """The source as written (credentials included): for the scrubber's list of secrets only."""
        return str(self.pipeline if self.pipeline is not None else self.url)

    def __repr__(self) -> str:
        # The generated repr would print the URL with its password into any log or traceback.
        return f"SourceSpec(camera={self.camera!r}, source={self.display!r}, fps={self.fps})"


@dataclass(frozen=True)
class Target:
    kind: str  # rtsp | stream | file | v4l2 | gstreamer
    target: str | int  # what cv2.VideoCapture gets
    api: int

    @property
    def ffmpeg(self) -> bool:
        """FFmpeg opens it: open/read timeouts and packet mode exist (not for V4L2 or GStreamer)."""
        return self.api == cv2.CAP_FFMPEG

    @property
    def live(self) -> bool:
        return self.kind != "file"


def resolve(spec: SourceSpec) -> Target:
    if spec.pipeline is not None:
        return Target("gstreamer", spec.pipeline, cv2.CAP_GSTREAMER)
    url = spec.url
    if isinstance(url, int) or (isinstance(url, str) and url.isdigit()):
        return Target("v4l2", int(url), cv2.CAP_V4L2)
    assert isinstance(url, str)
    if url.startswith("/dev/video"):
        return Target("v4l2", url, cv2.CAP_V4L2)
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("rtsp", "rtsps"):
        return Target("rtsp", url, cv2.CAP_FFMPEG)
    if scheme == "file":
        return Target("file", url2pathname(urlsplit(url).path), cv2.CAP_FFMPEG)
    if scheme:
        return Target("stream", url, cv2.CAP_FFMPEG)
    return Target("file", url, cv2.CAP_FFMPEG)


def open_params(spec: SourceSpec, api: int, packets: bool = False) -> list[int]:
    """The cv2.VideoCapture open parameters for ``spec`` on backend ``api``: FFmpeg's open/read timeouts,
    and packet mode (``CAP_PROP_FORMAT -1``: demuxed Annex-B packets instead of pictures) when asked."""
    if api != cv2.CAP_FFMPEG:
        # Only FFmpeg takes these; OpenCV refuses an open with parameters a backend leaves unused.
        return []
    params = [
        cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
        round(spec.open_timeout_s * 1000),
        cv2.CAP_PROP_READ_TIMEOUT_MSEC,
        round(spec.read_timeout_s * 1000),
    ]
    return [*params, cv2.CAP_PROP_FORMAT, -1] if packets else params
