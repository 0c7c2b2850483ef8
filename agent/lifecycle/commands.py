"""`edge-agent check` and `edge-agent rebuild`: the on-device engine commands.

check: exit 0 when every TensorRT model has a fitting engine, 1 when one needs a rebuild (or is missing),
2 on errors (no TensorRT, unreadable ONNX, unusable engine_dir).
rebuild: builds under the per-model lock (a running daemon picks the new engine up by itself).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from agent import __version__
from agent.config import AgentConfig, ModelConfig
from agent.engine_settings import build_settings, trt_flavor
from agent.precision_job import resolved_settings
from engines.builder import build
from engines.compat import check
from engines.errors import BuildLockedError, EngineError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.store import EngineStore
from engines.trt_api import TrtApi, import_trt


class _Skip(Exception):
    """This model does not use a TensorRT engine here (the reason is the message)."""


def _engine_target(name: str, cfg: ModelConfig) -> tuple[TrtApi, Fingerprint]:
    if cfg.backend == "onnxruntime":
        raise _Skip("backend onnxruntime: no engine")
    try:
        api = import_trt(trt_flavor(cfg))
    except EngineError as exc:
        if cfg.backend == "auto":
            raise _Skip(f"no TensorRT here ({exc}): ONNX Runtime serves") from None
        raise
    fp = probe_fingerprint(api, target_compute_capability=cfg.engine.target_compute_capability)
    if cfg.backend == "auto" and not fp.has_gpu:
        raise _Skip("backend auto and no CUDA GPU visible: ONNX Runtime serves")
    return api, fp


def _selected(cfg: AgentConfig, model: str | None) -> dict[str, ModelConfig]:
    if model is None:
        return dict(cfg.models)
    if model not in cfg.models:
        raise EngineError(f"--model {model!r}: not in the config (known: {', '.join(sorted(cfg.models))})")
    return {model: cfg.models[model]}


def run_check(cfg: AgentConfig, model: str | None, as_json: bool) -> int:
    report: dict[str, Any] = {}
    worst = 0
    for name, mcfg in _selected(cfg, model).items():
        try:
            api, fp = _engine_target(name, mcfg)
            settings, gate, why = resolved_settings(cfg, name, None, api.weakly_typed)
            entry = {"device": fp.describe(), "fingerprint": fp.manifest_dict()}
            if settings is None:
                entry.update(status="rebuild", reasons=[why], key=None)
            else:
                result = check(EngineStore(cfg.engine_dir), name, settings, fp)
                entry.update(status=result.status, reasons=result.reasons, key=result.key)
                if gate is not None:
                    entry["validation"] = {
                        k: gate.get(k) for k in ("precision", "value", "threshold", "passed")
                    }
            worst = max(worst, 0 if entry["status"] == "ok" else 1)
        except _Skip as why:
            entry = {"status": "ok", "reasons": [], "key": None, "note": str(why)}
        except EngineError as exc:
            entry = {"status": "error", "reasons": [str(exc)], "key": None}
            worst = 2
        report[name] = entry
    if as_json:
        print(json.dumps({"status": ("ok", "rebuild", "error")[worst], "models": report}, indent=2))
    else:
        for name, e in report.items():
            extra = e.get("note") or e.get("device") or ""
            print(f"{name}: {e['status']}" + (f" ({extra})" if extra else ""))
            for reason in e["reasons"]:
                print(f"  - {reason}")
    return worst


class _Progress:
    """A tqdm bar on stderr that follows the builder's phases (parse, TensorRT's own, serialize, save)."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=1,
            desc=f"{name}: start",
            file=sys.stderr,
            leave=False,
            bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
        )
        self._name = name
        self._phase = ""
        self._shown = 0.0

    def __call__(self, phase: str, step: int, total: int) -> None:
        new_phase = phase != self._phase
        self._phase = phase
        self._bar.set_description_str(f"{self._name}: {phase}", refresh=False)
        self._bar.total = max(1, total)
        self._bar.n = min(step, self._bar.total)
        now = time.monotonic()
        if new_phase or now - self._shown >= 0.1:  # TensorRT reports hundreds of steps a second
            self._shown = now
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def run_rebuild(
    cfg: AgentConfig, model: str | None, force: bool, precision: str | None, wait_s: float
) -> int:
    rc = 0
    for name, mcfg in _selected(cfg, model).items():
        try:
            api, fp = _engine_target(name, mcfg)
        except _Skip as why:
            print(f"{name}: skipped ({why})")
            continue
        except EngineError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            rc = 2
            continue
        if not fp.has_gpu and not logging.getLogger().isEnabledFor(logging.INFO):
            # An ahead-of-time build without a GPU logs CUDA "driver insufficient" errors that do not
            # affect the plan; real build failures still arrive as BuildError with TensorRT's messages.
            logging.getLogger("engines.trt").setLevel(logging.CRITICAL)
        progress = _Progress(name)
        requested = precision or mcfg.precision
        if requested != "fp32":
            rc = max(rc, _rebuild_gated(cfg, name, requested, force, progress))
            continue
        try:
            result = build(
                EngineStore(cfg.engine_dir),
                name,
                build_settings(mcfg, precision),
                fingerprint=fp,
                api=api,
                force=force,
                on_progress=progress,
                agent_version=__version__,
                lock_wait_s=wait_s,
            )
        except BuildLockedError as exc:
            progress.close()
            print(f"{name}: {exc}", file=sys.stderr)
            rc = 2
            continue
        except EngineError as exc:
            progress.close()
            print(f"{name}: build failed: {exc}", file=sys.stderr)
            rc = 2
            continue
        progress.close()
        if result.built:
            why = f" ({'; '.join(result.reasons)})" if result.reasons else ""
            print(f"{name}: built engine {result.key} in {result.build_s:.1f} s -> {result.plan_path}{why}")
        else:
            print(f"{name}: {result.message}")
    return rc


def _rebuild_gated(cfg: AgentConfig, name: str, requested: str, force: bool, progress: _Progress) -> int:
    """fp16 / int8 / best: accuracy gate first, then the build of what passed (agent/precision_job.py)."""
    from agent.precision_job import run_job

    result = run_job(cfg, name, requested, force, lambda ev: progress(ev["phase"], ev["step"], ev["total"]))
    progress.close()
    if not result["ok"]:
        print(f"{name}: {result['error']}", file=sys.stderr)
        return 2
    for t in result["tried"]:
        verdict = "passed" if t.get("passed") else f"failed: {t.get('reason')}"
        what = t["precision"] + (f"/{t['method']}" if t.get("method") else "")
        what += " (folded graph)" if t.get("folded") else ""
        what += " [engine]" if t.get("runtime") == "tensorrt" else ""
        print(f"{name}: gate {what} {verdict}")
    v = result["validation"] or {}
    what = (
        f"built engine {result['key']} in {result['build_s']:.1f} s" if result["built"] else result["message"]
    )
    gate = f"map50 {v.get('value')}, threshold {v.get('threshold')}"
    print(f"{name}: {requested} -> {result['precision']} ({gate}): {what}")
    return 0
