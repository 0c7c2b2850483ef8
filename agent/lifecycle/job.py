"""Reduced-precision engines: calibration set -> accuracy gate -> build what passed -> validation recorded.

    settings, report, why = resolved_settings(cfg, "detector")    # None + why: the gate must run first
    result = run_job(cfg, "detector", "best", force=False, emit=print)

fp32 needs no gate. fp16, int8 and best run the gate (agent/precision_gate.py) on the held-out frames of
the model's calibration set (captured from its cameras when there is none yet) and build the first
precision that passes, from the requested one down (int8 -> fp16 -> fp32); the gate's result goes into
the engine manifest (`validation`) and the MQTT engine state. Strongly typed TensorRT (11, RTX) builds
INT8 from the Q/DQ ONNX the gate measured; weakly typed TensorRT (<= 10) from the same calibration
frames through its INT8 calibrator. The gate evaluates candidates on ONNX Runtime (the candidate ONNX
graphs); evaluating the built engine itself needs engine execution, which arrives with the multi-stream
work.

The daemon runs `python -m agent.precision_job -c CONFIG --model M` as a child process: it prints the
same JSON lines as engines.buildproc (progress events, then one result), so both are handled alike.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from agent import __version__
from agent.calibrate import (
    CalibrationError,
    CalibrationSet,
    calibration_batches,
    capture_calibration_set,
    load_calibration_set,
    model_adapter,
)
from agent.config import AgentConfig, ConfigError, load_config
from agent.engine_settings import build_settings, trt_flavor
from agent.precision_gate import candidate_model, manifest_validation, read_report, run_gate, write_report
from engines.builder import build
from engines.buildproc import BuildProcess, failure, json_lines_stdout, success
from engines.errors import EngineError
from engines.fingerprint import probe_fingerprint
from engines.runtimes.base import BackendError
from engines.runtimes.tensorrt import TensorRTBackend
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt_api import import_trt

log = logging.getLogger(__name__)
Event = dict[str, Any]
_REPO = str(Path(__file__).resolve().parent.parent)


def _settings_for(
    cfg: AgentConfig,
    model: str,
    precision: str,
    cset: CalibrationSet | None,
    method: str | None,
    weakly_typed: bool,
    fold: bool = False,
) -> BuildSettings:
    mcfg = cfg.models[model]
    settings = build_settings(mcfg, precision)
    if precision != "int8":
        return settings
    assert cset is not None
    method = method or mcfg.calibration.method
    record = {"method": method, "samples": len(cset.calibration_paths), "data_id": cset.id}
    if weakly_typed:
        return replace(settings, calibration=record)  # TensorRT's calibrator reads the same frames
    cand = candidate_model(cfg, model, "int8", cset, method, fold=fold)  # cached: the file the gate measured
    return replace(settings, qdq_onnx=cand.onnx, calibration=record)


def resolved_settings(
    cfg: AgentConfig, model: str, precision: str | None = None, weakly_typed: bool = False
) -> tuple[BuildSettings | None, dict[str, Any] | None, str]:
    """Build settings for `precision` (default: configured) as the last gate decided it.

    Returns (settings, gate report, ""), or (None, None, why) when the gate has to run first.
    """
    requested = precision or cfg.models[model].precision
    if requested == "fp32":
        return build_settings(cfg.models[model], "fp32"), None, ""
    try:
        cset = load_calibration_set(cfg, model)
    except CalibrationError:
        return (
            None,
            None,
            f"precision {requested} needs the accuracy gate, and there is no calibration set yet",
        )
    report = read_report(cfg, model, requested)
    if report is None or report.get("calibration_id") != cset.id:
        return None, None, f"precision {requested} not validated on the current calibration set yet"
    chosen = report["precision"] if report["passed"] else "fp32"
    settings = _settings_for(
        cfg, model, chosen, cset, report.get("method"), weakly_typed, bool(report.get("folded"))
    )
    return settings, report, ""


def validation_of(report: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `validation`, plus what it was measured with."""
    return {
        **manifest_validation(report),
        "mean_iou": report.get("mean_iou"),
        "precision": report["precision"],
        "requested": report["requested"],
        "runtime": "onnxruntime",
    }


ORDER = ("int8", "fp16", "fp32")


def engine_runs_here(fp: Any) -> bool:
    """Engines execute only on a GPU (a TensorRT-RTX AOT build on a CPU machine cannot run there)."""
    return bool(fp.has_gpu)


def _engine_gate(
    cfg: AgentConfig, model: str, precision: str, store: EngineStore, key: str, api: Any, fp: Any
) -> dict[str, Any] | None:
    """Gate the built engine itself where it executes (a GPU with TensorRT); None where it cannot run.

    Written to the TensorRT docs, not run here: no GPU with TensorRT is available to this project.
    """
    if not engine_runs_here(fp):
        return None
    engine = TensorRTBackend(store, model, key, api=api, fingerprint=fp)
    try:
        engine.load()
        shape = tuple(1 if d is None else d for d in engine.input_spec.shape)
        engine.infer(np.zeros(shape, dtype=engine.input_spec.dtype))
    except (BackendError, NotImplementedError) as exc:
        engine.close()
        log.warning(
            "model %s: engine %s not evaluated on this device (%s); the graph gate stands", model, key, exc
        )
        return None
    return run_gate(cfg, model, precision, factory=lambda _path, _prec: engine)


