"""A camera section as its reader takes it, for the daemon and calibration alike: one place that turns
`cameras.<name>` into a SourceSpec and a reader with the camera's decoder, so no caller drops a key.

Not imported by agent.config itself: it brings in the readers (OpenCV), which loading a config does not need.
"""

from __future__ import annotations

from agent.config.camera import CameraConfig
from pipelines.sources import CameraReader, FrameSlot, SourceSpec, StateCallback, open_reader


def source_spec(name: str, cam: CameraConfig) -> SourceSpec:
    """What camera `name` opens and how patiently (a caller may narrow it: dataclasses.replace)."""
    return SourceSpec(
        camera=name,
        url=cam.url,
        pipeline=cam.pipeline,
        fps=cam.fps,
        loop=cam.loop,
        open_timeout_s=cam.open_timeout_s,
        read_timeout_s=cam.read_timeout_s,
    )


def camera_reader(
    spec: SourceSpec, cam: CameraConfig, slot: FrameSlot | None, on_state: StateCallback | None
) -> CameraReader:
    """The (not yet started) reader of `spec` with the decoder and decoder latency `cam` asks for."""
    return open_reader(spec, slot, on_state, decoder=cam.decoder, latency=cam.decoder_latency)
