"""Build settings (from the model config) and optimisation profiles resolved against the ONNX inputs.

    settings = BuildSettings(onnx=Path("model.onnx"), precision="fp16", batch=(1, 1, 1))
    profiles = resolve_profiles(settings, onnx_input_shapes(settings.onnx))   # [{input: Shapes(...)}]

Profiles: explicit `profiles` win; otherwise one profile per input from the ONNX shape with the batch
dim from `batch` (min, opt, max). A fixed ONNX dim is fixed in the profile too (TensorRT requires it):
NanoDet's batch of 1 gives min = opt = max = (1, 3, 416, 416) whatever `batch` says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from engines.errors import BuildError

log = logging.getLogger("engines.settings")

Shape = tuple[int, ...]
DEFAULT_WORKSPACE = 1 << 30
PRECISIONS = ("fp32", "fp16", "int8", "best")


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
    precision: str = "fp32"
    batch: tuple[int, int, int] = (1, 1, 1)
    profiles: tuple[Profile, ...] | None = None
    workspace_bytes: int = DEFAULT_WORKSPACE
    optimization_level: int = 3
    dla_core: int | None = None
    target_compute_capability: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "onnx", Path(self.onnx))
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {list(PRECISIONS)}")
        bmin, bopt, bmax = self.batch
        if not 1 <= bmin <= bopt <= bmax:
            raise ValueError(f"batch must satisfy 1 <= min <= opt <= max, got {self.batch}")
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
        }

    @classmethod
    def from_request(cls, d: dict[str, Any]) -> BuildSettings:
        profiles = d.get("profiles")
        return cls(
            onnx=Path(d["onnx"]),
            precision=d.get("precision", "fp32"),
            batch=tuple(d.get("batch", (1, 1, 1))),  # type: ignore[arg-type]
            profiles=None if profiles is None else tuple(profiles_from_json(profiles)),
            workspace_bytes=int(d.get("workspace_bytes", DEFAULT_WORKSPACE)),
            optimization_level=int(d.get("optimization_level", 3)),
            dla_core=d.get("dla_core"),
            target_compute_capability=d.get("target_compute_capability"),
        )


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
