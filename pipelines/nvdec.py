"""Hardware decode: OpenCV demuxes encoded packets, NVDEC (PyNvVideoCodec) decodes them into device memory.

    reason = nvdec_unavailable()                       # None: this host can use NVDEC at all
    reader = NvdecReader(spec, slot, on_state=..., mode="auto")   # same contract as CameraReader

Why OpenCV demuxes: PyNvVideoCodec's own RTSP demuxer has no timeouts and no transport option (it hung for
9 minutes on a camera it could not read), while OpenCV's FFmpeg backend in packet mode (`CAP_PROP_FORMAT
-1`) returns Annex-B packets with SPS/PPS before each IDR and keeps the reader's open/read timeouts. So the
NVDEC reader is the CPU reader with packets instead of pictures: same states, backoff, `last_error`,
latest-frame-wins slot, stall detection.

Each decoded picture is copied (device to device, on the decoder's own stream) into memory the frame owns:
NVDEC recycles its output surfaces after a few more packets, and a frame may wait in the slot or in the
scheduler longer than that. The copy is NV12 (luma, then interleaved chroma at `uv_offset`), about 3 MB at
1080p and a few microseconds. The frame carries an event recorded after the copy; consumers make their
stream wait on it (no host synchronisation). The memory comes from the stream-ordered allocator and goes
back to its pool when the frame is garbage; the stream outlives every frame that references it.

`auto` falls back to the CPU reader when NVDEC cannot take the stream (no GPU, no driver libnvcuvid, no
PyNvVideoCodec, a codec/size/chroma format the decoder caps refuse); the reason is logged once and shown in
the camera's `decoder_reason`. `nvdec` named explicitly turns the same reasons into `failed`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import cv2
import numpy as np

from engines.cuda_buffers import CudaError, Event, Stream, cuda_call, import_cudart
from engines.errors import UnavailableError
from pipelines.demux import colour_of
from pipelines.sources import CameraReader, FrameSlot, SourceSpec, StateCallback

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'edge-agent[nvdec]'"
# FFmpeg codec tags (CAP_PROP_FOURCC) -> PyNvVideoCodec codec names.
_CODECS = {"h264": "H264", "avc1": "H264", "hevc": "HEVC", "hev1": "HEVC", "hvc1": "HEVC", "h265": "HEVC"}
# FFmpeg pixel formats as OpenCV reports them (CAP_PROP_CODEC_PIXEL_FORMAT fourcc) -> (chroma, bit depth).
_PIXEL_FORMATS = {
    "I420": ("420", 8),
    "J420": ("420", 8),
    "NV12": ("420", 8),
    "YV12": ("420", 8),
    "Y42B": ("422", 8),
    "422P": ("422", 8),
    "444P": ("444", 8),
    "Y444": ("444", 8),
}


def _fourcc(value: float) -> str:
    code = int(value) & 0xFFFFFFFF
    return code.to_bytes(4, "little").decode("latin-1").strip("\x00 ")


class NvdecUnavailable(Exception):
    """NVDEC cannot decode this camera here; the message says what is missing (shown in camera state)."""


# ---- what this host can do ----------------------------------------------------------------------------
_host_lock = threading.Lock()
_host_reason: list[str | None] = []  # memo: [] unknown, [None] usable, [reason]


def import_nvc() -> ModuleType:
    """PyNvVideoCodec, imported only when a camera decodes with NVDEC (an optional extra)."""
    try:
        return importlib.import_module("PyNvVideoCodec")
    except ImportError as exc:
        raise NvdecUnavailable(f"PyNvVideoCodec is not installed ({INSTALL_HINT}): {exc}") from None
    except Exception as exc:  # its import probes the driver and can fail in other ways
        raise NvdecUnavailable(f"PyNvVideoCodec failed to load: {type(exc).__name__}: {exc}") from None


def nvdec_unavailable() -> str | None:
    """None when NVDEC is usable on this host, else why not (checked once per process)."""
    with _host_lock:
        if not _host_reason:
            _host_reason.append(_probe_host())
        return _host_reason[0]


def _probe_host() -> str | None:
    try:
        ctypes.CDLL("libnvcuvid.so.1")  # the driver's decode library; PyNvVideoCodec needs it at decode
    except OSError:
        return "the NVIDIA driver's libnvcuvid.so.1 is not installed (no GPU, or the driver lacks video)"
    try:
        rt = import_cudart()
        count = cuda_call(rt, "cudaGetDeviceCount", rt.cudaGetDeviceCount())
    except (UnavailableError, CudaError) as exc:
        return f"no CUDA device: {exc}"
    if not count:
        return "no CUDA device"
    try:
        import_nvc()
    except NvdecUnavailable as exc:
        return str(exc)
    return None


# Below about this much free device memory PyNvVideoCodec 2.2.4 crashed the process in its first NVDEC call
# (GetDecoderCaps, segmentation fault; H100, fresh process: crashed at 520 MiB free, worked at 776 MiB).
NVDEC_HEADROOM_MIB = 768


def device_memory_short(width: int, height: int, device: int = 0) -> str | None:
    """A reason when the device lacks the memory for one more NVDEC session of this size, else None.

    Checked before the caps query and the session, because a crash there would take every camera down. The
    session: up to 20 decode surfaces (the H.264/H.265 picture buffer, 16, plus 4) of NV12 at the coded size
    and the picture pool (4 more), plus 32 MiB (measured: 128 MiB for 1080p); then NVDEC_HEADROOM_MIB."""
    coded = ((width + 15) // 16 * 16) * ((height + 15) // 16 * 16) * 3 // 2
    need = 24 * coded + ((32 + NVDEC_HEADROOM_MIB) << 20)
    rt = import_cudart()
    cuda_call(rt, "cudaSetDevice", rt.cudaSetDevice(device))
    free, _total = cuda_call(rt, "cudaMemGetInfo", rt.cudaMemGetInfo())
    if int(free) < need:
        return f"out of device memory: {int(free) >> 20} MiB free on GPU {device}, {need >> 20} MiB needed"
    return None


def stream_unsupported(
    nvc: Any, codec: str, width: int, height: int, chroma: str, bit_depth: int, device: int = 0
) -> str | None:
    """None when NVDEC's caps accept this stream, else a reason naming codec, size and format."""
    name = _CODECS.get(codec.lower())
    what = f"{codec} {width}x{height} {chroma} {bit_depth}-bit"
    if name is None:
        return f"NVDEC path takes H.264 and H.265, not {codec or 'an unknown codec'} ({what})"
    try:
        caps = nvc.GetDecoderCaps(
            gpuid=device,
            codec=getattr(nvc.cudaVideoCodec, name),
            chromaformat=nvc.cudaVideoChromaFormat.__members__[chroma],
            bitdepth=bit_depth,
        )
    except Exception as exc:
        return f"NVDEC caps query failed for {what}: {type(exc).__name__}: {exc}"
    if not caps.get("supported"):
        return f"this GPU's NVDEC does not decode {what}"
    if not (
        caps["width_min"] <= width <= caps["width_max"] and caps["height_min"] <= height <= caps["height_max"]
    ):
        return (
            f"this GPU's NVDEC decodes {name} from {caps['width_min']}x{caps['height_min']} to "
            f"{caps['width_max']}x{caps['height_max']}, not {width}x{height}"
        )
    return None


