"""Build settings (from the model config) and optimisation profiles resolved against the ONNX inputs.

    settings = BuildSettings(onnx=Path("model.onnx"), precision="fp16", batch=(1, 1, 1))
    profiles = resolve_profiles(settings, onnx_input_shapes(settings.onnx))   # [{input: Shapes(...)}]

Profiles: explicit `profiles` win; otherwise one profile per input from the ONNX shape with the batch
dim from `batch` (min, opt, max). A fixed ONNX dim is fixed in the profile too (TensorRT requires it):
NanoDet's batch of 1 gives min = opt = max = (1, 3, 416, 416) whatever `batch` says.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from engines.errors import BuildError
from engines.precision import Precision, parse_precision

log = logging.getLogger("engines.settings")

Shape = tuple[int, ...]
DEFAULT_WORKSPACE = 1 << 30
CALIBRATION_METHODS = ("entropy", "minmax", "percentile")
# Layers kept out of INT8 on weakly typed TensorRT (calibrated INT8), matched against TensorRT layer names
# with re.search. "@first_conv" (the stem sees raw pixels), "@head" (the last conv of each output path and
# the reshapes/activations after it) are structural selectors: detector layer names vary by exporter.
DEFAULT_INT8_KEEP_LAYERS: tuple[str, ...] = ("@first_conv", "@head", r"(?i)sigmoid|softmax")


@dataclass(frozen=True)
class Shapes:
    min: Shape
    opt: Shape
    max: Shape

    def as_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


Profile = dict[str, Shapes]


@dataclass(frozen=True)
class BuildSettings:
    """How to build one model's engine. `target_compute_capability` is the TensorRT-RTX AOT target
    used only where no GPU is visible (None: fingerprint.DEFAULT_TARGET_CC)."""

    onnx: Path
    precision: Precision = "fp32"  # parsed where it entered (config, CLI, from_request)
    batch: tuple[int, int, int] = (1, 1, 1)
    profiles: tuple[Profile, ...] | None = None
    workspace_bytes: int = DEFAULT_WORKSPACE
    optimization_level: int = 3
    dla_core: int | None = None
    target_compute_capability: str | None = None
    # --- INT8 (used only when precision == "int8"; ignored otherwise so fp32/fp16 keys never change) ---
    # {method: entropy|minmax|percentile, samples: int, [quantile], [any identity key, e.g. data_id],
    #  [cache_sha256]}: every key but cache_sha256 identifies the calibration (engine key + cache reuse).
    calibration: dict[str, Any] | None = None
    # A Q/DQ (explicitly quantised) copy of `onnx`, made by the caller (engines.build.quantize): the INT8
    # route on strongly typed TensorRT (11, RTX); also honoured by weakly typed TensorRT (no calibrator then).
    qdq_onnx: Path | None = None
    # Calibration batches for builds in a child process: a .npy file (N, C, H, W) float32, or a
    # directory of such files (sorted by name). In-process callers may pass batches to build() instead.
    calibration_data: Path | None = None
    int8_keep_layers: tuple[str, ...] = DEFAULT_INT8_KEEP_LAYERS
    int8_keep_precision: str = "fp16"  # fp16 | fp32: what the kept layers run in
    precision_constraints: str = "prefer"  # prefer | obey (obey fails the build if no kernel fits)
    # Execution contexts the runtime runs concurrently (models.M.streams): TensorRT wants one optimisation
    # profile per concurrent context, so the profile set is built once per context.
    contexts: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "onnx", Path(self.onnx))
        for name in ("qdq_onnx", "calibration_data"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "int8_keep_layers", tuple(self.int8_keep_layers))
        if self.int8_keep_precision not in ("fp16", "fp32"):
            raise ValueError(f"int8_keep_precision must be fp16 or fp32, got {self.int8_keep_precision!r}")
        if self.precision_constraints not in ("prefer", "obey"):
            raise ValueError(
                f"precision_constraints must be prefer or obey, got {self.precision_constraints!r}"
            )
        for pattern in self.int8_keep_layers:
            if not pattern.startswith("@"):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"int8_keep_layers: {pattern!r} is not a regular expression: {e}") from e
        if self.calibration is not None:
            _check_calibration(self.calibration)
        bmin, bopt, bmax = self.batch
        if not 1 <= bmin <= bopt <= bmax:
            raise ValueError(f"batch must satisfy 1 <= min <= opt <= max, got {self.batch}")
        if self.contexts < 1:
            raise ValueError(f"contexts must be >= 1, got {self.contexts}")
        if not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level must be 0..5, got {self.optimization_level}")

    def to_request(self) -> dict[str, Any]:
        """JSON form (for the build child process)."""
        return {
            "onnx": str(self.onnx),
            "precision": self.precision,
            "batch": list(self.batch),
            "profiles": None
            if self.profiles is None
            else [{name: s.as_dict() for name, s in p.items()} for p in self.profiles],
            "workspace_bytes": self.workspace_bytes,
            "optimization_level": self.optimization_level,
            "dla_core": self.dla_core,
            "target_compute_capability": self.target_compute_capability,
            "calibration": self.calibration,
            "qdq_onnx": None if self.qdq_onnx is None else str(self.qdq_onnx),
            "calibration_data": None if self.calibration_data is None else str(self.calibration_data),
            "int8_keep_layers": list(self.int8_keep_layers),
            "int8_keep_precision": self.int8_keep_precision,
            "precision_constraints": self.precision_constraints,
            "contexts": self.contexts,
        }

    @classmethod
    def from_request(cls, d: dict[str, Any]) -> BuildSettings:
        profiles = d.get("profiles")
        return cls(
            onnx=Path(d["onnx"]),
            precision=parse_precision(d.get("precision", "fp32"), "build request: precision"),
            batch=tuple(d.get("batch", (1, 1, 1))),
            profiles=None if profiles is None else tuple(profiles_from_json(profiles)),
            workspace_bytes=int(d.get("workspace_bytes", DEFAULT_WORKSPACE)),
            optimization_level=int(d.get("optimization_level", 3)),
            dla_core=d.get("dla_core"),
            target_compute_capability=d.get("target_compute_capability"),
            calibration=d.get("calibration"),
            qdq_onnx=d.get("qdq_onnx"),
            calibration_data=d.get("calibration_data"),
            int8_keep_layers=tuple(d.get("int8_keep_layers", DEFAULT_INT8_KEEP_LAYERS)),
            int8_keep_precision=d.get("int8_keep_precision", "fp16"),
            precision_constraints=d.get("precision_constraints", "prefer"),
            contexts=int(d.get("contexts", 1)),
        )


def _check_calibration(cal: Any) -> None:
    """ValueError naming the calibration field that is wrong."""
    if not isinstance(cal, dict):
        raise ValueError(f"calibration must be a mapping {{method, samples}}, got {cal!r}")
    method = cal.get("method")
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"calibration.method {method!r} is not one of {list(CALIBRATION_METHODS)}")
    samples = cal.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"calibration.samples must be a positive integer, got {samples!r}")
    quantile = cal.get("quantile")
    if quantile is not None and not (isinstance(quantile, float) and 0.0 < quantile <= 1.0):
        raise ValueError(f"calibration.quantile must be a float in (0, 1], got {quantile!r}")


def profiles_from_json(items: list[dict[str, Any]]) -> list[Profile]:
    return [
        {name: Shapes(tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])) for name, s in p.items()}
        for p in items
    ]


def profiles_to_json(profiles: list[Profile]) -> list[dict[str, Any]]:
    return [{name: s.as_dict() for name, s in p.items()} for p in profiles]


def onnx_input_shapes(path: Path) -> dict[str, tuple[int | None, ...]]:
    """Graph inputs (initializers excluded) and their dims; None for symbolic/unknown dims."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError as e:
        raise BuildError(f"ONNX model {path} does not exist") from e
    except Exception as e:  # protobuf DecodeError and friends
        raise BuildError(f"cannot read ONNX model {path}: not a valid ONNX file (truncated?): {e}") from e
    inits = {i.name for i in model.graph.initializer}
    shapes: dict[str, tuple[int | None, ...]] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        shapes[inp.name] = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims
        )
    return shapes


