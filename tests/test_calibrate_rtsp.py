"""Calibration frames captured from live RTSP cameras, round-robin across cameras and spread in time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import cv2
import pytest
from fixtures_rtsp import RtspServer

from agent.config import parse_config
from agent.lifecycle.capture import capture_calibration_set

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
pytestmark = pytest.mark.slow


def test_capture_from_two_rtsp_cameras(tmp_path: Path, make_rtsp_server: Callable[..., RtspServer]) -> None:
    server = make_rtsp_server(mounts=("/a", "/b"))
    cfg = parse_config(
        {
            "engine_dir": str(tmp_path / "engines"),
            "models": {"det": {"onnx": str(ASSETS / "nanodet-m-416.onnx"), "format": "nanodet"}},
            "cameras": {
                "a": {"url": server.url("/a"), "model": "det"},
                "b": {"url": server.url("/b"), "model": "det"},
            },
        }
    )
    cset = capture_calibration_set(cfg, "det", samples=12, held_out=6, interval_s=0.2, progress=False)
    assert len(cset.calibration_paths) == 12 and len(cset.held_out_paths) == 6
    assert not set(cset.calibration_paths) & set(cset.held_out_paths)
    manifest = json.loads((cset.directory / "calibration.json").read_text())
    assert sorted(manifest["cameras"]) == ["a", "b"]
    text = json.dumps(manifest)
    # Both cameras contribute (round-robin), and every stored frame is a decodable JPEG.
    assert "camera:a#" in text and "camera:b#" in text
    assert all(cv2.imread(str(p)) is not None for p in cset.calibration_paths)