# ---- a decoded frame on the device ------------------------------------------------------------------
class _StreamHolder:
    """Owns the decoder's CUDA stream and a small pool of picture buffers; every frame references it, so
    the stream is destroyed after the last frame.

    Buffers (with their events) go back to the pool when a frame is garbage and are reused for the next
    pictures of the same size: a picture then costs two CUDA calls (copy, record) instead of six
    (measured: 16 streams decoded 15 % slower than PyNvVideoCodec's own loop with an allocation and an
    event per picture). A dropped frame is never read again and a consumed one is dropped only after
    the batch that read it finished on the GPU, so a buffer is free when its frame is.
    """

    KEEP = 8  # idle buffers kept per holder (about 25 MB at 1080p)

    def __init__(self, cudart: ModuleType) -> None:
        self.rt = cudart
        self.stream = Stream(cudart)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, Event]] = []  # (nbytes, ptr, event)
        self.closed = False

    def take(self, nbytes: int) -> tuple[int, Event]:
        with self._lock:
            for i, (size, ptr, event) in enumerate(self._free):
                if size == nbytes:
                    del self._free[i]
                    return ptr, event
        rt = self.rt
        ptr = int(cuda_call(rt, f"cudaMallocAsync({nbytes})", rt.cudaMallocAsync(nbytes, self.stream.raw)))
        return ptr, Event(rt, timing=False)

    def give(self, nbytes: int, ptr: int, event: Event) -> None:
        with self._lock:
            if not self.closed and len(self._free) < self.KEEP:
                self._free.append((nbytes, ptr, event))
                return
        self._release(ptr, event)

    def _release(self, ptr: int, event: Event) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown or a lost context: nothing to free
            self.rt.cudaFreeAsync(ptr, self.stream.raw)
            event.destroy()

    def close(self) -> None:
        """Free the idle buffers (frames still alive free theirs when they go)."""
        with self._lock:
            self.closed = True
            idle, self._free = self._free, []
        for _, ptr, event in idle:
            self._release(ptr, event)

    def __del__(self) -> None:
        self.close()
        with contextlib.suppress(Exception):
            self.stream.destroy()


