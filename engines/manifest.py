"""The engine manifest (`{key}.json` next to `{key}.plan`), schema "edge-agent/engine-manifest/1".

    m = load_manifest(path)        # ManifestError naming the path and the field on any problem
    m.fingerprint["trt_version"], m.build.precision, m.build.plan_sha256, m.to_json()

Fields are exactly DESIGN.md's "Engine store and manifest". `validation` is null until the
precision issue adds the accuracy gate. Fields added later (OPTIONAL_BUILD_SPEC: the profiling verbosity
and the layer-precision summary) are checked where present: manifests written before them still load.
`build` is a BuildInfo: typed attributes, written back with the keys (and key order) it was read with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engines.build.layer_info import check_summary
from engines.errors import ManifestError
from engines.precision import Built

SCHEMA = "edge-agent/engine-manifest/1"

_INT = (int,)
_STR = (str,)
_NUM = (int, float)
# field -> (accepted types, nullable)
FINGERPRINT_SPEC: dict[str, tuple[tuple[type, ...], bool]] = {
    "trt_flavor": (_STR, False),
    "trt_version": (_STR, False),
    "gpu_name": (_STR, True),
    "compute_capability": (_STR, True),
    "cuda_driver": (_STR, True),
    "cuda_runtime": (_STR, True),
    "l4t": (_STR, True),
    "dla_core": (_INT, True),
    "platform": (_STR, False),
}
# Written since issue 35 (engines.fingerprint.DEVICE_FIELDS); absent from older manifests, which still load.
OPTIONAL_FINGERPRINT_SPEC: dict[str, tuple[tuple[type, ...], bool]] = {
    "sm_count": (_INT, True),
    "memory_gib": (_INT, True),
    "dla_cores": (_INT, False),
}
BUILD_SPEC: dict[str, tuple[tuple[type, ...], bool]] = {
    "onnx_sha256": (_STR, False),
    "precision": (_STR, False),
    "profiles": ((list,), False),
    "workspace_bytes": (_INT, True),
    "optimization_level": (_INT, True),
    "calibration": ((dict,), True),
    "timing_cache": ((dict,), True),
    "built_at": (_STR, False),
    "build_s": (_NUM, False),
    "agent_version": (_STR, False),
    "plan_sha256": (_STR, False),
}
# Written by every build since the profiling issue; absent from older manifests.
OPTIONAL_BUILD_SPEC: dict[str, tuple[tuple[type, ...], bool]] = {
    "profiling_verbosity": (_STR, True),  # "detailed", or null where TensorRT has no such setting
    "layers": ((dict,), True),  # {total, precisions {FP32, FP16, INT8, ...}, source}, null if unseen
    "profiles_per_context": (_INT, False),  # size of the profile set each execution context owns
    "tf32": ((bool,), True),  # fp32 builds: false = TF32 disallowed; null = not applicable / no such flag
    "int8": ((dict,), True),  # {batches_fed, cache_read, calibrated_graph, kept_layers, int8_layers}
    "dla": ((dict,), True),  # {core, layers_on_dla, layers_on_gpu}
    # Set by the daemon when TensorRT refused this plan at load: {at, error, fingerprint, plan_sha256,
    # refusals} (engines.build.compat.refusal_record); a rebuild writes a manifest without it.
    "refused_at_load": ((dict,), True),
    # Built on a Jetson (issue 35): {nvpmodel {name, id}, clocks_locked, clocks} (engines.build.power).
    "jetson": ((dict,), True),
    # The compatibility key the build was made for (engines.build.compat.BuildSpec.key; the file's name in
    # the store): a manifest pulled from the shared engine cache must record the tag it was found under.
    "key": (_STR, False),
}


@dataclass(frozen=True)
class BuildInfo:
    """The manifest's `build` object (fields: BUILD_SPEC, then OPTIONAL_BUILD_SPEC)."""

    onnx_sha256: str
    precision: Built
    profiles: list[dict[str, Any]]
    workspace_bytes: int | None
    optimization_level: int | None
    calibration: dict[str, Any] | None
    timing_cache: dict[str, Any] | None
    built_at: str
    build_s: float
    agent_version: str
    plan_sha256: str
    # Absent from older manifests (None here, and not written back where it was absent).
    profiling_verbosity: str | None = None
    layers: dict[str, Any] | None = None
    profiles_per_context: int | None = None
    tf32: bool | None = None
    int8: dict[str, Any] | None = None
    dla: dict[str, Any] | None = None
    refused_at_load: dict[str, Any] | None = None
    jetson: dict[str, Any] | None = None
    key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know: kept as read
    key_order: tuple[str, ...] = ()  # the JSON keys as read: written back in that order

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BuildInfo:
        """From a checked `build` object (manifest_from_dict checks it; a builder writes it whole)."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        extra = {k: v for k, v in d.items() if k not in _FIELDS}
        return cls(**known, extra=extra, key_order=tuple(d))

    def without(self, name: str) -> BuildInfo:
        """A copy with the optional field `name` absent (cleared, and not written)."""
        if name not in OPTIONAL_BUILD_SPEC:
            raise ValueError(f"build.{name} is not an optional field")
        changes: dict[str, Any] = {name: None, "key_order": tuple(k for k in self.key_order if k != name)}
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the keys as read, then any field set since (required ones always)."""
        out = {k: self.extra[k] if k in self.extra else getattr(self, k) for k in self.key_order}
        for name in _FIELDS:
            if name not in out and (name in BUILD_SPEC or getattr(self, name) is not None):
                out[name] = getattr(self, name)
        return out


