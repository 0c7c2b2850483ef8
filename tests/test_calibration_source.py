"""Calibration from live cameras opens each one as the daemon does (agent.config.reader): its decoder too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_rtsp import RtspServer

from agent.config import parse_config
from agent.lifecycle.calibration import CalibrationError
from agent.lifecycle.capture import capture_calibration_set
from pipelines.sources.nvdec import nvdec_unavailable

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
pytestmark = pytest.mark.slow


def test_capture_from_a_camera_set_to_nvdec_decodes_with_nvdec(
    tmp_path: Path, make_rtsp_server: Callable[..., RtspServer]
) -> None:
    """Calibration built its own reader, on the CPU whatever the camera's `decoder` said."""
    server = make_rtsp_server(mounts=("/a",))
    cfg = parse_config(
        {
            "engine_dir": str(tmp_path / "engines"),
            "models": {"det": {"onnx": str(ASSETS / "nanodet-m-416.onnx"), "format": "nanodet"}},
            "cameras": {"a": {"url": server.url("/a"), "model": "det", "decoder": "nvdec"}},
        }
    )
    why = nvdec_unavailable()
    if why is None:  # a GPU host: NVDEC decodes the frames
        cset = capture_calibration_set(cfg, "det", samples=4, held_out=2, interval_s=0.2, progress=False)
        assert len(cset.calibration_paths) == 4
        return
    # Here: the camera fails as it does in the daemon, naming what NVDEC lacks (it never falls back).
    with pytest.raises(CalibrationError) as err:
        capture_calibration_set(cfg, "det", samples=4, held_out=2, interval_s=0.2, progress=False)
    assert "decoder nvdec" in str(err.value) and why in str(err.value)
