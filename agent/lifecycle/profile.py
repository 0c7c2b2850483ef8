"""`edge-agent profile`: where the milliseconds of one inference go, layer by layer.

    edge-agent profile -c agent.yaml [--model M] [--precision P] [--iterations N] [--json]
                       [--top N] [--out DIR]

Where the model's TensorRT engine executes (a GPU), the stored engine of precision P is profiled with an
IProfiler, its layers described by the engine inspector (engines.runtimes.trt_layers). Everywhere else
ONNX Runtime profiles the graph (engines.runtimes.profiling): FP32, and for P = fp16/int8 also the very
FP16 / Q/DQ graph the accuracy gate measures (made from the calibration set as `rebuild` makes it,
captured first when there is none), side by side per source node and per op type. The engine's
layer-precision summary from its manifest is added where a fitting engine exists.

Writes `{out}/{model}.json` (schema edge-agent/profile/1), `{out}/{model}.png` (a bar chart; needs
matplotlib, otherwise one line says so) and ORT's raw traces `{out}/{model}-ort-{precision}.trace.json`
(chrome://tracing, Perfetto); prints the top-N table, or with --json the report itself.
Exit 0 done, 2 error (the message names the model and file).
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import AgentConfig, ConfigError
from agent.lifecycle.calibration import (
    CalibrationError,
    frames_to_capture,
    load_calibration_set,
    model_adapter,
    read_frames,
)
from agent.lifecycle.candidates import candidate_model
from agent.lifecycle.capture import capture_calibration_set
from agent.lifecycle.job import resolved_settings
from agent.lifecycle.model import ModelContext
from agent.lifecycle.serving import EngineTarget, engine_runs_here, engine_target
from engines.build.compat import check
from engines.errors import EngineError
from engines.precision import Built
from engines.runtimes.base import BackendError
from engines.runtimes.profiling import SCHEMA, ProfileRun, compare, profile_onnx
from engines.settings import onnx_input_shapes
from engines.store import EngineStore


def _precision(ctx: ModelContext, requested: Built | None) -> Built:
    # `best` tries int8 first: profile that candidate.
    p = requested or ctx.cfg.precision
    return "int8" if p == "best" else p


def _with_precision(ctx: ModelContext, precision: Built) -> ModelContext:
    return ModelContext(
        ctx.name, ctx.cfg.model_copy(update={"precision": precision}), ctx.engine_dir, ctx.score_threshold
    )


def _input(ctx: ModelContext) -> tuple[np.ndarray, str]:
    """One preprocessed frame: the first held-out frame of the calibration set, else zeros (convolution
    kernel times do not depend on pixel values)."""
    try:
        cset = load_calibration_set(ctx)
        path = cset.held_out_paths[0]
        batch, _ = model_adapter(ctx).preprocess(list(read_frames([path])))
        return batch, f"held-out frame {path}"
    except CalibrationError:
        dims = next(iter(onnx_input_shapes(ctx.cfg.onnx).values()))
        return np.zeros(tuple(d or 1 for d in dims), dtype=np.float32), "zeros (no calibration set)"


def _engine(ctx: ModelContext, target: EngineTarget) -> dict[str, Any]:
    """What `check` says about the model's engine for ctx's precision, with its manifest's layer summary."""
    settings, _gate, why = resolved_settings(ctx, target.api)
    if settings is None:
        return {"status": "rebuild", "reasons": [why], "key": None} | dict.fromkeys(
            ("precision", "profiling_verbosity", "layers")
        )
    result = check(EngineStore(ctx.engine_dir), ctx.name, settings, target.fingerprint)
    m = result.manifest if result.manifest is not None and result.manifest.key == result.key else None
    return {
        "status": result.status,
        "reasons": result.reasons,
        "key": result.key,
        "precision": None if m is None else m.build.precision,
        "profiling_verbosity": None if m is None else m.build.profiling_verbosity,
        "layers": None if m is None else m.build.layers,
    }


def _profile_engine(
    ctx: ModelContext, target: EngineTarget, key: str, batch: np.ndarray, n: int
) -> ProfileRun:
    from engines.runtimes.tensorrt import TensorRTBackend
    from engines.runtimes.trt_layers import profile_engine

    backend = TensorRTBackend(
        EngineStore(ctx.engine_dir), ctx.name, key, api=target.api, fingerprint=target.fingerprint, contexts=1
    )
    backend.load()
    try:
        return profile_engine(backend, batch, n)
    finally:
        backend.close()


