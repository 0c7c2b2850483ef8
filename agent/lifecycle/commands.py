"""The on-device engine commands: `edge-agent check`, `rebuild`, `calibrate`, `validate`.

check: exit 0 when every TensorRT model has a fitting engine, 1 when one needs a rebuild (or is missing),
2 on errors (no TensorRT, unreadable ONNX, unusable engine_dir). Read-only: never quantises or converts.
rebuild: takes the model's build lock (`--wait` seconds for it; refused at once naming the holder's pid,
start and command otherwise), captures the frames the gate needs when there are none (from the cameras:
no daemon pipeline here), then runs the same child job as the daemon, handing it the lock: one rebuild
per model at a time over the whole job, gate and build. With `engines.cache` a plain rebuild of an engine
that does not fit pulls the cache's engine of the key instead of building (as the daemon does; a miss:
built here, and pushed); `--force` always builds here and never pulls (an operator who forces a rebuild
wants this machine's build, e.g. after a plan the cache holds misbehaved). A running daemon picks the new
engine up by itself. Progress (agent.lifecycle.progress) goes to stderr: a bar on a terminal, a few lines
piped. The job is the daemon's walk (agent.lifecycle.runner) with the CLI's frames and words.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from agent.config import AgentConfig, ConfigError
from agent.lifecycle.cache_setup import CacheSetup
from agent.lifecycle.calibration import CalibrationError, frames_to_capture, load_calibration_set
from agent.lifecycle.capture import capture_calibration_set
from agent.lifecycle.gate import run_gate
from agent.lifecycle.gate_report import format_report, write_report
from agent.lifecycle.job import JobResult, resolved_settings
from agent.lifecycle.model import ModelContext
from agent.lifecycle.progress import JobProgress
from agent.lifecycle.runner import Emit, JobRunner, LockUnavailable
from agent.lifecycle.serving import EngineTarget, engine_target
from engines.build.compat import check
from engines.buildproc import Event
from engines.errors import EngineError
from engines.precision import Precision
from engines.runtimes.base import BackendError
from engines.store import EngineStore


def _selected(cfg: AgentConfig, model: str | None) -> list[ModelContext]:
    if model is not None and model not in cfg.models:
        raise EngineError(f"--model {model!r}: not in the config (known: {', '.join(sorted(cfg.models))})")
    return [ModelContext.from_config(cfg, n) for n in ([model] if model else list(cfg.models))]


def onnx_readable(ctx: ModelContext) -> None:
    """EngineError naming the path when the model's ONNX file cannot be read: whatever serves it (ONNX
    Runtime or an engine built from it) would fail at start, so `check` must not say ok."""
    path = Path(ctx.cfg.onnx)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise EngineError(f"models.{ctx.name}.onnx: {path} does not exist") from None
    except OSError as e:
        raise EngineError(f"models.{ctx.name}.onnx: {path} cannot be read: {e.strerror or e}") from None


def run_check(cfg: AgentConfig, model: str | None, as_json: bool) -> int:
    report: dict[str, Any] = {}
    worst = 0
    for ctx in _selected(cfg, model):
        try:
            onnx_readable(ctx)
            target = engine_target(ctx)
            if not isinstance(target, EngineTarget):
                report[ctx.name] = {"status": "ok", "reasons": [], "key": None, "note": target.note}
                continue
            fp = target.fingerprint
            settings, gate, why = resolved_settings(ctx, target.api)
            entry: dict[str, Any] = {"device": fp.describe(), "fingerprint": fp.manifest_dict()}
            if settings is None:
                entry.update(status="rebuild", reasons=[why], key=None)
            else:
                result = check(EngineStore(cfg.engine_dir), ctx.name, settings, fp)
                entry.update(status=result.status, reasons=result.reasons, key=result.key)
                m = result.manifest
                if m is not None and m.key == result.key:  # this configuration's engine (fitting or not)
                    entry["layers"] = m.build.layers  # None: absent from manifests of older builds
                if gate is not None:
                    entry["validation"] = gate.state()
            worst = max(worst, 0 if entry["status"] == "ok" else 1)
        except (EngineError, ConfigError) as exc:
            entry = {"status": "error", "reasons": [str(exc)], "key": None}
            worst = 2
        report[ctx.name] = entry
    if as_json:
        print(json.dumps({"status": ("ok", "rebuild", "error")[worst], "models": report}, indent=2))
    else:
        for name, e in report.items():
            extra = e.get("note") or e.get("device") or ""
            print(f"{name}: {e['status']}" + (f" ({extra})" if extra else ""))
            for reason in e["reasons"]:
                print(f"  - {reason}")
            if e.get("layers"):
                counts = ", ".join(f"{p} {n}" for p, n in e["layers"]["precisions"].items() if n)
                print(f"  layers: {e['layers']['total']} ({counts})")
    return worst


def configured_keys(cfg: AgentConfig) -> tuple[dict[str, tuple[str, bool]], list[str]]:
    """({model: (the engine key its configuration asks for on this device, whether that stored engine fits
    and so serves)}, why a model has none): what `engines list -c` marks current. Models ONNX Runtime
    serves have no key. Reads only (the store is not created or marked)."""
    keys: dict[str, tuple[str, bool]] = {}
    notes: list[str] = []
    store = EngineStore(cfg.engine_dir, check_writable=False)
    for ctx in _selected(cfg, None):
        try:
            target = engine_target(ctx)
            if not isinstance(target, EngineTarget):
                notes.append(f"{ctx.name}: {target.note}")
                continue
            settings, _gate, why = resolved_settings(ctx, target.api)
            if settings is None:
                notes.append(f"{ctx.name}: {why}")
                continue
            result = check(store, ctx.name, settings, target.fingerprint)
            keys[ctx.name] = (result.key, result.ok)
        except (EngineError, ConfigError) as exc:
            notes.append(f"{ctx.name}: {exc}")
    return keys, notes


class CameraFrames:
    """The CLI's frames for a job (no daemon pipeline here): captured from the cameras or the folder."""

    def __init__(self, cfg: AgentConfig) -> None:
        self._cfg = cfg

    def ensure(self, ctx: ModelContext, calibration: bool, on_event: Emit) -> None:
        counts = frames_to_capture(ctx, calibration)
        if counts is None:
            return
        what = "calibration + held-out" if calibration else "held-out (gate)"
        print(f"{ctx.name}: capturing {what} frames", file=sys.stderr)
        t0 = time.monotonic()
        cset = capture_calibration_set(
            self._cfg, ctx.name, samples=counts[0], held_out=counts[1], progress=sys.stderr.isatty()
        )
        m = cset.manifest
        print(
            f"{ctx.name}: captured {m['samples']} calibration + {m['held_out_count']} held-out frames "
            f"in {time.monotonic() - t0:.1f} s -> {cset.directory}",
            file=sys.stderr,
        )