class DeviceNv12:
    """One NV12 picture in device memory owned by its frame (`Frame.image` for NVDEC cameras).

    `shape` is (h, w, 3) like a decoded BGR image, so code that only needs the size works unchanged;
    `download()` gives the BGR host image for snapshots, calibration and the accuracy gate.
    """

    __slots__ = (
        "__weakref__",
        "_holder",
        "event",
        "full_range",
        "height",
        "matrix",
        "pitch",
        "ptr",
        "uv_offset",
        "width",
    )

    def __init__(self, holder: _StreamHolder, width: int, height: int, matrix: str, full_range: bool) -> None:
        self._holder = holder
        self.width, self.height, self.pitch = width, height, width
        self.uv_offset = width * height
        self.matrix, self.full_range = matrix, full_range
        self.ptr, self.event = holder.take(width * height * 3 // 2)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @property
    def stream(self) -> int:
        """Handle of the stream that wrote the picture (wait on `event` rather than on this)."""
        return self._holder.stream.handle

    @property
    def uv_ptr(self) -> int:
        return self.ptr + self.uv_offset

    def download(self) -> np.ndarray:
        """BGR uint8 host copy (waits for the decode; OpenCV's NV12 conversion, BT.601 limited range)."""
        rt = self._holder.rt
        host = np.empty((self.height * 3 // 2, self.width), np.uint8)
        self.event.synchronize()
        cuda_call(
            rt,
            "cudaMemcpy(device -> host)",
            rt.cudaMemcpy(host.ctypes.data, self.ptr, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost),
        )
        return cv2.cvtColor(host, cv2.COLOR_YUV2BGR_NV12)

    def __del__(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            with contextlib.suppress(Exception):
                self._holder.give(self.width * self.height * 3 // 2, ptr, self.event)


# ---- the decoder --------------------------------------------------------------------------------------
@dataclass
class DecodeStats:
    packets: int = 0
    frames: int = 0
    errors: int = 0  # packets the decoder rejected (corrupt bitstream); decoding resumes at the next IDR
    decode_s: float = 0.0  # host time inside Decode() (demux time is the reader's own)
    reconfigures: int = 0  # new sessions for changed stream parameters (resolution changes)
    demux_cpu_s: float = 0.0  # reader thread CPU reading packets (OpenCV/FFmpeg demux)
    decode_cpu_s: float = 0.0  # reader thread CPU in decode(): Decode() and the copy into frame memory


def _parameter_set(data: bytes, codec: str) -> bytes | None:
    """The SPS NAL unit of an Annex-B packet (H.264 type 7, H.265 type 33), or None.

    Walks start codes with bytes.find: a key frame holds a handful of NAL units, never a per-byte loop.
    """
    hevc = _CODECS.get(codec.lower()) == "HEVC"
    start = data.find(b"\x00\x00\x01")
    while start >= 0:
        begin = start + 3
        end = data.find(b"\x00\x00\x01", begin)
        if begin < len(data):
            kind = (data[begin] >> 1) & 0x3F if hevc else data[begin] & 0x1F
            if kind == (33 if hevc else 7):
                return data[begin : end if end >= 0 else len(data)].rstrip(b"\x00")
        start = end
    return None


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
        self._holder = _StreamHolder(self._rt)
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
            codec=getattr(nvc.cudaVideoCodec, _CODECS[self.codec.lower()]),
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
        sps = _parameter_set(raw, self.codec)
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
    return int(ctx)


# ---- the reader ---------------------------------------------------------------------------------------
_told: set[str] = set()  # host-level reasons already logged (once per process, not once per camera)


def open_reader(
    spec: SourceSpec,
    slot: FrameSlot | None,
    on_state: StateCallback | None,
    *,
    decoder: str = "auto",
    device: int = 0,
    latency: str = "low",
) -> CameraReader:
    """The reader a camera's `decoder` setting asks for: cpu, nvdec, or auto (NVDEC where it works).

    For auto on a host without NVDEC this is the plain CPU reader, with the reason in `decoder_reason`
    (logged once per process); per-stream reasons (codec, size) are found when the stream opens.
    """
    if decoder == "cpu":
        return CameraReader(spec, slot, on_state)
    if decoder == "auto":
        why = nvdec_unavailable()
        if why is not None:
            if why not in _told:
                _told.add(why)
                log.info("NVDEC not used (%s): cameras with decoder auto decode on the CPU", why)
            reader = CameraReader(spec, slot, on_state)
            reader.decoder_reason = why
            return reader
        if spec.pipeline is not None:
            reader = CameraReader(spec, slot, on_state)
            reader.decoder_reason = "a GStreamer pipeline decodes itself"
            return reader
    return NvdecReader(spec, slot, on_state, mode=decoder, device=device, latency=latency)


class NvdecReader(CameraReader):
    """CameraReader whose frames are NVDEC pictures in device memory (`DeviceNv12`).

    mode "auto": any reason NVDEC cannot take the stream switches this camera to CPU decoding (logged once,
    `decoder_reason`); mode "nvdec": the reason fails the camera, naming codec and what is missing.
    """

    def __init__(
        self,
        spec: SourceSpec,
        slot: FrameSlot | None = None,
        on_state: StateCallback | None = None,
        *,
        mode: str = "auto",
        device: int = 0,
        latency: str = "low",
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, slot, on_state, **kwargs)
        if mode not in ("auto", "nvdec"):
            raise ValueError(f"camera {spec.camera!r}: NvdecReader mode must be auto or nvdec, not {mode!r}")
        if latency not in ("low", "native"):
            raise ValueError(
                f"camera {spec.camera!r}: decoder latency must be low or native, not {latency!r}"
            )
        self.mode, self.device, self.latency = mode, device, latency
        self.decoder = "nvdec"  # what decodes now: nvdec, or cpu after an auto fallback
        self.decoder_reason: str | None = None
        self.decode_stats = DecodeStats()  # summed over sessions
        self.sessions_open = 0  # live NVDEC sessions (0 or 1): reconnects must not leak them
        self._failed: str | None = None
        self._session: NvdecDecoder | None = None
        if self._target.kind not in ("rtsp", "stream", "file"):
            why = f"NVDEC takes FFmpeg sources (RTSP, files), not {self._target.kind}"
            if mode == "nvdec":
                raise NvdecUnavailable(f"camera {spec.camera!r}: decoder nvdec: {why}")
            self._fall_back(why)

    def stats(self) -> dict[str, object]:
        out = super().stats()
        out.update(decoder=self.decoder, decoder_reason=self.decoder_reason, decode_errors=self.decode_errors)
        return out

    def decode_totals(self) -> DecodeStats:
        """Packets, pictures, errors and Decode() time over past sessions and the current one (live)."""
        session, done = self._session, self.decode_stats
        now = session.stats if session is not None else DecodeStats()
        return DecodeStats(
            done.packets + now.packets,
            done.frames + now.frames,
            done.errors + now.errors,
            done.decode_s + now.decode_s,
            done.reconfigures + now.reconfigures,
            done.demux_cpu_s,
            done.decode_cpu_s,
        )

    @property
    def decode_errors(self) -> int:
        """Packets NVDEC rejected, past sessions and the current one."""
        session = self._session
        return self.decode_stats.errors + (session.stats.errors if session is not None else 0)

    def _fall_back(self, reason: str) -> None:
        if self.decoder != "cpu":
            log.warning("camera %s: decoding on the CPU: %s", self.spec.camera, reason)
        self.decoder, self.decoder_reason = "cpu", reason

    def _fail(self, reason: str) -> tuple[int, str]:
        """End the reader in state failed (run() reports it): retrying cannot help."""
        self._failed = self._scrub(reason)
        self._stopping.set()
        return 0, self._failed

    def _open_params(self) -> list[int]:
        params = super()._open_params()
        if self.decoder == "nvdec" and self._target.api == cv2.CAP_FFMPEG:
            params += [cv2.CAP_PROP_FORMAT, -1]  # packets, not pictures
        return params

    def _stream(self, cap: cv2.VideoCapture) -> tuple[int, str]:
        if self.decoder == "cpu":
            return super()._stream(cap)
        codec = _fourcc(cap.get(cv2.CAP_PROP_FOURCC))
        w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        chroma, depth = _PIXEL_FORMATS.get(_fourcc(cap.get(cv2.CAP_PROP_CODEC_PIXEL_FORMAT)), ("420", 8))
        why = nvdec_unavailable()
        if why is None:
            short = device_memory_short(w, h, self.device)
            if short is not None:  # not a fallback: the engine shares this memory; other cameras go on
                return self._fail(f"NVDEC session for {codec} {w}x{h} could not be created: {short}")
            nvc = import_nvc()
            why = stream_unsupported(nvc, codec, w, h, chroma, depth, self.device)
        if why is not None:
            if self.mode == "nvdec":
                return self._fail(f"decoder nvdec: {why}")
            self._fall_back(self._scrub(why))
            cap.release()  # reopen as pictures at once: no backoff, no reconnecting state for a fallback
            cpu_cap, error = self._open()
            if cpu_cap is None:
                return 0, error
            try:
                return super()._stream(cpu_cap)
            finally:
                cpu_cap.release()
        try:
            decoder = NvdecDecoder(codec, device=self.device, nvc=nvc, latency=self.latency.upper())
        except Exception as exc:  # out of device memory, too many sessions: other cameras keep streaming
            return self._fail(
                f"NVDEC session for {codec} {w}x{h} could not be created: {type(exc).__name__}: {exc}"
            )
        self.sessions_open += 1
        self._session = decoder
        try:
            return self._stream_packets(cap, decoder)
        finally:
            decoder.close()
            self._session = None
            self.sessions_open -= 1
            s = decoder.stats
            self.decode_stats.packets += s.packets
            self.decode_stats.frames += s.frames
            self.decode_stats.errors += s.errors
            self.decode_stats.decode_s += s.decode_s

    def _stream_packets(self, cap: cv2.VideoCapture, decoder: NvdecDecoder) -> tuple[int, str]:
        spec = self.spec
        is_file = self._target.kind == "file"
        pace = 0.0
        if is_file and spec.realtime:
            native = cap.get(cv2.CAP_PROP_FPS)
            if 0 < native <= 1000:
                pace = 1.0 / native
        limit = 1.0 / spec.fps if spec.fps else 0.0
        next_pace = time.monotonic()
        next_emit: float | None = None
        delivered = 0
        # When each packet arrived, in decode order: a picture the decoder hands out later (latency native, or
        # the pictures of a flush) is stamped with its own packet's arrival, not with the moment it came out.
        # Camera streams decode in display order (no B-frames); with B-frames this is the nearest packet.
        arrivals: collections.deque[tuple[float, float]] = collections.deque()
        held_back = 0 if decoder.latency == "LOW" else 4  # pictures the decoder may still owe

        def emit(pictures: list[DeviceNv12]) -> None:
            nonlocal next_emit, delivered
            for picture in pictures:
                arrived, arrived_wall = arrivals.popleft() if arrivals else (time.monotonic(), time.time())
                self.frames_read += 1
                if limit:
                    now = time.monotonic()
                    if next_emit is not None and now < next_emit:
                        continue  # decoded (later pictures need it) but not delivered
                    next_emit = (
                        now + limit if next_emit is None or now - next_emit > limit else next_emit + limit
                    )
                delivered += 1
                self._hand_over(picture, arrived_wall, arrived, delivered == 1)

        while not self._stopping.is_set():
            if pace:
                delay = next_pace - time.monotonic()
                if delay > 0 and self._stopping.wait(delay):
                    break
                next_pace = max(next_pace + pace, time.monotonic() - pace)
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                ok, packet = cap.read()
            except cv2.error as exc:
                return delivered, self._scrub(f"read error on {self.display}: {exc}")
            t1, c1 = time.monotonic(), time.thread_time()
            self.decode_stats.demux_cpu_s += c1 - c0
            if not ok or packet is None:
                if is_file:
                    emit(decoder.flush())  # the pictures a native-latency decoder still holds
                    arrivals.clear()
                if is_file and spec.loop and delivered:
                    if not cap.set(cv2.CAP_PROP_POS_FRAMES, 0):
                        cap.open(self._target.target, self._target.api, self._open_params())
                    continue
                if is_file:
                    return delivered, self._scrub(
                        f"{'end of file' if delivered else 'cannot read'}: {self.display}"
                    )
                if t1 - t0 >= spec.read_timeout_s:
                    return delivered, self._scrub(f"no frame for {spec.read_timeout_s:g} s: {self.display}")
                return delivered, self._scrub(f"stream ended or read failed: {self.display}")
            if not is_file and t1 - t0 >= spec.read_timeout_s:
                return delivered, self._scrub(f"no frame for {spec.read_timeout_s:g} s: {self.display}")
            keyframe = bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME))
            arrivals.append((t1, time.time()))
            pictures = decoder.decode(packet, keyframe)
            self.decode_stats.decode_cpu_s += time.thread_time() - c1
            emit(pictures)
            # Packets that gave no picture (parameter sets, a skipped corrupt packet) must not shift the
            # stamps of later pictures by more than the decoder can hold back.
            while len(arrivals) > held_back:
                arrivals.popleft()
        return delivered, "stopped"

    def run(self) -> None:
        super().run()
        if self._failed is not None:
            self.last_error = self._failed
            self._set_state("failed", self._failed)
