"""The reader a camera's ``decoder`` setting asks for: cpu, nvdec, or auto (NVDEC where it works).

    reader = open_reader(spec, slot, on_state, decoder="auto")   # pipelines.sources.open_reader

Only the decode stage differs between the choices (pipelines/sources/stages.py, nvdec.py); the reader's
loop is the same for all (pipelines/sources/reader.py).
"""

from __future__ import annotations

import logging

from pipelines.sources.nvdec import NvdecStage, nvdec_unavailable
from pipelines.sources.reader import CameraReader, StateCallback
from pipelines.sources.slot import FrameSlot
from pipelines.sources.spec import SourceSpec, resolve

log = logging.getLogger("pipelines.sources")

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
    """The reader a camera's ``decoder`` setting asks for: cpu, nvdec, or auto (NVDEC where it works).

    A GStreamer pipeline decodes itself (stage "pipeline"). For auto on a host without NVDEC, or a source
    NVDEC cannot take (V4L2), this is CPU decoding with the reason in ``decoder_reason`` (host reasons
    logged once per process); per-stream reasons (codec, size) are found when the stream opens.
    """
    if decoder not in ("auto", "cpu", "nvdec"):
        raise ValueError(f"camera {spec.camera!r}: decoder must be auto, cpu or nvdec, not {decoder!r}")
    if spec.pipeline is not None or decoder == "cpu":
        return CameraReader(spec, slot, on_state, mode=decoder)
    if decoder == "auto":
        kind = resolve(spec).kind
        why = nvdec_unavailable()
        if why is not None and why not in _told:
            _told.add(why)
            log.info("NVDEC not used (%s): cameras with decoder auto decode on the CPU", why)
        if why is None and kind in ("v4l2", "gstreamer"):
            why = f"NVDEC takes FFmpeg sources (RTSP, files), not {kind}"
        if why is not None:
            reader = CameraReader(spec, slot, on_state, mode=decoder)
            reader.decoder_reason = why
            return reader
    return CameraReader(spec, slot, on_state, stage=NvdecStage(device=device, latency=latency), mode=decoder)
