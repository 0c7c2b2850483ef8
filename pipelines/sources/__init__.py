"""Camera sources: one reader thread per camera filling a latest-frame-wins slot.

    reader = open_reader(SourceSpec("gate", url="rtsp://..."), slot, on_state, decoder="auto")
    reader.start()                       # frames appear in slot; states go to on_state
    reader.stop()

Modules (one reader for every decoder; only the decode stage differs):

    spec.py            SourceSpec (what to open), Target (how OpenCV opens it), process-wide FFmpeg settings
    capture.py         Capture: one open connection through OpenCV, pictures or encoded packets; file rewind
    reader.py          CameraReader: open -> decode stage -> hand over -> stall watch -> reconnect, one loop
    decoder_choice.py  open_reader: the reader with the stage a camera's `decoder` setting asks for
    teardown.py        a camera's teardowns (capture release, session end) on threads of their own
    stages.py          the decode-stage interface; PictureStage (OpenCV decodes: CPU FFmpeg, V4L2, GStreamer)
    nvdec.py           NvdecStage: packets -> NVDEC (PyNvVideoCodec) -> NV12 pictures in device memory
    nvdec_host.py      can this host use NVDEC, memory for one more session, the decoder caps for a stream
    device_nv12.py     DeviceNv12: a decoded picture in device memory its frame owns, and its buffer pool
    bitstream.py       H.264/H.265 helpers: codec names, NAL units
    sps.py             the SPS parser: picture size, profile, colour matrix and range
    pacing.py          the absolute schedule files play on, the fps limit, the reconnect backoff
    watch.py           the stall watch: one thread noticing a camera that delivers no picture in time
    slot.py            FrameSlot: the newest frame wins
"""

from pipelines.sources.decoder_choice import open_reader
from pipelines.sources.reader import CameraReader, StateCallback
from pipelines.sources.slot import FrameSlot
from pipelines.sources.spec import FFMPEG_CAPTURE_OPTIONS, SourceSpec, open_params

__all__ = [
    "FFMPEG_CAPTURE_OPTIONS",
    "CameraReader",
    "FrameSlot",
    "SourceSpec",
    "StateCallback",
    "open_params",
    "open_reader",
]
