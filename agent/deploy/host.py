"""What the deployment orchestrator (agent.deploy.manager) needs from the running agent, and nothing more.

The Device/Runtime implements DeployHost: the model sections of its config, the last live frames of a
model's cameras, a backend for a candidate model config (built through the engine lifecycle: timing cache,
precision, the precision gate; ONNX Runtime where no TensorRT runs), the backend serving now, the hot swap
(agent.lifecycle.swap) and the cameras' health from telemetry. The orchestrator decides; the host acts.

For the real host (the Device/Runtime wiring): candidate_backend builds as EngineManager._open does, for a
ModelContext(model, model_cfg, engine_dir, score_threshold): agent.lifecycle engine_target(ctx) -> OrtOnly:
an OrtBackend of ctx.spec.onnx (the embedded default); else JobRunner.run(ctx, caps, precision, force=False,
on_event) under the model's build lock (frames for the precision gate / INT8 from the running pipeline; the
version's calibration/ folder where effective_model set it), then the built plan opened as Adopter.load does,
WITHOUT adopting it (promote does that, through the hot swap). live_frames: the last frames the model's
pipelines decoded (a small ring per camera), as agent.lifecycle.capture takes them for calibration.
camera_health: agent.runtime.reports' per-camera window (frames, age p95, detections) and the camera state.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from agent.config import ModelConfig
from engines.runtimes.base import Backend

Frame = tuple[str, np.ndarray]  # (camera, BGR image)


@dataclass(frozen=True)
class CameraHealth:
    """One camera of a model over the host's recent window (agent.runtime.reports' figures):
    frames processed, frame age p95 (None: no frame), detections per frame, the camera state
    ("running", "failed", ...) and the engine errors counted so far (cumulative)."""

    frames: int
    age_p95_ms: float | None
    detections_per_frame: float
    state: str
    errors: int = 0


class DeployHost(Protocol):
    def model_config(self, model: str) -> ModelConfig | None:
        """The config's own section of `model` (None: not a model of the config)."""
        ...

    def score_threshold(self, model: str) -> float:
        """The lowest min_score of the model's enabled cameras (what its detections are cut at)."""
        ...

    def engine_dir(self) -> Path | None:
        """Where the engines of pruned versions are deleted (None: no engine store)."""
        ...

    def live_frames(self, model: str, n: int, timeout_s: float) -> list[Frame]:
        """Up to the last `n` frames of the model's cameras, waiting up to `timeout_s` for them."""
        ...

    def candidate_backend(self, model: str, model_cfg: ModelConfig) -> AbstractContextManager[Backend]:
        """A loaded backend of `model_cfg` (engine built through the lifecycle), closed on exit; raises
        DeployError (or EngineError/BackendError) when it cannot be built."""
        ...

    def serving_backend(self, model: str) -> AbstractContextManager[Backend]:
        """A backend running what serves `model` now (its own session: the serving one is not slowed)."""
        ...

    def promote(self, model: str, model_cfg: ModelConfig) -> None:
        """Serve `model_cfg` for `model` from now on (the hot swap; raises when the swap is refused)."""
        ...

    def camera_health(self, model: str) -> dict[str, CameraHealth]:
        """Per camera of `model`, now."""
        ...

    def publish_state(self, model: str, payload: bytes) -> None:
        """Publish the retained `deployments/{model}` state."""
        ...