def _ensure_frames(cfg: AgentConfig, ctx: ModelContext, precision: Built) -> None:
    """The FP16/Q-DQ graph lives in the calibration set's folder (INT8 is calibrated on it): capture one
    from the cameras when there is none, as `rebuild` does."""
    counts = frames_to_capture(ctx, calibration=precision == "int8")
    if counts is not None:
        print(f"{ctx.name}: capturing calibration frames for the {precision} graph", file=sys.stderr)
        capture_calibration_set(
            cfg, ctx.name, samples=counts[0], held_out=counts[1], progress=sys.stderr.isatty()
        )


def _ort_runs(ctx: ModelContext, precision: Built, n: int, out: Path, batch: np.ndarray) -> list[ProfileRun]:
    threads = ctx.cfg.threads
    trace = out / f"{ctx.name}-ort-fp32.trace.json"
    runs = [
        profile_onnx(
            ctx.cfg.onnx, batch, n, intra_threads=threads.intra, inter_threads=threads.inter, trace_out=trace
        )
    ]
    if precision == "fp32":
        return runs
    cand = candidate_model(ctx, precision, load_calibration_set(ctx))
    runs.append(
        profile_onnx(
            cand.onnx,
            batch,
            n,
            precision=precision,
            source_onnx=ctx.cfg.onnx,
            intra_threads=threads.intra,
            inter_threads=threads.inter,
            trace_out=out / f"{ctx.name}-ort-{precision}.trace.json",
        )
    )
    return runs


def profile_model(
    cfg: AgentConfig, ctx: ModelContext, precision: Built | None, iterations: int, out: Path
) -> dict[str, Any]:
    """The profile report of one model (see the module docstring); writes the traces under `out`.
    `precision`: parsed by the CLI (fp32, fp16 or int8); None: the model's."""
    prec = _precision(ctx, precision)
    ctx = _with_precision(ctx, prec)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    engine: dict[str, Any] | None = None
    target = engine_target(ctx)
    if isinstance(target, EngineTarget):
        engine = _engine(ctx, target)
    else:
        notes.append(target.note)
    on_engine = isinstance(target, EngineTarget) and engine_runs_here(target.fingerprint)
    if not on_engine and prec != "fp32":
        _ensure_frames(cfg, ctx, prec)
    batch, what = _input(ctx)
    if on_engine:
        assert isinstance(target, EngineTarget)
        if engine is None or engine["status"] != "ok":
            reasons = "; ".join(engine["reasons"]) if engine else "no engine"
            raise EngineError(
                f"model {ctx.name!r}: no fitting {prec} engine to profile ({reasons}): "
                f"run edge-agent rebuild --model {ctx.name} --precision {prec}"
            )
        runs = [_profile_engine(ctx, target, engine["key"], batch, iterations)]
    else:
        if isinstance(target, EngineTarget):
            notes.append(
                f"the {target.api.label} engine cannot execute here (no CUDA GPU): "
                "profiling the ONNX graph on ONNX Runtime"
            )
        runs = _ort_runs(ctx, prec, iterations, out, batch)
    return {
        "schema": SCHEMA,
        "model": ctx.name,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "iterations": iterations,
        "input": what,
        "runs": [r.to_json() for r in runs],
        "comparison": compare(runs[0], runs[1]) if len(runs) == 2 else None,
        "engine": engine,
        "notes": notes,
    }


# ---- output ---------------------------------------------------------------------------------------


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def _timed_how(run: dict[str, Any]) -> str:
    """TensorRT is timed without its profiler, the layers in a separate profiled run (trtexec's
    --separateProfileRun); ONNX Runtime's profiler runs in the timed runs."""
    separate = run.get("timing", {}).get("method") == "separate_profile_run"
    return ", without the profiler" if separate else ", profiler attached"


