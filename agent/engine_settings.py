"""Model config -> engine build settings (shared by the daemon, the CLI and the precision job)."""

from __future__ import annotations

from agent.config import ModelConfig
from engines.settings import BuildSettings, profiles_from_json


def build_settings(cfg: ModelConfig, precision: str | None = None) -> BuildSettings:
    return BuildSettings(
        onnx=cfg.onnx,
        precision=precision or cfg.precision,
        batch=(cfg.batch.min, cfg.batch.opt, cfg.batch.max),
        workspace_bytes=cfg.engine.workspace_mb << 20,
        optimization_level=cfg.engine.optimization_level,
        dla_core=cfg.engine.dla_core,
        target_compute_capability=cfg.engine.target_compute_capability,
        profiles=None
        if cfg.profiles is None
        else tuple(profiles_from_json([{k: v.model_dump() for k, v in p.items()} for p in cfg.profiles])),
    )


def trt_flavor(cfg: ModelConfig) -> str | None:
    """The TensorRT flavour a model asks for (None: any)."""
    return cfg.backend if cfg.backend in ("tensorrt", "tensorrt_rtx") else None