_FIELDS = tuple(f.name for f in fields(BuildInfo) if f.name not in ("extra", "key_order"))


@dataclass(frozen=True)
class Manifest:
    fingerprint: dict[str, Any]
    build: BuildInfo
    validation: dict[str, Any] | None = None
    path: Path | None = None

    @property
    def key(self) -> str | None:
        return self.path.stem if self.path else None

    @property
    def recorded_key(self) -> str | None:
        """The key written into the manifest by its build (None: built before builds recorded it)."""
        return self.build.key

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "fingerprint": self.fingerprint,
            "build": self.build.to_dict(),
            "validation": self.validation,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


def _check(
    where: str,
    obj: Any,
    spec: dict[str, tuple[tuple[type, ...], bool]],
    prefix: str,
    optional: bool = False,
) -> None:
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest {where}: field {prefix!r} must be an object, got {type(obj).__name__}")
    for name, (types, nullable) in spec.items():
        field = f"{prefix}.{name}"
        if name not in obj:
            if optional:
                continue
            raise ManifestError(f"manifest {where}: field {field!r} is missing")
        value = obj[name]
        if value is None:
            if not nullable:
                raise ManifestError(f"manifest {where}: field {field!r} must not be null")
            continue
        # bool is an int subclass: never accept it where a number is meant.
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = "/".join(t.__name__ for t in types)
            raise ManifestError(f"manifest {where}: field {field!r} must be {want}, got {value!r}")


def _check_profiles(where: str, profiles: list[Any]) -> None:
    for i, p in enumerate(profiles):
        if not isinstance(p, dict) or not p:
            raise ManifestError(f"manifest {where}: field 'build.profiles[{i}]' must be a non-empty object")
        for name, s in p.items():
            for which in ("min", "opt", "max"):
                v = s.get(which) if isinstance(s, dict) else None
                if not isinstance(v, list) or not all(isinstance(d, int) for d in v):
                    raise ManifestError(
                        f"manifest {where}: field 'build.profiles[{i}].{name}.{which}' must be a list of ints"
                    )


def manifest_from_dict(data: Any, where: str | Path = "<memory>", path: Path | None = None) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"manifest {where}: top level must be a JSON object")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ManifestError(f"manifest {where}: field 'schema' is {schema!r}, expected {SCHEMA!r}")
    _check(str(where), data.get("fingerprint"), FINGERPRINT_SPEC, "fingerprint")
    _check(str(where), data["fingerprint"], OPTIONAL_FINGERPRINT_SPEC, "fingerprint", optional=True)
    _check(str(where), data.get("build"), BUILD_SPEC, "build")
    _check(str(where), data["build"], OPTIONAL_BUILD_SPEC, "build", optional=True)
    _check_profiles(str(where), data["build"]["profiles"])
    layers = data["build"].get("layers")
    problem = None if layers is None else check_summary(layers)
    if problem:
        raise ManifestError(f"manifest {where}: field 'build.layers' {problem}")
    validation = data.get("validation")
    if validation is not None and not isinstance(validation, dict):
        raise ManifestError(f"manifest {where}: field 'validation' must be an object or null")
    return Manifest(data["fingerprint"], BuildInfo.from_dict(data["build"]), validation, path)


def load_manifest(path: Path) -> Manifest:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ManifestError(f"manifest {path}: cannot read: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {path}: not valid JSON: {e}") from e
    except (ValueError, RecursionError):  # not UTF-8, nested too deep, an integer of 4300+ digits
        raise ManifestError(f"manifest {path}: not valid JSON (UTF-8)") from None
    return manifest_from_dict(data, path, path)
