"""The NVDEC decode stage: FFmpeg demuxes encoded packets (OpenCV packet mode), NVDEC (PyNvVideoCodec)
decodes them into device memory the frame owns.

    reason = nvdec_unavailable()            # None: this host can use NVDEC at all
    stage = NvdecStage(device=0, latency="low")   # given to a CameraReader (pipelines/sources/reader.py)

Why OpenCV demuxes: PyNvVideoCodec's own RTSP demuxer has no timeouts and no transport option (it hung for
9 minutes on a camera it could not read), while OpenCV's FFmpeg backend in packet mode returns Annex-B
packets with SPS/PPS before each IDR and keeps the reader's open/read timeouts. So an NVDEC camera is the
same reader as every other camera (states, backoff, `last_error`, stall watch, file loops) with this stage.

Each decoded picture is copied (device to device, on the decoder's own stream) into memory the frame owns
(device_nv12.py: why, and the pool it comes from). The copy is NV12 (luma, then interleaved chroma at
`uv_offset`), about 3 MB at 1080p and a few microseconds.

Sessions outlive connections: a camera that reconnects to the same stream (codec and size) keeps its
session (at low latency nothing is held inside it) and restarts decoding at the next key frame, so a
flapping camera does not create and destroy an NVDEC session, query the caps and check device memory every
few seconds. A session ends when the stream changes, the reader ends, or at native latency (pictures held
back belong to the old connection); its teardown runs off the frame path (the reader's closer thread).

`auto` falls back to CPU decoding when NVDEC cannot take the stream (no GPU, no driver libnvcuvid, no
PyNvVideoCodec, a codec/size/chroma format the decoder caps refuse: nvdec_host.py): :class:`StageUnusable`
with the reason.
"""

from __future__ import annotations

import collections
import importlib
import logging
import threading
import time
from typing import Any

import numpy as np

from engines.cuda.buffers import cuda_call, import_cudart
from engines.cuda.handles import handle_of
from pipelines.sources.bitstream import codec_name, find_sps
from pipelines.sources.capture import Capture, Unit
from pipelines.sources.device_nv12 import DeviceNv12, StreamHolder
from pipelines.sources.nvdec_host import (
    NVDEC_CODECS,
    PIXEL_FORMATS,
    device_memory_short,
    import_nvc,
    nvdec_unavailable,
    stream_unsupported,
)
from pipelines.sources.sps import colour_of
from pipelines.sources.stages import Closer, DecodeStats, Picture, SessionError, StageUnusable

# What other modules and tests take from here: the stage, the decoder, its pictures, the host checks.
__all__ = [
    "NVDEC_CODECS",
    "DeviceNv12",
    "NvdecDecoder",
    "NvdecStage",
    "import_nvc",
    "nvdec_unavailable",
    "stream_unsupported",
]

log = logging.getLogger(__name__)


