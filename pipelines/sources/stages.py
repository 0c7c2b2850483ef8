"""Decode stages: the one part of a camera that depends on what decodes its pictures.

The reader (pipelines/sources/reader.py) opens the capture in the mode a stage asks for, then per unit read:

    stage.start(capture)          each connection: make or reuse a session for this stream (may be slow;
                                  runs on the camera's own thread, under no lock shared with other cameras)
    stage.decode(unit) -> [...]   pictures (with their capture times) out of one packet or grabbed frame
    stage.flush() -> [...]        end of a file that does not loop: pictures still inside the decoder
    stage.end(final) -> closer    connection over (final: the reader too): the slow teardown as a callable,
                                  which the reader runs on a thread of its own, off every camera's frame path

`start` raises :class:`StageUnusable` when this decoder cannot take the stream (the reader falls back to
the CPU for ``decoder: auto``, or fails the camera for ``nvdec``), :class:`SessionError` when it could but
creating the session failed (out of device memory: the camera fails, the others go on).

Stages here: :class:`PictureStage` (OpenCV decodes: FFmpeg on the CPU, V4L2, or a GStreamer pipeline that
decodes itself); pipelines/sources/nvdec.py has the NVDEC one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipelines.frames import DeviceImage
from pipelines.sources.capture import Capture, Unit

# (image, captured monotonic, captured wall clock): a picture with the arrival of the data it came from.
Picture = tuple[np.ndarray | DeviceImage, float, float]
Closer = Callable[[], None]


class StageUnusable(Exception):
    """This decoder cannot decode this stream here (no GPU, codec, size...); the message says why."""


class SessionError(Exception):
    """Creating the decoder session failed (out of device memory, too many sessions); the message says so."""


class StreamError(Exception):
    """The connection cannot go on (a picture that cannot be decoded); the reader reconnects."""


@dataclass
class DecodeStats:
    packets: int = 0
    frames: int = 0
    errors: int = 0  # packets the decoder rejected (corrupt bitstream); decoding resumes at the next IDR
    decode_s: float = 0.0  # host time inside the decoder's Decode() (demux time is the reader's own)
    reconfigures: int = 0  # new sessions for changed stream parameters (resolution changes)
    demux_cpu_s: float = 0.0  # reader thread CPU reading packets (OpenCV/FFmpeg demux)
    decode_cpu_s: float = 0.0  # reader thread CPU in decode(): Decode() and the copy into frame memory
    sessions: int = 0  # sessions created (a reconnect to the same stream reuses the session)

    def add(self, other: DecodeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class DecodeStage(Protocol):
    name: str  # what decodes the pictures (the camera state's `decoder`): cpu, nvdec or pipeline
    packets: bool  # the capture reads encoded packets (FFmpeg demux only), not pictures
    decodes_all: bool  # every unit must be decoded (a decoder's references); else the fps limit skips some

    def start(self, capture: Capture) -> None: ...

    def decode(self, unit: Unit) -> list[Picture]: ...

    def flush(self) -> list[Picture]: ...

    def end(self, final: bool) -> Closer | None: ...

    def totals(self) -> DecodeStats: ...


class PictureStage:
    """OpenCV decodes (FFmpeg on the CPU, V4L2, a GStreamer pipeline); decode() is retrieve(): the colour
    conversion and copy, which frames the fps limit drops never pay for."""

    packets = False
    decodes_all = False

    def __init__(self, name: str = "cpu") -> None:
        self.name = name
        self._capture: Capture | None = None

    def start(self, capture: Capture) -> None:
        self._capture = capture

    def decode(self, unit: Unit) -> list[Picture]:
        assert self._capture is not None
        image = self._capture.retrieve()
        if image is None:
            raise StreamError(f"cannot decode a frame from {self._capture.display}")
        return [(image, unit.arrived, unit.arrived_wall)]

    def flush(self) -> list[Picture]:
        return []  # OpenCV hands out every picture it decoded

    def end(self, final: bool) -> Closer | None:
        self._capture = None
        return None

    def totals(self) -> DecodeStats:
        return DecodeStats()
