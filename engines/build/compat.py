"""Does the stored engine fit this device and this configuration?

    result = check(store, "detector", settings, fingerprint)
    result.status   # "ok" | "rebuild" | "missing"
    result.reasons  # ["TensorRT 10.3.0 -> 10.7.0", "ONNX changed", "precision fp32 -> fp16", ...]
    result.key      # the key the configured build has; result.plan_path when ok

Which manifest is compared: the one whose key the configured build would have, when it exists
(so reverting a config or TensorRT version finds the previous engine again: rollback without a
rebuild); otherwise the newest manifest of the model. A plan whose sha256 differs is corrupt. A plan
TensorRT refused at load on this very device (build.refused_at_load, recorded by the daemon) needs a
rebuild too, whatever else fits: the fingerprint cannot tell every TensorRT patch apart.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engines.build.calibrator import DEFAULT_QUANTILE
from engines.errors import BuildError, ManifestError
from engines.fingerprint import DEVICE_FIELDS, Fingerprint
from engines.manifest import Manifest
from engines.settings import BuildSettings, onnx_input_shapes, profiles_to_json, resolve_profiles
from engines.store import EngineStore, sha256_file
from engines.trt import flavor_label

Status = Literal["ok", "rebuild", "missing"]
KEY_LEN = 16

_sha_memo: dict[tuple[str, int, int], str] = {}


def onnx_sha256(path: Path) -> str:
    """sha256 of the ONNX file, memoised on (path, size, mtime) for repeated checks."""
    try:
        st = path.stat()
    except OSError as e:
        raise BuildError(f"ONNX model {path} cannot be read: {e.strerror}") from e
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo not in _sha_memo:
        _sha_memo[memo] = sha256_file(path)
    return _sha_memo[memo]


@dataclass(frozen=True)
class BuildSpec:
    """Everything that decides an engine: the build's fingerprint plus its settings."""

    fingerprint: Fingerprint
    onnx_sha256: str
    precision: str
    profiles: list[dict[str, Any]]
    workspace_bytes: int
    optimization_level: int
    calibration: dict[str, Any] | None = None
    # Calibrated INT8 only: which layers stay out of INT8 (changes the engine, so part of the key).
    int8_layers: dict[str, Any] | None = None

    def key_material(self) -> dict[str, Any]:
        extra = {} if self.int8_layers is None else {"int8_layers": self.int8_layers}
        return {
            **extra,
            "fingerprint": self.fingerprint.key_fields(),
            "onnx_sha256": self.onnx_sha256,
            "precision": self.precision,
            "profiles": self.profiles,
            "workspace_bytes": self.workspace_bytes,
            "optimization_level": self.optimization_level,
            "calibration": self.calibration,
        }

    @property
    def key(self) -> str:
        blob = json.dumps(self.key_material(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:KEY_LEN]


def calibration_record(settings: BuildSettings) -> dict[str, Any] | None:
    """What the manifest's build.calibration must say for these settings (None unless int8).

    Q/DQ model: {method, samples, ..., cache_sha256 = sha256 of the Q/DQ file}, known before building.
    Calibrated: {method, samples, ...} now; the builder adds cache_sha256 of the calibration cache.
    """
    if settings.precision != "int8":
        return None
    cal = settings.calibration
    if cal is None:
        what = f"qdq_onnx {settings.qdq_onnx}" if settings.qdq_onnx else "the calibration set"
        raise BuildError(
            f"precision int8 of {settings.onnx} needs BuildSettings.calibration {{method, samples}} "
            f"(how the INT8 scales of {what} are made)"
        )
    record = {k: v for k, v in cal.items() if k != "cache_sha256"}
    if settings.qdq_onnx is not None:
        sha = onnx_sha256(settings.qdq_onnx)
        given = cal.get("cache_sha256")
        if given is not None and given != sha:
            raise BuildError(
                f"calibration.cache_sha256 {given} does not match qdq_onnx {settings.qdq_onnx} "
                f"(sha256 {sha}): the Q/DQ file changed after it was recorded"
            )
        record["cache_sha256"] = sha
    elif record["method"] == "percentile":
        record.setdefault("quantile", DEFAULT_QUANTILE)
    return record


def calibration_changed(recorded: dict[str, Any] | None, wanted: dict[str, Any] | None) -> bool:
    """Identity keys differ; cache_sha256 only counts where the wanted record knows it (Q/DQ file):
    a calibrator's cache hash is an output of the build, not part of what was asked for."""
    if recorded is None or wanted is None:
        return recorded != wanted

    def identity(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k != "cache_sha256"}

    if identity(recorded) != identity(wanted):
        return True
    return "cache_sha256" in wanted and recorded.get("cache_sha256") != wanted["cache_sha256"]


def build_spec(settings: BuildSettings, fingerprint: Fingerprint) -> BuildSpec:
    profiles = resolve_profiles(settings, onnx_input_shapes(settings.onnx))
    calibration = calibration_record(settings)
    int8_layers = None
    if settings.precision == "int8" and settings.qdq_onnx is None:
        int8_layers = {
            "keep": list(settings.int8_keep_layers),
            "as": settings.int8_keep_precision,
            "constraints": settings.precision_constraints,
        }
    return BuildSpec(
        fingerprint=fingerprint.for_build(settings.dla_core, settings.target_compute_capability),
        onnx_sha256=onnx_sha256(settings.onnx),
        precision=settings.precision,
        profiles=profiles_to_json(profiles),
        workspace_bytes=settings.workspace_bytes,
        optimization_level=settings.optimization_level,
        calibration=calibration,
        int8_layers=int8_layers,
    )


def _gpu(fp: dict[str, Any]) -> str:
    return f"{fp.get('gpu_name') or 'none'} ({fp.get('compute_capability')})"


def _device_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """SM count, memory, DLA cores (engines.fingerprint.DEVICE_FIELDS): what tells Orin modules apart."""
    if not any(name in old for name in DEVICE_FIELDS):
        return ["device details (SM count, memory, DLA cores) not recorded: the manifest predates them"]
    return [
        f"{name} {old.get(name)} -> {new.get(name)}"
        for name in DEVICE_FIELDS
        if old.get(name) != new.get(name)
    ]


def differences(manifest: Manifest, spec: BuildSpec) -> list[str]:
    """Human-readable reasons why `manifest` does not describe the build `spec` asks for."""
    old, new = manifest.fingerprint, spec.fingerprint.manifest_dict()
    b = manifest.build
    reasons = []
    if old["trt_flavor"] != new["trt_flavor"]:
        reasons.append(
            f"{flavor_label(old['trt_flavor'])} {old['trt_version']} -> "
            f"{flavor_label(new['trt_flavor'])} {new['trt_version']}"
        )
    elif old["trt_version"] != new["trt_version"]:
        reasons.append(f"{flavor_label(new['trt_flavor'])} {old['trt_version']} -> {new['trt_version']}")
    if (old["gpu_name"], old["compute_capability"]) != (new["gpu_name"], new["compute_capability"]):
        reasons.append(f"GPU {_gpu(old)} -> {_gpu(new)}")
    if old["l4t"] != new["l4t"]:
        reasons.append(f"L4T {old['l4t'] or 'none'} -> {new['l4t'] or 'none'}")
    if old["platform"] != new["platform"]:
        reasons.append(f"platform {old['platform']} -> {new['platform']}")
    if old["dla_core"] != new["dla_core"]:
        reasons.append(f"DLA core {old['dla_core']} -> {new['dla_core']}")
    reasons += _device_changes(old, new)
    if b.onnx_sha256 != spec.onnx_sha256:
        reasons.append("ONNX changed")
    if b.precision != spec.precision:
        reasons.append(f"precision {b.precision} -> {spec.precision}")
    if b.profiles != spec.profiles:
        reasons.append("profiles changed")
    if b.workspace_bytes != spec.workspace_bytes:
        reasons.append(f"workspace {b.workspace_bytes} -> {spec.workspace_bytes} bytes")
    if b.optimization_level != spec.optimization_level:
        reasons.append(f"optimization level {b.optimization_level} -> {spec.optimization_level}")
    # After a precision change the calibration differs by definition: one reason is enough.
    if b.precision == spec.precision and calibration_changed(b.calibration, spec.calibration):
        reasons.append("calibration changed")
    return reasons


def refusal_record(
    fingerprint: Fingerprint, error: str, plan_sha256: str, refusals: int = 1
) -> dict[str, Any]:
    """The manifest's build.refused_at_load: TensorRT refused plan `plan_sha256` at load on the device
    `fingerprint` (the live one, with the engine's DLA core) saying `error`; `refusals` counts the plans
    of this engine refused in a row (2: refused again after a rebuild)."""
    return {
        "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "error": error,
        "fingerprint": fingerprint.manifest_dict(),
        "plan_sha256": plan_sha256,
        "refusals": refusals,
    }


def refusals(manifest: Manifest, fingerprint: Fingerprint) -> int:
    """How many plans of this engine in a row TensorRT refused at load on this very device, going by
    `manifest`'s record of its plan: 0 when it has none, or one of another device (the record's
    fingerprint is the live one field for field: after a driver, CUDA or TensorRT update the plan gets
    another chance)."""
    record = manifest.build.refused_at_load
    if not isinstance(record, dict) or record.get("plan_sha256") != manifest.build.plan_sha256:
        return 0
    if record.get("fingerprint") != fingerprint.manifest_dict():
        return 0
    n = record.get("refusals")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def load_refusal(manifest: Manifest, fingerprint: Fingerprint) -> str | None:
    """Why `manifest`'s plan must be rebuilt although every recorded fact fits: TensorRT refused it at
    load on this device (`refusals`). None when it was not refused here."""
    n = refusals(manifest, fingerprint)
    if not n:
        return None
    in_a_row = f" ({n} plans in a row)" if n >= 2 else ""
    error = (manifest.build.refused_at_load or {}).get("error") or "no reason given"
    return f"TensorRT refused this plan at load{in_a_row}: {error}"


@dataclass(frozen=True)
class CheckResult:
    status: Status
    reasons: list[str]
    key: str
    manifest: Manifest | None = None  # the manifest compared (None when missing)
    plan_path: Path | None = None  # set when status == "ok"
    spec: BuildSpec | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def check(store: EngineStore, model: str, settings: BuildSettings, fingerprint: Fingerprint) -> CheckResult:
    """Compare the stored engine of `model` with the live fingerprint and configured settings.

    Raises BuildError when the ONNX model itself cannot be read (nothing to compare against).
    """
    spec = build_spec(settings, fingerprint)
    key = spec.key
    try:
        manifest = store.manifest(model, key)
    except ManifestError as e:
        return CheckResult("rebuild", [f"manifest invalid: {e}"], key, None, None, spec)
    if manifest is None:
        entries = store.entries(model)
        if not entries:
            problems = store.problems(model)
            if problems:
                return CheckResult(
                    "rebuild", [f"manifest invalid: {p}" for p in problems], key, None, None, spec
                )
            return CheckResult(
                "missing",
                [f"no engine for model {model!r} in {store.model_dir(model)}"],
                key,
                None,
                None,
                spec,
            )
        manifest = entries[0]
    reasons = differences(manifest, spec)
    if manifest.key == key:
        bad_plan = store.verify_plan(model, manifest)
        if bad_plan:
            reasons.append(bad_plan)
        refused = load_refusal(manifest, spec.fingerprint)
        if refused:
            reasons.append(refused)
    elif not reasons:
        # Same recorded facts under another key: key scheme or hidden settings changed.
        reasons.append(f"build settings changed (engine {manifest.key} -> {key})")
    if reasons:
        return CheckResult("rebuild", reasons, key, manifest, None, spec)
    return CheckResult("ok", [], key, manifest, store.plan_path_for(model, manifest), spec)
