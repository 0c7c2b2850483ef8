"""`pipeline`: shards, their GPUs and restart backoff."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.strict import StrictModel


class RestartConfig(StrictModel):
    min_s: float = Field(1.0, gt=0, le=60)
    max_s: float = Field(30.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _order(self) -> RestartConfig:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s {self.min_s:g} is above max_s {self.max_s:g}")
        return self


class PipelineConfig(StrictModel):
    """Pipeline shards (agent.shards): 1 is one process; N > 1 a supervisor over N worker processes, each a
    whole pipeline for some of the cameras; auto sizes from the cameras' frame rates, GPUs and cores."""

    shards: int | Literal["auto"] = 1
    gpus: list[int] | None = Field(None, max_length=64)  # shard k on GPU gpus[k % len]; None: as CUDA sees it
    restart: RestartConfig = RestartConfig()  # backoff between restarts of a shard that died

    @field_validator("shards", mode="before")
    @classmethod
    def _shards(cls, v: Any) -> Any:
        if isinstance(v, bool) or not (v == "auto" or (isinstance(v, int) and 1 <= v <= 64)):
            raise ValueError(f"must be 'auto' or an integer 1..64, got {v!r}")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("must list at least one GPU index (or be left out)")
            if min(v) < 0 or len(set(v)) != len(v):
                raise ValueError(f"GPU indices must be >= 0 and distinct, got {v}")
        return v