def format_report(report: dict[str, Any], top: int) -> str:
    lines = []
    for run in report["runs"]:
        runtime = f"{run['runtime']} {run['graph'].get('runtime_version', '')}"
        lines.append(
            f"{report['model']}: {runtime} {run['precision']}, {run['iterations']} runs: "
            f"{run['run_ms_p50']:.2f} ms per inference (p50{_timed_how(run)}), "
            f"layers {run['total_ms']:.2f} ms"
        )
        lines.append(f"  {'#':>3}  {'node (source ONNX node)':<48} {'op':<18} {'p50 ms':>8} {'share':>6}")
        for i, layer in enumerate(run["layers"][:top], 1):
            name = layer["source"] or layer["name"]
            op = layer["op_type"] + (f" {layer['precision']}" if layer.get("precision") else "")
            lines.append(
                f"  {i:>3}  {_short(name, 48):<48} {_short(op, 18):<18} {layer['p50_ms']:>8.3f} "
                f"{100 * layer['share']:>5.1f}%"
            )
    c = report["comparison"]
    if c:
        lines.append(
            f"{c['reference']} vs {c['candidate']}, per source node: {c['reference_total_ms']:.2f} -> "
            f"{c['candidate_total_ms']:.2f} ms ({_num(c['speedup'], '.2f', 'x')})"
        )
        lines.append(
            f"  {'node':<40} {c['reference'] + ' ms':>9} {c['candidate'] + ' ms':>9} {'speedup':>8}  ops"
        )
        for row in c["nodes"][:top]:
            ops = f"{row['reference_ops'] or '-'} -> {row['candidate_ops'] or '-'}"
            lines.append(
                f"  {_short(row['node'], 40):<40} {_num(row['reference_ms'], '.3f'):>9} "
                f"{_num(row['candidate_ms'], '.3f'):>9} {_num(row['speedup'], '.2f', 'x'):>8}  {ops}"
            )
    engine = report["engine"]
    if engine and engine.get("layers"):
        layers = engine["layers"]
        counts = ", ".join(f"{p} {n}" for p, n in layers["precisions"].items() if n)
        lines.append(
            f"engine {engine['key']}: {layers['total']} layers ({counts}; from the {layers['source']})"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: Path, top: int) -> str | None:
    """A horizontal bar chart of the top layers (side by side when comparing). None when written,
    else why not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no chart {path}: matplotlib is not installed (pip install matplotlib); the JSON has it all"
    c = report["comparison"]
    if c:
        rows = c["nodes"][:top]
        names = [_short(r["node"], 40) for r in rows]
        series = [
            (c["reference"], [r["reference_ms"] or 0.0 for r in rows]),
            (c["candidate"], [r["candidate_ms"] or 0.0 for r in rows]),
        ]
    else:
        run = report["runs"][0]
        rows = run["layers"][:top]
        names = [_short(r["source"] or r["name"], 40) for r in rows]
        series = [(run["precision"], [r["p50_ms"] for r in rows])]
    y = np.arange(len(names))
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(names) + 1.5))
    for i, (label, values) in enumerate(series):
        ax.barh(y + i * height, values, height, label=label)
    ax.set_yticks(y + height * (len(series) - 1) / 2, names)
    ax.invert_yaxis()
    ax.set_xlabel("p50 ms per inference")
    run = report["runs"][0]
    ax.set_title(f"{report['model']}: top {len(names)} layers, {run['runtime']}, {run['iterations']} runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def run_profile(
    cfg: AgentConfig,
    model: str | None,
    precision: Built | None,
    iterations: int,
    top: int,
    out: Path,
    as_json: bool,
) -> int:
    """`edge-agent profile`: 0 when every model was profiled, 2 on an error (printed)."""
    if model is not None and model not in cfg.models:
        print(
            f"edge-agent profile: --model {model!r}: not in the config "
            f"(known: {', '.join(sorted(cfg.models))})",
            file=sys.stderr,
        )
        return 2
    if iterations < 1 or top < 1:
        print("edge-agent profile: --iterations and --top must be >= 1", file=sys.stderr)
        return 2
    reports = []
    for name in [model] if model else sorted(cfg.models):
        try:
            ctx = ModelContext.from_config(cfg, name)
            report = profile_model(cfg, ctx, precision, iterations, out)
        except (CalibrationError, ConfigError, EngineError, BackendError, OSError) as e:
            print(f"edge-agent profile: {name}: {e}", file=sys.stderr)
            return 2
        (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        problem = write_png(report, out / f"{name}.png", top)
        if problem:
            print(problem, file=sys.stderr)
        reports.append(report)
        if not as_json:
            print(format_report(report, top))
            print(
                f"report: {out / (name + '.json')}" + ("" if problem else f", chart: {out / (name + '.png')}")
            )
    if as_json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 0
