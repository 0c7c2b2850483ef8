"""One model as the engine lifecycle sees it: its resolved config, where its engines live, the score
threshold its cameras publish at, and the resolved model (pipelines.models.ModelSpec: served ONNX, labels,
input, host or graph decoding). Made from the agent config once (daemon start, CLI command) and handed to
the precision job as JSON, so the child never reads the YAML again.

    ctx = ModelContext.from_config(cfg, "detector")
    ctx.build_settings("fp16")            # engines.settings.BuildSettings
    ctx.spec.adapter()                    # the inference adapter, host or graph decoding decided once
    ModelContext.from_json(ctx.to_json()) == ctx
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from agent.config import AgentConfig, ConfigError, ModelConfig
from engines.settings import BuildSettings, profiles_from_json
from pipelines.models import GraftParams, ModelSpec, SpecError, resolve_onnx
from pipelines.models.registry import adapter_class
from pipelines.postprocess import load_labels

DEFAULT_SCORE_THRESHOLD = 0.4  # the camera default min_score


def model_labels(name: str, mcfg: ModelConfig) -> tuple[str, ...]:
    """The model's class names: the one place a model's label file is read. ConfigError naming the key."""
    if mcfg.labels is None:
        raise ConfigError(f"models.{name}.labels: required to know the class count of {mcfg.onnx}")
    try:
        return tuple(load_labels(mcfg.labels))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"models.{name}.labels: {e}") from None


def graft_params(mcfg: ModelConfig) -> GraftParams:
    """What `postprocess: graph` grafts: the config's thresholds, the format's max detections."""
    return GraftParams(
        mcfg.graph_score_threshold, mcfg.iou_threshold, max_det=adapter_class(mcfg.format).max_det
    )


def resolve_spec(name: str, mcfg: ModelConfig, engine_dir: Path | None = None) -> ModelSpec:
    """The model resolved from its config: labels read, the ONNX's input and graft record read, and for
    `postprocess: graph` the ONNX grafted into `engine_dir` (agent.lifecycle.graft; reused once made).
    An ONNX that is grafted already is served as it is; `postprocess: graph` then checks its record."""
    labels = model_labels(name, mcfg)
    try:
        spec = resolve_onnx(name, Path(mcfg.onnx), mcfg.format, labels)
    except SpecError as e:
        raise ConfigError(f"models.{name}.{e.key}: {e}") from None
    if mcfg.postprocess != "graph":
        return spec
    params = graft_params(mcfg)
    if spec.postprocess == "graph":
        if spec.graft is not None and spec.graft != params:
            raise ConfigError(
                f"models.{name}.postprocess: graph: {spec.onnx} was grafted with {spec.graft.tag}, the "
                f"config asks for {params.tag} (graph_score_threshold, iou_threshold; or name its source)"
            )
        return spec
    if engine_dir is None:
        raise ConfigError(f"models.{name}.postprocess: graph: no engine_dir to keep the grafted graph in")
    from agent.lifecycle.graft import grafted_onnx  # onnx graph building: only for postprocess: graph

    return spec.grafted_as(grafted_onnx(spec, params, engine_dir), params)


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
        score = min(scores, default=DEFAULT_SCORE_THRESHOLD)
        if mcfg.postprocess != "graph":
            return cls(name, mcfg, Path(cfg.engine_dir), score)
        # From here on the grafted graph is the model (agent.lifecycle.graft), for every step and the child.
        spec = resolve_spec(name, mcfg, Path(cfg.engine_dir))
        ctx = cls(name, mcfg.model_copy(update={"onnx": spec.onnx}), Path(cfg.engine_dir), score)
        ctx.__dict__["spec"] = spec  # resolved once: the cached_property's value
        return ctx

    @cached_property
    def spec(self) -> ModelSpec:
        """The resolved model (labels, input, served ONNX, decoding), read on first use."""
        return resolve_spec(self.name, self.cfg, self.engine_dir)

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
