"""Engines in a store without a build: a `fake_tensorrt` plan and a manifest that
`engines.build.compat.check` accepts for the given settings (what engines.build.builder would write), for
tests of loading and of the daemon's engine lifecycle that must not depend on the builder.

    m = store_engine(store, "det", settings, fp, plan=fake_tensorrt.PLAN_MAGIC + b"1", profiles_per_context=1)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from typing import Any

import fake_tensorrt

from engines.build.compat import build_spec
from engines.fingerprint import Fingerprint
from engines.manifest import BuildInfo, Manifest
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

_MISSING = object()


def gpu_fp(api: TrtApi, gpu: str | None = "Orin", cc: str = "8.7") -> Fingerprint:
    return Fingerprint(api.flavor, api.version, gpu, cc, "12.6", "12.6", "R36.4.0", None, "linux-aarch64")


def store_engine(
    store: EngineStore,
    model: str,
    settings: BuildSettings,
    fp: Fingerprint,
    plan: bytes = fake_tensorrt.PLAN_MAGIC,
    profiles_per_context: Any = _MISSING,
    lock: bool = True,
    **build: Any,
) -> Manifest:
    """Store `plan` as the engine `settings` ask for on `fp`. profiles_per_context: the builder's
    (profiles / contexts) unless given; None leaves the field out (an engine built before it existed).
    lock: take the model's build lock (False: the caller holds it, as a job child whose parent handed
    it down)."""
    spec = build_spec(settings, fp)
    per_context = (
        len(spec.profiles) // settings.contexts if profiles_per_context is _MISSING else profiles_per_context
    )
    record: dict[str, Any] = {
        "onnx_sha256": spec.onnx_sha256,
        "precision": spec.precision,
        "profiles": spec.profiles,
        "workspace_bytes": spec.workspace_bytes,
        "optimization_level": spec.optimization_level,
        "calibration": spec.calibration,
        "timing_cache": None,
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "build_s": 0.01,
        "agent_version": "test",
        "plan_sha256": hashlib.sha256(plan).hexdigest(),
        "profiling_verbosity": "detailed",
        **({} if per_context is None else {"profiles_per_context": per_context}),
        **build,
    }
    manifest = Manifest(spec.fingerprint.manifest_dict(), BuildInfo.from_dict(record))
    if not lock:
        return store.write(model, spec.key, plan, manifest)
    with store.lock(model):
        return store.write(model, spec.key, plan, manifest)