def run_job(
    cfg: AgentConfig, model: str, precision: str | None, force: bool, emit: Callable[[Event], None]
) -> Event:
    """Gate (when needed) and build; returns the result event (never raises for expected failures).

    From the precision the graph gate (ONNX Runtime) keeps, down to fp32: build it; where the engine
    executes here, gate the engine itself too; a precision whose build or engine gate fails gives way
    to the next one down, and every step is recorded in `tried`.
    """
    mcfg = cfg.models[model]
    requested = precision or mcfg.precision

    def progress(phase: str, step: int, total: int) -> None:
        emit({"event": "progress", "phase": phase, "step": step, "total": total})

    try:
        api = import_trt(trt_flavor(mcfg))
        fp = probe_fingerprint(api, target_compute_capability=mcfg.engine.target_compute_capability)
        store = EngineStore(cfg.engine_dir)
        common = {
            "fingerprint": fp,
            "api": api,
            "force": force,
            "on_progress": progress,
            "agent_version": __version__,
        }
        if requested == "fp32":
            result = build(store, model, build_settings(mcfg, "fp32"), **common)
            return _result_event(result, "fp32", requested, None, [])
        try:
            cset = load_calibration_set(cfg, model)
        except CalibrationError:
            progress("capture calibration set", 0, 1)
            cset = capture_calibration_set(cfg, model, progress=False)
        progress("accuracy gate", 0, 1)
        report = run_gate(cfg, model, requested)
        tried = list(report["tried"])
        first = report["precision"] if report["passed"] else "fp32"
        # (precision, folded Q/DQ graph); the folded INT8 variant is tried only where a strongly typed
        # TensorRT could not build the unfolded one (TensorRT-RTX 1.7 on tf2onnx graphs).
        steps = [(p, False) for p in ORDER[ORDER.index(first) :]]
        i = 0
        while i < len(steps):
            prec, fold = steps[i]
            i += 1
            if i > 1:  # a fallback: its graph must pass the gate too
                report = run_gate(cfg, model, prec, fold=fold)
                tried += [{**t, "folded": fold} if fold else t for t in report["tried"]]
                if not report["passed"]:
                    continue
            report["folded"] = fold
            settings = _settings_for(cfg, model, prec, cset, report.get("method"), api.weakly_typed, fold)
            batches = None
            if prec == "int8" and api.weakly_typed:
                batches = functools.partial(calibration_batches, cset, model_adapter(cfg, model))
            try:
                result = build(store, model, settings, calibration_batches=batches, **common)
            except EngineError as exc:
                if prec == "fp32":
                    raise
                variant = f"{prec}{' (folded)' if fold else ''}"
                log.warning(
                    "model %s: %s engine build failed (%s); trying the next step", model, variant, exc
                )
                tried.append(
                    {
                        "precision": prec,
                        "passed": False,
                        "folded": fold,
                        "reason": f"{variant}: engine build failed: {exc}",
                    }
                )
                if prec == "int8" and not fold and not api.weakly_typed:
                    steps.insert(i, ("int8", True))
                continue
            runtime = "onnxruntime"
            engine_report = _engine_gate(cfg, model, prec, store, result.key, api, fp)
            if engine_report is not None:
                runtime = "tensorrt"
                tried += [{**t, "runtime": "tensorrt"} for t in engine_report["tried"]]
                report = {**engine_report, "folded": fold}
                if not engine_report["passed"] and prec != "fp32":
                    continue
            break
        report = {**report, "requested": requested, "tried": tried, "runtime": runtime}
        write_report(cset, report)
        progress("accuracy gate", 1, 1)
        validation = {**validation_of(report), "runtime": runtime}
        with store.lock(model, wait_s=30):
            store.set_validation(model, result.key, validation)
    except (EngineError, CalibrationError, ConfigError, OSError, ValueError) as exc:
        return {**failure(f"model {model!r}: {exc}", type(exc).__name__), "requested": requested}
    return _result_event(result, prec, requested, validation, tried)


def _result_event(
    result: Any,
    precision: str,
    requested: str,
    validation: dict[str, Any] | None,
    tried: list[dict[str, Any]],
) -> Event:
    return success(result, precision=precision, requested=requested, validation=validation, tried=tried)


def start_precision_job(
    config: Path, model: str, precision: str | None, force: bool, on_event: Callable[[Event], None] | None
) -> BuildProcess:
    """The job as a child process (same protocol and handle as engines.buildproc)."""
    cmd = [sys.executable, "-m", "agent.precision_job", "-c", str(config), "--model", model]
    if precision:
        cmd += ["--precision", precision]
    if force:
        cmd.append("--force")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    return BuildProcess(proc, on_event)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.precision_job")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--precision")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    emit = json_lines_stdout()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("engines.trt").setLevel(logging.ERROR)

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        emit(failure(str(exc), "ConfigError"))
        return 2
    result = run_job(cfg, args.model, args.precision, args.force, emit)
    emit(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