def resolve_profiles(settings: BuildSettings, inputs: dict[str, tuple[int | None, ...]]) -> list[Profile]:
    """The engine's profiles: the profile set (explicit, or derived from the ONNX shapes and `batch`) once
    per execution context, context i owning profiles [i * n, (i + 1) * n)."""
    return _profile_set(settings, inputs) * settings.contexts


def _profile_set(settings: BuildSettings, inputs: dict[str, tuple[int | None, ...]]) -> list[Profile]:
    if settings.profiles is not None:
        return [_check_profile(p, inputs, i) for i, p in enumerate(settings.profiles)]
    profile: Profile = {}
    for name, dims in inputs.items():
        if not dims:
            raise BuildError(f"input {name!r} has no shape in the ONNX model; give explicit profiles")
        rest = dims[1:]
        if any(d is None for d in rest):
            raise BuildError(
                f"input {name!r} has dynamic non-batch dims {dims}; give explicit profiles (min/opt/max)"
            )
        fixed_rest = tuple(int(d) for d in rest)  # type: ignore[arg-type]
        if dims[0] is None:
            bmin, bopt, bmax = settings.batch
        else:
            if settings.batch != (dims[0],) * 3 and settings.batch != (1, 1, 1):
                log.warning(
                    "input %r has a fixed batch of %d: batch %s does not apply", name, dims[0], settings.batch
                )
            bmin = bopt = bmax = int(dims[0])
        profile[name] = Shapes((bmin, *fixed_rest), (bopt, *fixed_rest), (bmax, *fixed_rest))
    return [profile]


def _check_profile(profile: Profile, inputs: dict[str, tuple[int | None, ...]], index: int) -> Profile:
    unknown = set(profile) - set(inputs)
    if unknown:
        raise BuildError(f"profile {index}: inputs {sorted(unknown)} are not ONNX inputs {sorted(inputs)}")
    missing = set(inputs) - set(profile)
    if missing:
        raise BuildError(f"profile {index}: no shapes for ONNX inputs {sorted(missing)}")
    for name, s in profile.items():
        dims = inputs[name]
        for which in ("min", "opt", "max"):
            shape = getattr(s, which)
            if len(shape) != len(dims):
                raise BuildError(
                    f"profile {index}: input {name!r} {which} {list(shape)} has rank "
                    f"{len(shape)}, the ONNX input has rank {len(dims)}"
                )
            for axis, (want, got) in enumerate(zip(dims, shape, strict=True)):
                if want is not None and want != got:
                    raise BuildError(
                        f"profile {index}: input {name!r} {which} dim {axis} is {got} but "
                        f"the ONNX model fixes it at {want}"
                    )
        if not all(a <= b <= c for a, b, c in zip(s.min, s.opt, s.max, strict=True)):
            raise BuildError(f"profile {index}: input {name!r} needs min <= opt <= max, got {s}")
    return profile
