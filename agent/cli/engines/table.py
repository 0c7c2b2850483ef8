"""What `edge-agent engines list` and `show` print: one row per plan, the table, one manifest described."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from agent.cli.engines.store import model_in
from engines.manifest import BuildInfo, Manifest
from engines.store import EngineStore


def size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def mb(n: int | None) -> str:
    if n is None:
        return "missing"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def when(iso: str) -> str:
    try:
        t = _dt.datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if t.tzinfo is not None:
        t = t.astimezone(_dt.timezone.utc)
        return t.strftime("%Y-%m-%d %H:%M:%S UTC")
    return t.strftime("%Y-%m-%d %H:%M:%S")


def trt(fp: dict[str, Any]) -> str:
    from engines.trt import flavor_label

    return f"{flavor_label(fp.get('trt_flavor'))} {fp.get('trt_version')}"


def gpu(fp: dict[str, Any]) -> str:
    gpu = f"{fp.get('gpu_name') or 'none'} ({fp.get('compute_capability')})"
    return gpu + (f" DLA {fp['dla_core']}" if fp.get("dla_core") is not None else "")


def _row(
    model: str, key: str, state: str, m: Manifest, plan: Path, manifest: Path, newest: bool
) -> dict[str, Any]:
    fp, b = m.fingerprint, m.build
    v = m.validation or {}
    return {
        "model": model,
        "key": key,
        "state": state,
        "newest_key": newest,
        "precision": b.precision,
        "trt_flavor": fp.get("trt_flavor"),
        "trt_version": fp.get("trt_version"),
        "gpu_name": fp.get("gpu_name"),
        "compute_capability": fp.get("compute_capability"),
        "dla_core": fp.get("dla_core"),
        "size_bytes": size_of(plan),
        "built_at": b.built_at,
        "plan_sha256": b.plan_sha256,
        "validation": {k: v.get(k) for k in ("metric", "value", "threshold", "passed")} if v else None,
        "plan": str(plan),
        "manifest": str(manifest),
    }


# What a row is (STATES[state]): one key per model is current, and only where the configuration says so.
STATES = {
    "current": "the engine the model serves now (its configuration's key, fitting this device)",
    "rebuild": "its configuration's key, which no longer fits this device (`edge-agent check` says why)",
    "newest": "the model's most recent key (-c agent.yaml tells which key the model serves)",
    "kept": "another key (other settings, TensorRT or GPU), kept for a revert",
    "previous": "the plan a rebuild of that key replaced (`edge-agent engines rollback MODEL KEY`)",
}


def _state(key: str, newest: bool, configured: tuple[str, bool] | None, with_config: bool) -> str:
    if configured is not None and configured[0] == key:
        return "current" if configured[1] else "rebuild"
    return "newest" if newest and not with_config else "kept"


def rows(
    store: EngineStore,
    only: str | None = None,
    configured: dict[str, tuple[str, bool]] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per plan: every key's plan and its previous one; problems met on the way). `configured`
    (from -c: model -> (its configuration's key, fits)) decides the one current key; without it none is."""
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    models = [model_in(store, only)] if only else store.models()
    for model in models:
        problems += store.problems(model)
        mine = (configured or {}).get(model)
        for i, m in enumerate(store.entries(model)):
            assert m.key is not None and m.path is not None
            state = _state(m.key, i == 0, mine, configured is not None)
            out.append(_row(model, m.key, state, m, store.plan_path_for(model, m), m.path, i == 0))
            prev = store.previous(model, m.key)
            if prev is not None:
                out.append(_row(model, m.key, "previous", prev.manifest, prev.plan, prev.record, i == 0))
    return out, problems


def render(table: list[dict[str, Any]]) -> str:
    head = ("MODEL", "KEY", "STATE", "PRECISION", "TENSORRT", "GPU", "SIZE", "BUILT AT")
    lines = [
        (
            r["model"],
            r["key"],
            r["state"],
            str(r["precision"]),
            trt({"trt_flavor": r["trt_flavor"], "trt_version": r["trt_version"]}),
            gpu(r),
            mb(r["size_bytes"]),
            when(str(r["built_at"])),
        )
        for r in table
    ]
    widths = [max(len(c[i]) for c in [head, *lines]) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *lines]
    ]
    used = [s for s in STATES if any(r["state"] == s for r in table)]
    return "\n".join(text + [""] + [f"{s:<8}  {STATES[s]}" for s in used])


def describe(
    store: EngineStore, model: str, key: str, m: Manifest, plan: Path, state: str, record: Path
) -> str:
    fp, b = m.fingerprint, m.build
    bad = store.verify_plan(model, m, plan)
    lines = [
        f"{model} / {key} ({state})",
        f"  manifest    {record}",
        f"  plan        {plan} ({mb(size_of(plan))}, " + ("sha256 verified)" if bad is None else f"{bad})"),
        f"  built       {when(b.built_at)} in {b.build_s} s by edge-agent {b.agent_version}",
        f"  TensorRT    {trt(fp)} on GPU {gpu(fp)}, {fp.get('platform')}, CUDA driver "
        f"{fp.get('cuda_driver') or '-'}, runtime {fp.get('cuda_runtime') or '-'}"
        + (f", L4T {fp['l4t']}" if fp.get("l4t") else ""),
        f"  precision   {b.precision}"
        + (
            f" (calibration {b.calibration.get('method')}, {b.calibration.get('samples')} samples)"
            if b.calibration
            else ""
        ),
        f"  profiles    {_profiles(b)}",
        f"  workspace   {(b.workspace_bytes or 0) >> 20} MiB, optimization level {b.optimization_level}",
    ]
    layers = b.layers
    if layers:
        counts = ", ".join(f"{p} {n}" for p, n in layers["precisions"].items() if n)
        lines.append(f"  layers      {layers['total']} ({counts})")
    v = m.validation
    if v:
        verdict = "passed" if v.get("passed") else "failed"
        lines.append(
            f"  validation  {v.get('metric')} {v.get('value')} (threshold {v.get('threshold')}) {verdict}, "
            f"{v.get('frames')} frames, {v.get('runtime', 'onnxruntime')}"
        )
    refused = b.refused_at_load
    if refused:
        lines.append(f"  refused     at load {when(str(refused.get('at')))}: {refused.get('error')}")
    return "\n".join(lines)


def _dims(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def _profiles(b: BuildInfo) -> str:
    """One context's profile set ("input 1x3x416x416..1x3x416x416") and how many contexts carry it."""
    profiles = b.profiles
    per = b.profiles_per_context or len(profiles) or 1
    one = "; ".join(
        ", ".join(f"{name} {_dims(s['min'])}..{_dims(s['max'])}" for name, s in p.items())
        for p in profiles[:per]
    )
    contexts = len(profiles) // per
    return one + (f" (x{contexts} execution contexts)" if contexts > 1 else "")
