"""Gating the built engine itself (where it executes) and falling back when it disagrees with FP32.

No GPU with TensorRT is available to this project, so the engine runtime is a `fake_` stand-in: ONNX
Runtime on the source model, degraded on purpose for the INT8 engine. The builds, the calibration set,
the graph gates and the store are real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import agent.lifecycle.job as job
from agent.config import parse_config
from agent.lifecycle.capture import capture_calibration_set
from agent.lifecycle.model import ModelContext
from engines.buildproc import Event, Progress
from engines.runtimes.ort import OrtBackend
from engines.store import EngineStore

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
MODEL = ASSETS / "nanodet-m-416.onnx"
pytestmark = pytest.mark.slow


class fake_engine_backend(OrtBackend):
    """Runs the FP32 ONNX; as the INT8 engine it scales class scores by 0.3 (a broken calibration)."""

    name = "tensorrt"
    built: ClassVar[list[str]] = []

    def __init__(self, store: Any, model: str, key: str, **_: Any) -> None:
        manifest = store.manifest(model, key)
        self.engine_precision = manifest.build.precision
        fake_engine_backend.built.append(self.engine_precision)
        super().__init__(
            str(MODEL), precision=self.engine_precision if self.engine_precision == "fp32" else "fp32"
        )

    def _infer_impl(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        out = super()._infer_impl(batch)
        if self.engine_precision == "int8":
            out = {k: (v * 0.3 if v.shape[-1] == 80 else v) for k, v in out.items()}
        return out


def test_engine_gate_failure_falls_back_to_fp16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Builds stay real (ahead of time, no GPU); only "can the engine execute here" is answered yes.
    monkeypatch.setattr(job, "engine_runs_here", lambda fp: True)
    monkeypatch.setattr(job, "TensorRTBackend", fake_engine_backend)
    fake_engine_backend.built = []
    cfg = parse_config(
        {
            "engine_dir": str(tmp_path / "engines"),
            "models": {
                "det": {
                    "onnx": str(MODEL),
                    "format": "nanodet",
                    "labels": str(ASSETS / "coco.names"),
                    "backend": "tensorrt_rtx",
                    "precision": "best",
                    "calibration": {"samples": 30, "method": "minmax"},
                    "accuracy_gate": {"min_agreement": 0.5},
                }
            },
            "cameras": {"street": {"url": str(ASSETS / "bikes.mp4"), "model": "det"}},
        }
    )
    capture_calibration_set(cfg, "det", progress=False)  # the parent's part (daemon or CLI)
    events: list[Event] = []
    request = job.JobRequest(ModelContext.from_config(cfg, "det"), "best")
    result = job.run_job(request, events.append)
    assert result.ok, result
    # INT8 passed the graph gate, was built (folded), failed the engine gate; FP16 passed both.
    assert fake_engine_backend.built == ["int8", "fp16"]
    assert result.precision == "fp16"
    engine_int8 = [t for t in result.tried if t.get("runtime") == "tensorrt" and t["precision"] == "int8"]
    assert engine_int8 and engine_int8[0]["passed"] is False and "< min_agreement" in engine_int8[0]["reason"]
    # The plan, step by step: TensorRT-RTX cannot build the unfolded Q/DQ NanoDet, so the folded graph
    # is gated and built next; its engine disagrees, FP16 follows. (Each step is one phase, 0/1 -> 1/1,
    # around its gate's own: "accuracy gate fp16: fp32 reference", "...: candidate", frame by frame.)
    steps = [
        e
        for e in events
        if isinstance(e, Progress) and e.phase.startswith("accuracy gate") and ":" not in e.phase
    ]
    assert [e.phase for e in steps if e.step == 0] == [
        "accuracy gate int8",
        "accuracy gate int8 (folded)",
        "accuracy gate fp16",
    ]
    v = result.validation
    assert v["runtime"] == "tensorrt" and v["passed"] is True and v["precision"] == "fp16"
    assert v["value"] == pytest.approx(1.0)
    manifest = EngineStore(cfg.engine_dir).manifest("det", result.key)
    assert manifest is not None and manifest.validation["runtime"] == "tensorrt"
