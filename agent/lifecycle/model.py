"""One model as the engine lifecycle sees it: its resolved config, where its engines live, and the
score threshold its cameras publish at. Made from the agent config once (daemon start, CLI command) and
handed to the precision job as JSON, so the child never reads the YAML again.

    ctx = ModelContext.from_config(cfg, "detector")
    ctx.build_settings("fp16")            # engines.settings.BuildSettings
    ModelContext.from_json(ctx.to_json()) == ctx
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import AgentConfig, ConfigError, ModelConfig
from engines.runtimes.base import TensorSpec
from engines.settings import BuildSettings, onnx_input_shapes, profiles_from_json
from pipelines.models import ModelAdapter, make_adapter
from pipelines.postprocess import load_labels

DEFAULT_SCORE_THRESHOLD = 0.4  # the camera default min_score


def adapter_for(name: str, mcfg: ModelConfig) -> ModelAdapter:
    """The adapter inference uses for the model, sized from its ONNX input (no runtime session needed)."""
    if mcfg.labels is None:
        raise ConfigError(f"models.{name}.labels: required to know the class count of {mcfg.onnx}")
    try:
        labels = load_labels(mcfg.labels)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"models.{name}.labels: {e}") from None
    inputs = onnx_input_shapes(mcfg.onnx)
    if len(inputs) != 1:
        raise ConfigError(f"models.{name}.onnx: {mcfg.onnx} has inputs {list(inputs)}; expected one image")
    input_name, dims = next(iter(inputs.items()))
    return make_adapter(mcfg.format, TensorSpec(input_name, dims, np.dtype(np.float32)), len(labels))


@dataclass(frozen=True)
class ModelContext:
    name: str
    cfg: ModelConfig
    engine_dir: Path
    score_threshold: float  # the lowest min_score of the model's enabled cameras

    @classmethod
    def from_config(cls, cfg: AgentConfig, name: str) -> ModelContext:
        if name not in cfg.models:
            raise ConfigError(f"models.{name}: unknown model (known: {', '.join(sorted(cfg.models))})")
        scores = [c.min_score for c in cfg.cameras.values() if c.model == name and c.enabled]
        mcfg = cfg.models[name]
        if mcfg.postprocess == "graph":  # from here on the grafted graph is the model (agent.lifecycle.graft)
            from agent.lifecycle.graft import grafted_onnx

            grafted = grafted_onnx(name, mcfg, Path(cfg.engine_dir), adapter_for(name, mcfg))
            mcfg = mcfg.model_copy(update={"onnx": grafted})
        return cls(name, mcfg, Path(cfg.engine_dir), min(scores, default=DEFAULT_SCORE_THRESHOLD))

    # ---- JSON form (the precision job request) -------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.cfg.model_dump(mode="json"),
            "engine_dir": str(self.engine_dir),
            "score_threshold": self.score_threshold,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelContext:
        """Raises ConfigError (naming the request field) on a malformed request."""
        try:
            return cls(
                str(d["name"]),
                ModelConfig.model_validate(d["model"]),
                Path(d["engine_dir"]),
                float(d["score_threshold"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"job request: model context: {exc}") from None

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def trt_flavor(self) -> str | None:
        """The TensorRT flavour the model asks for (None: any)."""
        return self.cfg.backend if self.cfg.backend in ("tensorrt", "tensorrt_rtx") else None

    @property
    def calibration_dir(self) -> Path:
        return self.engine_dir / self.name / "calibration"

    def build_settings(self, precision: str | None = None) -> BuildSettings:
        cfg = self.cfg
        return BuildSettings(
            onnx=cfg.onnx,
            precision=precision or cfg.precision,
            batch=(cfg.batch.min, cfg.batch.opt, cfg.batch.max),
            workspace_bytes=cfg.engine.workspace_mb << 20,
            optimization_level=cfg.engine.optimization_level,
            dla_core=cfg.engine.dla_core,
            target_compute_capability=cfg.engine.target_compute_capability,
            contexts=cfg.streams,
            profiles=None
            if cfg.profiles is None
            else tuple(profiles_from_json([{k: v.model_dump() for k, v in p.items()} for p in cfg.profiles])),
        )