class _Progress:
    """JobProgress from the job's first event on: the capture above prints its own lines first."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._progress: JobProgress | None = None

    def __call__(self, ev: Event) -> None:
        if self._progress is None:
            self._progress = JobProgress(self._name)
        self._progress(ev)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()


def run_rebuild(
    cfg: AgentConfig, model: str | None, force: bool, precision: Precision | None, wait_s: float
) -> int:
    def waiting(name: str, holder: str) -> None:
        print(f"{name}: waiting up to {wait_s:g} s for another build ({holder})", file=sys.stderr)

    # The whole job under the model's lock: frames, gate, build (the child inherits it); with the fleet's
    # engine cache (engines.cache) in front of it as in the daemon: a plain rebuild pulls a fitting engine
    # the cache holds (one build per key for the fleet), `--force` builds here and never pulls.
    shared = CacheSetup(lambda: cfg)
    runner = JobRunner(
        lambda: EngineStore(cfg.engine_dir),
        CameraFrames(cfg),
        lock_wait_s=wait_s,
        on_wait=waiting,
        shared=shared,
    )
    if cfg.engines.cache is not None:  # its lines (a pull, a wait for another device's build) are news here
        said = logging.getLogger("agent.lifecycle.manager")
        said.setLevel(min(said.getEffectiveLevel(), logging.INFO))
    try:
        return _rebuild_each(cfg, runner, model, force, precision)
    finally:
        shared.close()  # the build claims still held, released


def _rebuild_each(
    cfg: AgentConfig, runner: JobRunner, model: str | None, force: bool, precision: Precision | None
) -> int:
    rc = 0
    for ctx in _selected(cfg, model):
        try:
            target = engine_target(ctx)
        except ConfigError as exc:
            print(f"{ctx.name}: error: {exc}", file=sys.stderr)
            rc = 2
            continue
        if not isinstance(target, EngineTarget):
            print(f"{ctx.name}: skipped ({target.note})")
            continue
        requested = precision or ctx.cfg.precision
        progress = _Progress(ctx.name)
        try:
            result = runner.run(ctx, target.api, requested, force, progress, None, target.fingerprint)
        except LockUnavailable as exc:  # held by another build (or it cannot be taken)
            print(f"{ctx.name}: {exc.error}", file=sys.stderr)
            rc = 2
            continue
        except (CalibrationError, ConfigError, EngineError, OSError) as exc:  # capturing the frames
            print(f"{ctx.name}: {exc}", file=sys.stderr)
            rc = 2
            continue
        finally:
            progress.close()
        rc = max(rc, _print_result(ctx.name, requested, result))
    return rc


def _print_result(name: str, requested: Precision, result: JobResult) -> int:
    if not result.ok:
        print(f"{name}: {result.error}", file=sys.stderr)
        return 2
    for t in result.tried:
        what = t["precision"] + (f"/{t['method']}" if t.get("method") else "")
        what += " (folded graph)" if t.get("folded") else ""
        what += " [engine]" if t.get("runtime") == "tensorrt" else ""
        verdict = "passed" if t.get("passed") else f"failed: {t.get('reason')}"
        print(f"{name}: gate {what} {verdict}")
    what = (
        f"built engine {result.key} in {result.build_s:.1f} s -> {result.plan}"
        if result.built
        else result.message
    )
    why = f" ({'; '.join(result.reasons)})" if result.built and result.reasons else ""
    v = result.validation
    gate = f" (map50 {v.get('value')}, threshold {v.get('threshold')})" if v else ""
    print(f"{name}: {requested} -> {result.precision}{gate}: {what}{why}")
    return 0


def run_calibrate(
    cfg: AgentConfig,
    model: str | None,
    folder: Path | None,
    samples: int | None,
    held_out: int | None,
    interval_s: float | None = None,
) -> int:
    """`edge-agent calibrate`: 0 when every set was stored, 2 on an error (printed, naming the source)."""
    names = [model] if model else sorted(cfg.models)
    for name in names:
        try:
            cset = capture_calibration_set(
                cfg, name, folder, samples, held_out, interval_s, progress=sys.stderr.isatty()
            )
        except (CalibrationError, ConfigError, OSError) as e:
            print(f"edge-agent calibrate: {e}", file=sys.stderr)
            return 2
        m = cset.manifest
        where = m["folder"] if m["source"] == "folder" else "cameras " + ", ".join(m["cameras"])
        print(
            f"{name}: {m['samples']} calibration + {m['held_out_count']} held-out frames "
            f"from {where} -> {cset.directory}"
        )
    return 0


def run_validate(
    cfg: AgentConfig, model: str | None, precision: Precision | None, method: str | None, as_json: bool
) -> int:
    """`edge-agent validate`: exit 0 when every gate passed, 1 when one failed, 2 on an error."""
    outputs: list[dict[str, Any]] = []
    failed = False
    try:
        contexts = _selected(cfg, model)
    except EngineError as e:
        print(f"edge-agent validate: {e}", file=sys.stderr)
        return 2
    for ctx in contexts:
        try:
            report = run_gate(ctx, precision, method=method)
            path = write_report(load_calibration_set(ctx), report)
        except (CalibrationError, ConfigError, EngineError, BackendError, OSError) as e:
            print(f"edge-agent validate: {e}", file=sys.stderr)
            return 2
        failed |= not report.passed
        obj = {**report.validation(), "model": ctx.name, "method": report.method}
        obj["tried"] = [vars(t) for t in report.tried]
        outputs.append(obj)
        if not as_json:
            print(format_report(ctx.name, report))
            print(f"  report: {path}")
    if as_json:
        print(json.dumps(outputs[0] if len(outputs) == 1 else outputs, indent=2))
    return 1 if failed else 0