# ---- the decoder --------------------------------------------------------------------------------------
class NvdecDecoder:
    """One NVDEC session on its own stream; `decode(packet)` -> owned DeviceNv12 pictures, in order."""

    def __init__(
        self,
        codec: str,
        *,
        device: int = 0,
        matrix: str = "bt601",
        full_range: bool = False,
        nvc: Any = None,
        latency: str = "LOW",
    ) -> None:
        self._nvc = nvc or import_nvc()
        self.latency = latency  # DisplayDecodeLatencyType member; cameras use LOW (benchmarks compare NATIVE)
        self._rt = import_cudart()
        cuda_call(self._rt, "cudaSetDevice", self._rt.cudaSetDevice(device))
        self._holder = StreamHolder(self._rt)
        self.codec, self.device = codec, device
        self.matrix, self.full_range = matrix, full_range
        self.stats = DecodeStats()
        self._ctx = _primary_context(device)
        self._dec: Any = None
        self._sps: bytes | None = None  # the sequence parameter set the session was made for
        self._create()
        self._skip_to_idr = False

    def _create(self) -> None:
        nvc = self._nvc
        self._dec = nvc.CreateDecoder(
            gpuid=self.device,
            codec=getattr(nvc.cudaVideoCodec, NVDEC_CODECS[codec_name(self.codec)]),
            cudacontext=self._ctx,
            cudastream=self._holder.stream.handle,
            usedevicememory=True,
            # LOW: a picture leaves with the packet that completes it (NATIVE holds 4 back: 160 ms at 25 fps).
            latency=getattr(nvc.DisplayDecodeLatencyType, self.latency),
        )

    def _new_sequence(self, data: np.ndarray) -> list[DeviceNv12]:
        """A key frame with different parameters (size, profile): drain the session, then start a new one.

        A session is sized for its first sequence and rejects larger pictures (measured: a 640x272 session
        threw on 1080p IDRs), so a changed SPS gets a session of its own; the old one's pictures come first.
        """
        raw = data.tobytes()
        sps = find_sps(raw, self.codec)
        if sps is None or sps == self._sps:
            return []
        first, self._sps = self._sps is None, sps
        # The colour matrix and range the preprocessing converts with come from the stream's VUI.
        self.matrix, self.full_range = colour_of(raw, self.codec)
        if first:
            return []
        drained = self.flush()
        self._dec = None
        self._create()
        self.stats.reconfigures += 1
        log.info("NVDEC: new stream parameters, decoder session recreated")
        return drained

    def decode(self, packet: np.ndarray, keyframe: bool) -> list[DeviceNv12]:
        """Decode one Annex-B packet; a corrupt one is counted and skipped up to the next key frame."""
        self.stats.packets += 1
        if self._skip_to_idr and not keyframe:
            return []
        data = np.ascontiguousarray(packet.reshape(-1))
        drained = self._new_sequence(data) if keyframe else []
        pkt = self._nvc.PacketData()
        pkt.bsl_data = data.ctypes.data
        pkt.bsl = data.size
        t0 = time.perf_counter()
        try:
            pictures = self._dec.Decode(pkt)
        except Exception as exc:
            self.stats.errors += 1
            self._skip_to_idr = True
            if self.stats.errors <= 3 or self.stats.errors % 100 == 0:
                log.warning(
                    "NVDEC rejected packet %d (%s); resuming at the next key frame (%d errors)",
                    self.stats.packets,
                    type(exc).__name__,
                    self.stats.errors,
                )
            return drained
        finally:
            self.stats.decode_s += time.perf_counter() - t0
        self._skip_to_idr = False
        out = drained + [self._own(p) for p in pictures]
        self.stats.frames += len(out)
        return out

    def _own(self, picture: Any) -> DeviceNv12:
        luma, chroma = picture.cuda()[:2]
        y, uv = luma.__cuda_array_interface__, chroma.__cuda_array_interface__
        h, w = int(y["shape"][0]), int(y["shape"][1])
        y_pitch = int((y.get("strides") or (w,))[0])
        uv_pitch = int((uv.get("strides") or (w,))[0])
        frame = DeviceNv12(self._holder, w, h, self.matrix, self.full_range)
        rt, stream = self._rt, self._holder.stream.raw
        d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        # Queued on the decoder's stream, behind the decode that wrote the surface. NVDEC's surface is
        # usually one allocation (chroma right below luma at the same pitch): then one 2D copy does both.
        y_ptr, uv_ptr = int(y["data"][0]), int(uv["data"][0])
        if uv_ptr == y_ptr + y_pitch * h and uv_pitch == y_pitch:
            cuda_call(
                rt,
                "cudaMemcpy2DAsync(nv12)",
                rt.cudaMemcpy2DAsync(frame.ptr, w, y_ptr, y_pitch, w, h * 3 // 2, d2d, stream),
            )
        else:
            cuda_call(
                rt,
                "cudaMemcpy2DAsync(luma)",
                rt.cudaMemcpy2DAsync(frame.ptr, w, y_ptr, y_pitch, w, h, d2d, stream),
            )
            cuda_call(
                rt,
                "cudaMemcpy2DAsync(chroma)",
                rt.cudaMemcpy2DAsync(frame.uv_ptr, w, uv_ptr, uv_pitch, w, h // 2, d2d, stream),
            )
        frame.event.record(self._holder.stream)
        return frame

    def resume_at_key_frame(self) -> None:
        """A new connection feeds this session: skip packets up to its first key frame (references from
        the old connection are gone)."""
        self._skip_to_idr = True

    def flush(self) -> list[DeviceNv12]:
        """Pictures still inside the decoder (end of a file)."""
        pkt = self._nvc.PacketData()
        pkt.bsl, pkt.bsl_data = 0, 0
        try:
            return [self._own(p) for p in self._dec.Decode(pkt)]
        except Exception:
            return []

    def close(self) -> None:
        """Wait for queued copies, then destroy the session (frames still alive keep the stream)."""
        if self._dec is None:
            return
        try:
            self._holder.stream.synchronize()
        finally:
            self._dec = None  # PyNvVideoCodec destroys the session with the object
            self._holder.close()


def _primary_context(device: int) -> int:
    """The device's primary context (what the runtime API uses), as PyNvVideoCodec wants it."""
    drv = importlib.import_module("cuda.bindings.driver")
    cuda_call(drv, "cuInit", drv.cuInit(0))
    dev = cuda_call(drv, "cuDeviceGet", drv.cuDeviceGet(device))
    ctx = cuda_call(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    return handle_of(ctx)  # int(ctx) is deprecated from cuda-bindings 12.9.1


# ---- the stage ----------------------------------------------------------------------------------------


class NvdecStage:
    """Decode stage for NVDEC: packets in, `DeviceNv12` pictures out, each stamped with its own packet's
    arrival (a picture the decoder hands out later, at native latency or from a flush, keeps the capture
    time of the data it came from)."""

    name = "nvdec"
    packets = True
    decodes_all = True  # P-frames need every earlier packet: the fps limit drops pictures, not packets

    def __init__(self, *, device: int = 0, latency: str = "low") -> None:
        if latency not in ("low", "native"):
            raise ValueError(f"decoder latency must be low or native, not {latency!r}")
        self.device, self.latency = device, latency
        self._session: NvdecDecoder | None = None
        self._stream_key: tuple[str, int, int, str, int] | None = None  # what the session was made for
        self._arrivals: collections.deque[tuple[float, float]] = collections.deque()
        self._done = DecodeStats()  # ended sessions, summed
        self.sessions_open = 0  # live NVDEC sessions of this camera (0 or 1 once teardowns finished)
        self._lock = threading.Lock()  # sessions_open: the closer thread decrements it

    # -- session ------------------------------------------------------------------------------------
    def start(self, capture: Capture) -> None:
        info = capture.info
        assert info is not None
        if not capture.packets:
            raise StageUnusable(f"NVDEC takes FFmpeg sources (RTSP, files), not {capture.target.kind}")
        why = self._host_unusable()
        if why is not None:
            raise StageUnusable(why)
        chroma, depth = PIXEL_FORMATS.get(info.pixel_format, ("420", 8))
        key = (info.codec, info.width, info.height, chroma, depth)
        self._arrivals.clear()  # stamps of the old connection's packets mean nothing now
        if self._session is not None and key == self._stream_key:
            self._session.resume_at_key_frame()
            return
        old = self._retire()
        if old is not None:  # the stream changed under a kept session: end it before the new one takes memory
            old()
        self._session = self._new_session(info.codec, info.width, info.height, chroma, depth)
        self._stream_key = key
        with self._lock:
            self.sessions_open += 1
        self._done.sessions += 1

    def _new_session(self, codec: str, width: int, height: int, chroma: str, depth: int) -> NvdecDecoder:
        """Memory, caps, then the session; StageUnusable (auto falls back) or SessionError (fails)."""
        what = f"{codec} {width}x{height}"
        short = device_memory_short(width, height, self.device)
        if short is not None:  # not a fallback: the engine shares this memory; other cameras go on
            raise SessionError(f"NVDEC session for {what} could not be created: {short}")
        nvc = import_nvc()
        why = stream_unsupported(nvc, codec, width, height, chroma, depth, self.device)
        if why is not None:
            raise StageUnusable(why)
        try:
            return NvdecDecoder(codec, device=self.device, nvc=nvc, latency=self.latency.upper())
        except Exception as exc:  # out of device memory, too many sessions: other cameras keep streaming
            raise SessionError(
                f"NVDEC session for {what} could not be created: {type(exc).__name__}: {exc}"
            ) from None

    def end(self, final: bool) -> Closer | None:
        """Keep the session for the next connection unless this is the end, or pictures may be held back
        in it (native latency) that belong to this connection."""
        if final or self.latency != "low":
            return self._retire()
        return None

    def _retire(self) -> Closer | None:
        session, self._session, self._stream_key = self._session, None, None
        if session is None:
            return None
        self._done.add(session.stats)

        def close() -> None:
            try:
                session.close()
            finally:
                with self._lock:
                    self.sessions_open -= 1

        return close

    def _host_unusable(self) -> str | None:
        return nvdec_unavailable()

    # -- pictures -----------------------------------------------------------------------------------
    def decode(self, unit: Unit) -> list[Picture]:
        assert self._session is not None and unit.data is not None
        # When each packet arrived, in decode order: camera streams decode in display order (no B-frames);
        # with B-frames this is the nearest packet.
        self._arrivals.append((unit.arrived, unit.arrived_wall))
        pictures = self._stamped(self._session.decode(unit.data, unit.keyframe))
        # Packets that gave no picture (parameter sets, a skipped corrupt packet) must not shift the stamps
        # of later pictures by more than the decoder can hold back.
        held_back = 0 if self._session.latency == "LOW" else 4
        while len(self._arrivals) > held_back:
            self._arrivals.popleft()
        return pictures

    def flush(self) -> list[Picture]:
        if self._session is None:
            return []
        pictures = self._stamped(self._session.flush())
        self._arrivals.clear()
        return pictures

    def _stamped(self, images: list[Any]) -> list[Picture]:
        out = []
        for image in images:
            arrived, wall = self._arrivals.popleft() if self._arrivals else (time.monotonic(), time.time())
            out.append((image, arrived, wall))
        return out

    def totals(self) -> DecodeStats:
        """Packets, pictures, errors and Decode() time over past sessions and the current one (live)."""
        out = DecodeStats()
        out.add(self._done)
        session = self._session
        if session is not None:
            out.add(session.stats)
        return out
