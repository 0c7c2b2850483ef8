"""`models.<name>`: the ONNX, how it is built (backend, precision, batch, profiles, engine) and served, and
what a DLA cannot run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agent.config.strict import ConfigPath, StrictModel
from engines.precision import Precision
from pipelines.models.registry import formats


class BatchConfig(StrictModel):
    min: int = Field(1, ge=1, le=256)
    opt: int = Field(1, ge=1, le=256)
    max: int = Field(1, ge=1, le=256)

    @model_validator(mode="after")
    def _ordered(self) -> BatchConfig:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"must satisfy min <= opt <= max (got {self.min}, {self.opt}, {self.max})")
        return self


class CalibrationConfig(StrictModel):
    source: Literal["cameras", "folder"] = "cameras"
    folder: ConfigPath | None = None
    samples: int = Field(500, gt=0, le=100_000)
    # minmax by default: measured best on the bundled detector (docs/BENCHMARKS.md, precision table).
    method: Literal["entropy", "minmax", "percentile"] = "minmax"
    # At most one frame per camera per interval, so the frames span minutes of scene change.
    interval_s: float = Field(1.0, gt=0, le=86400)


class AccuracyGateConfig(StrictModel):
    min_agreement: float = Field(0.9, ge=0.0, le=1.0)


class ThreadsConfig(StrictModel):
    intra: int = Field(0, ge=0, le=256, description="ONNX Runtime intra-op threads (0 = its default)")
    inter: int = Field(0, ge=0, le=256)


class EngineConfig(StrictModel):
    workspace_mb: int = Field(1024, gt=0, le=1 << 20, description="TensorRT builder workspace limit")
    optimization_level: int = Field(3, ge=0, le=5)
    dla_core: int | None = Field(None, ge=0, le=15, description="Jetson DLA core (GPU fallback on)")
    target_compute_capability: str | None = Field(
        None, pattern=r"^\d+\.\d+$", description="TensorRT-RTX ahead-of-time target where no GPU is visible"
    )


MAX_DIM = 1 << 16  # one dimension of a profile shape (TensorRT's are int32; a frame side is <= 16384)


class ProfileShapes(StrictModel):
    min: list[int] = Field(max_length=8)
    opt: list[int] = Field(max_length=8)
    max: list[int] = Field(max_length=8, description=f"each dimension 1..{MAX_DIM}, at most 8 of them")

    @model_validator(mode="after")
    def _ordered(self) -> ProfileShapes:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError("min, opt and max must have the same rank")
        if any(d > MAX_DIM for d in self.max):
            raise ValueError(f"each dimension must be <= {MAX_DIM}")
        if any(not 1 <= a <= b <= c for a, b, c in zip(self.min, self.opt, self.max, strict=True)):
            raise ValueError("each dimension must satisfy 1 <= min <= opt <= max")
        return self


class ModelConfig(StrictModel):
    onnx: ConfigPath
    format: Literal[formats()] = "yolov8"  # the registry's names (pipelines.models.registry)
    labels: ConfigPath | None = None
    backend: Literal["auto", "tensorrt", "tensorrt_rtx", "onnxruntime"] = "auto"
    precision: Precision = "fp16"
    batch: BatchConfig = BatchConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    accuracy_gate: AccuracyGateConfig = AccuracyGateConfig()
    iou_threshold: float = Field(0.5, gt=0.0, le=1.0)
    threads: ThreadsConfig = ThreadsConfig()
    # TensorRT execution contexts, each with its own CUDA stream, optimisation profile and buffers.
    streams: int = Field(2, ge=1, le=16)
    engine: EngineConfig = EngineConfig()
    # Explicit TensorRT optimisation profiles, one mapping {input name: {min, opt, max}} each; without
    # them one profile is derived from the ONNX shapes and `batch`.
    profiles: list[dict[str, ProfileShapes]] | None = Field(None, max_length=32)
    # Frames older than this when the scheduler takes them are dropped unprocessed and counted per camera
    # (telemetry `dropped_stale`); 0 never drops. A frame waiting in a camera's slot is its newest, so
    # this catches stalls (a camera or the pipeline), not steady overload.
    max_age_ms: float = Field(500.0, ge=0, le=3_600_000, description="at most an hour")
    # gpu: letterbox + normalise with a CUDA kernel straight into the engine's input (needs cuda-python
    # and a backend that takes device input: TensorRT; while ONNX Runtime serves, the CPU does it).
    preprocess: Literal["cpu", "gpu"] = "cpu"
    # graph: decode + score threshold + NMS grafted onto the ONNX before anything is built or served
    # (pipelines.models.graft), so the engine returns detections (a few KB per frame) instead of raw heads;
    # the grafted part stays FP32 whatever the precision (engines.build.islands).
    # A prebuilt engine: the manifest `<key>.json` of a store (e.g. `edge-agent build --out DIR`: DIR/<model>/
    # <key>.json, its plan beside it). Imported into engine_dir at start, then checked as any engine is: a
    # plan that does not fit this device or these settings is refused with the reasons and rebuilt.
    engine_file: ConfigPath | None = None
    postprocess: Literal["host", "graph"] = "host"
    # The grafted graph's score threshold: a constant of the graph (changing it rebuilds the engine); the
    # model's cameras need min_score >= it.
    graph_score_threshold: float = Field(0.25, gt=0.0, lt=1.0)


def dla_problems(name: str, m: ModelConfig) -> list[str]:
    """What a DLA cannot run, refused at load naming the key (NVIDIA's DLA docs: FP16 and INT8 only,
    static shapes only, TensorRT on Jetson/Drive only); the builder refuses the same for other callers."""
    core = m.engine.dla_core
    if core is None:
        return []
    key = f"models.{name}.engine.dla_core"
    problems: list[str] = []
    if m.backend in ("onnxruntime", "tensorrt_rtx"):
        problems.append(f"{key}: DLA needs backend tensorrt or auto (TensorRT on a Jetson), not {m.backend}")
    if m.precision == "fp32":
        problems.append(
            f"{key}: DLA runs FP16 and INT8 only; precision fp32 cannot use it (fp16, int8 or best)"
        )
    if not m.batch.min == m.batch.opt == m.batch.max:
        problems.append(
            f"{key}: DLA needs static shapes, but models.{name}.batch ranges {m.batch.min}..{m.batch.max} "
            "(set min = opt = max)"
        )
    for i, profile in enumerate(m.profiles or []):
        for tensor, shapes in profile.items():
            if not shapes.min == shapes.opt == shapes.max:
                problems.append(
                    f"{key}: DLA needs static shapes, but models.{name}.profiles[{i}].{tensor} has "
                    "min/opt/max that differ"
                )
    return problems
