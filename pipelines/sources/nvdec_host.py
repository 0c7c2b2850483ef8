"""NVDEC on this host (pipelines/sources/nvdec.py): can it be used at all, is there device memory for one
more session, do the decoder's caps take a stream. Each answer is a reason (text) or None; the host and the
caps are asked once per process (a reconnecting camera must not make a driver call each time).
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from types import ModuleType
from typing import Any

from engines.cuda.buffers import CudaError, cuda_call, import_cudart
from engines.errors import UnavailableError
from pipelines.sources.bitstream import codec_name
from pipelines.sources.stages import StageUnusable

INSTALL_HINT = "pip install 'edge-agent[nvdec]'"
# codec_name() -> PyNvVideoCodec's codec names.
NVDEC_CODECS = {"h264": "H264", "hevc": "HEVC"}
# FFmpeg pixel formats as OpenCV reports them (CAP_PROP_CODEC_PIXEL_FORMAT fourcc) -> (chroma, bit depth).
PIXEL_FORMATS = {
    "I420": ("420", 8),
    "J420": ("420", 8),
    "NV12": ("420", 8),
    "YV12": ("420", 8),
    "Y42B": ("422", 8),
    "422P": ("422", 8),
    "444P": ("444", 8),
    "Y444": ("444", 8),
}


_host_lock = threading.Lock()
_host_reason: list[str | None] = []  # memo: [] unknown, [None] usable, [reason]


def import_nvc() -> ModuleType:
    """PyNvVideoCodec, imported only when a camera decodes with NVDEC (an optional extra)."""
    try:
        return importlib.import_module("PyNvVideoCodec")
    except ImportError as exc:
        raise StageUnusable(f"PyNvVideoCodec is not installed ({INSTALL_HINT}): {exc}") from None
    except Exception as exc:  # its import probes the driver and can fail in other ways
        raise StageUnusable(f"PyNvVideoCodec failed to load: {type(exc).__name__}: {exc}") from None


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
    except StageUnusable as exc:
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


_caps_lock = threading.Lock()
_caps: dict[tuple[int, str, str, int], dict[str, Any]] = {}  # (device, codec, chroma, depth) -> caps


def stream_unsupported(
    nvc: Any, codec: str, width: int, height: int, chroma: str, bit_depth: int, device: int = 0
) -> str | None:
    """None when NVDEC's caps accept this stream, else a reason naming codec, size and format.

    The caps of a (device, codec, chroma, depth) are queried once per process: they do not change, and a
    reconnecting camera must not make a driver call each time."""
    name = NVDEC_CODECS.get(codec_name(codec))
    what = f"{codec} {width}x{height} {chroma} {bit_depth}-bit"
    if name is None:
        return f"NVDEC path takes H.264 and H.265, not {codec or 'an unknown codec'} ({what})"
    key = (device, name, chroma, bit_depth)
    with _caps_lock:
        caps = _caps.get(key)
    if caps is None:
        try:
            caps = nvc.GetDecoderCaps(
                gpuid=device,
                codec=getattr(nvc.cudaVideoCodec, name),
                chromaformat=nvc.cudaVideoChromaFormat.__members__[chroma],
                bitdepth=bit_depth,
            )
        except Exception as exc:
            return f"NVDEC caps query failed for {what}: {type(exc).__name__}: {exc}"
        with _caps_lock:
            _caps[key] = caps
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
