"""Engine commands without agent.yaml: `edge-agent build`, `edge-agent engines list|show|rollback|prune`.

    edge-agent build --onnx M [--precision fp32|fp16|int8|best] [--shapes NAME:DIMS[/OPT/MAX]] [--calib DIR]
                     [--out DIR] [--backend tensorrt|tensorrt_rtx]          (agent.lifecycle.standalone)
    edge-agent engines list     [--dir DIR | -c agent.yaml] [--model M] [--json]
    edge-agent engines show     MODEL [KEY] [--previous] [--json]
    edge-agent engines rollback MODEL [KEY] [--wait S]
    edge-agent engines prune    [--model M] [--key K] [--dry-run] [--wait S]

The store is `--dir DIR`, or the `engine_dir` of `-c agent.yaml`, or ./engines (where `build` puts
engines by default). Every bad input is one line naming the path: a store that does not exist, a
directory that is no engine store, an unknown model or key, nothing to roll back to. rollback and prune
write under the model's build lock (`--wait S` for it; refused at once, naming the holder, otherwise).
A running daemon's engine watcher notices a rollback (the key's manifest is replaced) and swaps the
plan in when that key is the engine its configuration asks for.
Exit codes: 0 done, 2 usage or store error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import argtypes
from agent.config import EngineConfig, ModelConfig
from engines.errors import EngineError, StoreError
from engines.manifest import Manifest
from engines.store import EngineStore

DEFAULT_DIR = Path("engines")
# The daemon's defaults (models.M.streams, models.M.engine.workspace_mb): a build here gets a config's key.
DEFAULT_STREAMS: int = ModelConfig.model_fields["streams"].default
DEFAULT_WORKSPACE_MB: int = EngineConfig.model_fields["workspace_mb"].default
PRECISIONS = ("fp32", "fp16", "int8", "best")


class EngineCliError(EngineError):
    """One line for the user, naming the path or value at fault."""


# ---- arguments --------------------------------------------------------------------------------------


def _wait_seconds(text: str) -> float:
    """argparse type: seconds to wait for the model's build lock, 0..86400 (finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not a number of seconds") from None
    if not (math.isfinite(value) and 0 <= value <= 86400):
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds, 0 to 86400")
    return abs(value)


_whole = argtypes.whole


def _add_store_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--dir", help=f"the engine store (default: ./{DEFAULT_DIR})")
    where.add_argument("-c", "--config", help="use this agent.yaml's engine_dir")


def _add_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=_wait_seconds,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the model's build lock (default: refuse at once, naming the holder)",
    )


def add_parsers(sub: Any, log_levels: list[str]) -> None:
    """Register `build` and `engines` on the CLI's subparsers."""
    b = sub.add_parser(
        "build",
        help="build an engine from an ONNX file, no agent.yaml needed (trtexec-like), into an engine store",
        description="Build a TensorRT / TensorRT-RTX engine from ONNX into {out}/{model}/ with the daemon's "
        "manifest and layout (the daemon's defaults for what is not given). No accuracy gate: best keeps "
        "the first of int8 -> fp16 -> fp32 that builds.",
    )
    b.add_argument("--onnx", required=True, metavar="M", help="the ONNX model")
    b.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    b.add_argument(
        "--shapes",
        metavar="SPEC",
        help="input shapes: NAME:1x3x416x416 (static) or NAME:MIN/OPT/MAX, comma-separated per input "
        "(default: from the ONNX, batch 1)",
    )
    b.add_argument(
        "--calib",
        metavar="DIR",
        help="calibration data for int8: .npy tensors (preprocessed NCHW float32) or images (with --format)",
    )
    b.add_argument("--calib-method", choices=["entropy", "minmax", "percentile"], default="minmax")
    b.add_argument(
        "--format", choices=["nanodet", "yolov8", "yolo11", "yolov5"], help="preprocess --calib images as"
    )
    b.add_argument(
        "--out", default=str(DEFAULT_DIR), metavar="DIR", help=f"engine store (default ./{DEFAULT_DIR})"
    )
    b.add_argument("--backend", choices=["tensorrt", "tensorrt_rtx"], help="default: whichever is installed")
    b.add_argument("--name", help="model directory in the store (default: the ONNX file's stem)")
    b.add_argument(
        "--streams",
        type=_whole(1, 16),
        default=DEFAULT_STREAMS,
        help=f"execution contexts the engine serves (models.M.streams; default {DEFAULT_STREAMS})",
    )
    b.add_argument(
        "--workspace-mb",
        type=_whole(1, 1 << 20),
        default=DEFAULT_WORKSPACE_MB,
        help=f"builder workspace ({DEFAULT_WORKSPACE_MB})",
    )
    b.add_argument(
        "--target-cc", metavar="X.Y", help="TensorRT-RTX ahead-of-time target where no GPU is visible"
    )
    b.add_argument("--force", action="store_true", help="build even if the stored engine fits")
    _add_wait(b)
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.add_argument("--log-level", default="warning", choices=log_levels)
    b.set_defaults(func=cmd_build)

    e = sub.add_parser(
        "engines", help="the engines in a store: list, show a manifest, roll back to the previous plan, prune"
    )
    e_sub = e.add_subparsers(dest="engines_command", required=True)
    ls = e_sub.add_parser(
        "list", help="every model/key: current and previous plans, precision, TensorRT, GPU"
    )
    _add_store_args(ls)
    ls.add_argument("--model", help="only this model")
    ls.add_argument("--json", action="store_true", help="a JSON array, one object per plan")
    ls.set_defaults(func=cmd_list)

    sh = e_sub.add_parser("show", help="one engine's manifest (default: the model's newest key)")
    _add_store_args(sh)
    sh.add_argument("model")
    sh.add_argument("key", nargs="?")
    sh.add_argument("--previous", action="store_true", help="the key's previous plan instead of the current")
    sh.add_argument("--json", action="store_true", help="print the manifest as stored")
    sh.set_defaults(func=cmd_show)

    rb = e_sub.add_parser(
        "rollback", help="make the previous plan of a key current again (again: roll forward)"
    )
    _add_store_args(rb)
    rb.add_argument("model")
    rb.add_argument("key", nargs="?", help="default: the model's newest key")
    _add_wait(rb)
    rb.set_defaults(func=cmd_rollback)

    pr = e_sub.add_parser("prune", help="delete previous plans and what killed builds left (temp files)")
    _add_store_args(pr)
    pr.add_argument("--model", help="only this model")
    pr.add_argument("--key", help="only this key's previous plan (needs --model)")
    pr.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    _add_wait(pr)
    pr.set_defaults(func=cmd_prune)


# ---- the store --------------------------------------------------------------------------------------


def store_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """(the store directory, where it came from) for --dir / -c / the default."""
    if getattr(args, "dir", None):
        return Path(args.dir), "--dir"
    if getattr(args, "config", None):
        from agent.config import load_config

        return Path(load_config(args.config).engine_dir), f"engine_dir of {args.config}"
    return DEFAULT_DIR, f"default ./{DEFAULT_DIR}; give --dir DIR or -c agent.yaml"


def _looks_like_store(d: Path) -> bool:
    """Empty (nothing built yet), or a timing/ dir or a model dir with manifests, plans or a build lock."""
    entries = list(d.iterdir())
    if not entries or (d / "timing").is_dir():
        return True
    for sub in entries:
        if sub.is_dir() and any(
            p.suffix in (".json", ".plan", ".prev") or p.name in (".build.lock", "calibration")
            for p in sub.iterdir()
        ):
            return True
    return False


def open_store(args: argparse.Namespace) -> EngineStore:
    d, origin = store_dir(args)
    if not d.exists():
        raise EngineCliError(f"engine store {d} does not exist ({origin})")
    if not d.is_dir():
        raise EngineCliError(f"engine store {d} is not a directory ({origin})")
    try:
        ok = _looks_like_store(d)
    except OSError as e:
        raise EngineCliError(f"engine store {d} cannot be read: {e.strerror or e}") from None
    if not ok:
        raise EngineCliError(
            f"{d} is not an engine store: no model directory with a manifest ({{model}}/{{key}}.json), "
            f"plan or build lock, and no timing/ ({origin})"
        )
    return EngineStore(d, check_writable=False)


def _model(store: EngineStore, model: str) -> str:
    models = store.models()
    try:
        known = model in models or store.model_dir(model).is_dir()
    except StoreError as e:
        raise EngineCliError(str(e)) from None
    if not known:
        have = ", ".join(models) or "none"
        raise EngineCliError(f"model {model!r} is not in engine store {store.root} (models: {have})")
    return model


def _key(store: EngineStore, model: str, key: str | None) -> str:
    """The key given (it must have a manifest), or the model's newest."""
    keys = store.keys(model)
    if key is None:
        entries = store.entries(model)
        if not entries:
            raise EngineCliError(
                f"model {model!r} has no readable engine manifest in {store.model_dir(model)}"
            )
        assert entries[0].key is not None
        return entries[0].key
    if key not in keys:
        raise EngineCliError(
            f"model {model!r} has no engine {key!r} in {store.model_dir(model)} "
            f"(keys: {', '.join(keys) or 'none'})"
        )
    return key


def _lock(store: EngineStore, model: str, wait_s: float, what: str) -> Any:
    from engines.store.lock import process_command

    return store.lock(
        model,
        wait_s=wait_s,
        command=f"{process_command()} [{what}]",
        on_wait=lambda holder: print(
            f"{model}: waiting up to {wait_s:g} s for the build lock ({holder})", file=sys.stderr
        ),
    )


# ---- rows -------------------------------------------------------------------------------------------


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _mb(n: int | None) -> str:
    if n is None:
        return "missing"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _when(iso: str) -> str:
    try:
        t = _dt.datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if t.tzinfo is not None:
        t = t.astimezone(_dt.timezone.utc)
        return t.strftime("%Y-%m-%d %H:%M:%S UTC")
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _trt(fp: dict[str, Any]) -> str:
    from engines.trt import flavor_label

    return f"{flavor_label(fp.get('trt_flavor'))} {fp.get('trt_version')}"


def _gpu(fp: dict[str, Any]) -> str:
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
        "precision": b.get("precision"),
        "trt_flavor": fp.get("trt_flavor"),
        "trt_version": fp.get("trt_version"),
        "gpu_name": fp.get("gpu_name"),
        "compute_capability": fp.get("compute_capability"),
        "dla_core": fp.get("dla_core"),
        "size_bytes": _size(plan),
        "built_at": b.get("built_at"),
        "plan_sha256": b.get("plan_sha256"),
        "validation": {k: v.get(k) for k in ("metric", "value", "threshold", "passed")} if v else None,
        "plan": str(plan),
        "manifest": str(manifest),
    }


def rows(store: EngineStore, only: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per plan: every key's current plan and its previous one; problems met on the way)."""
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    models = [_model(store, only)] if only else store.models()
    for model in models:
        problems += store.problems(model)
        for i, m in enumerate(store.entries(model)):
            assert m.key is not None and m.path is not None
            out.append(_row(model, m.key, "current", m, store.plan_path_for(model, m), m.path, i == 0))
            prev = store.previous(model, m.key)
            if prev is not None:
                out.append(_row(model, m.key, "previous", prev.manifest, prev.plan, prev.record, i == 0))
    return out, problems


def render(table: list[dict[str, Any]]) -> str:
    head = ("MODEL", "KEY", "STATE", "PRECISION", "TENSORRT", "GPU", "SIZE", "BUILT AT")
    lines = [
        (
            r["model"],
            r["key"] + ("*" if r["newest_key"] and r["state"] == "current" else ""),
            r["state"],
            str(r["precision"]),
            _trt({"trt_flavor": r["trt_flavor"], "trt_version": r["trt_version"]}),
            _gpu(r),
            _mb(r["size_bytes"]),
            _when(str(r["built_at"])),
        )
        for r in table
    ]
    widths = [max(len(c[i]) for c in [head, *lines]) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *lines]
    ]
    return (
        "\n".join(text)
        + "\n* the model's newest engine (what `check` compares when the configured key has none)"
    )


# ---- commands ---------------------------------------------------------------------------------------


def _run(name: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except (EngineError, OSError) as exc:
        msg = (
            str(exc)
            if isinstance(exc, EngineError)
            else f"{getattr(exc, 'filename', '')}: {exc.strerror or exc}"
        )
        print(f"edge-agent {name}: {msg}", file=sys.stderr)
        return 2


def cmd_list(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        table, problems = rows(store, args.model)
        for p in problems:
            print(f"edge-agent engines list: skipped {p}", file=sys.stderr)
        if args.json:
            print(json.dumps(table, indent=2))
        elif not table:
            print(f"no engines in {store.root}")
        else:
            print(render(table))
        return 0

    return _run("engines list", body)


def _describe(
    store: EngineStore, model: str, key: str, m: Manifest, plan: Path, state: str, record: Path
) -> str:
    fp, b = m.fingerprint, m.build
    bad = store.verify_plan(model, m, plan)
    lines = [
        f"{model} / {key} ({state})",
        f"  manifest    {record}",
        f"  plan        {plan} ({_mb(_size(plan))}, " + ("sha256 verified)" if bad is None else f"{bad})"),
        f"  built       {_when(b['built_at'])} in {b['build_s']} s by edge-agent {b['agent_version']}",
        f"  TensorRT    {_trt(fp)} on GPU {_gpu(fp)}, {fp.get('platform')}, CUDA driver "
        f"{fp.get('cuda_driver') or '-'}, runtime {fp.get('cuda_runtime') or '-'}"
        + (f", L4T {fp['l4t']}" if fp.get("l4t") else ""),
        f"  precision   {b['precision']}"
        + (
            f" (calibration {b['calibration'].get('method')}, {b['calibration'].get('samples')} samples)"
            if b.get("calibration")
            else ""
        ),
        f"  profiles    {_profiles(b)}",
        f"  workspace   {(b.get('workspace_bytes') or 0) >> 20} MiB, "
        f"optimization level {b.get('optimization_level')}",
    ]
    layers = b.get("layers")
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
    refused = b.get("refused_at_load")
    if refused:
        lines.append(f"  refused     at load {_when(str(refused.get('at')))}: {refused.get('error')}")
    return "\n".join(lines)


def _dims(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def _profiles(b: dict[str, Any]) -> str:
    """One context's profile set ("input 1x3x416x416..1x3x416x416") and how many contexts carry it."""
    profiles = b["profiles"]
    per = b.get("profiles_per_context") or len(profiles) or 1
    one = "; ".join(
        ", ".join(f"{name} {_dims(s['min'])}..{_dims(s['max'])}" for name, s in p.items())
        for p in profiles[:per]
    )
    contexts = len(profiles) // per
    return one + (f" (x{contexts} execution contexts)" if contexts > 1 else "")


def cmd_show(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        model = _model(store, args.model)
        key = _key(store, model, args.key)
        m = store.manifest(model, key)  # ManifestError names the file
        assert m is not None and m.path is not None
        prev = store.previous(model, key)
        if args.previous:
            if prev is None:
                raise EngineCliError(
                    f"engine {key} of model {model!r} has no previous plan in {store.model_dir(model)}"
                )
            m, plan, record, state = prev.manifest, prev.plan, prev.record, "previous"
        else:
            plan, record, state = store.plan_path_for(model, m), m.path, "current"
        if args.json:
            print(json.dumps(m.to_dict(), indent=2))
            return 0
        print(_describe(store, model, key, m, plan, state, record))
        if not args.previous and prev is not None:
            print(
                f"  previous    {prev.plan} built {_when(prev.manifest.build['built_at'])} "
                f"({prev.manifest.build['precision']}): "
                f"`edge-agent engines rollback {model} {key}` makes it current"
            )
        return 0

    return _run("engines show", body)


def cmd_rollback(args: argparse.Namespace) -> int:
    def body() -> int:
        store = open_store(args)
        model = _model(store, args.model)
        key = _key(store, model, args.key)
        try:
            EngineStore.ensure_writable(store.model_dir(model))
        except StoreError as e:
            raise EngineCliError(str(e).replace("engine_dir", "model directory", 1)) from None
        with _lock(store, model, args.wait, f"engines rollback {model} {key}"):
            now, prev = store.rollback(model, key)
        print(
            f"{model}: engine {key} rolled back: plan {store.plan_path_for(model, now).name} "
            f"(built {_when(now.build['built_at'])}, {now.build['precision']}) is current"
        )
        if prev is not None:
            print(
                f"{model}: plan {prev.plan.name} (built {_when(prev.manifest.build['built_at'])}) is kept as "
                f"previous: the same command rolls forward"
            )
        print(
            f"{model}: a running daemon swaps it in within its engine watch (when {key} is the engine its "
            "configuration asks for; `edge-agent check` says which)"
        )
        return 0

    return _run("engines rollback", body)


def cmd_prune(args: argparse.Namespace) -> int:
    def body() -> int:
        if args.key and not args.model:
            raise EngineCliError("--key needs --model")
        store = open_store(args)
        models = [_model(store, args.model)] if args.model else store.models()
        if args.key:
            _key(store, models[0], args.key)
        total, count = 0, 0
        verb = "would delete" if args.dry_run else "deleted"
        for model in models:
            if args.dry_run:
                files = _dry_run(store, model, args.key)
            else:
                with _lock(store, model, args.wait, f"engines prune {model}"):
                    planned = store.previous_files(model, args.key) + store.stale_files(model)
                    sizes = {p: _size(p) for p in planned}
                    files = [(p, sizes.get(p)) for p in store.prune_previous(model, args.key)]
            for p, n in files:
                total, count = total + (n or 0), count + 1
                print(f"{model}: {verb} {p} ({_mb(n)})")
        if not count:
            print(f"nothing to prune in {store.root}")
        else:
            print(f"{verb} {count} file(s), {_mb(total)}")
        return 0

    return _run("engines prune", body)


def _dry_run(store: EngineStore, model: str, key: str | None) -> list[tuple[Path, int | None]]:
    """What prune would delete; a build running now (its lock held) owns its temp files: not listed."""
    files = store.previous_files(model, key)
    lock = store.lock(model, wait_s=0)
    try:
        lock.acquire()
    except EngineError as exc:
        print(f"{model}: {exc}; its temp files are not stale and not listed", file=sys.stderr)
        stale = [p for p in store.stale_files(model) if not p.name.startswith(".")]
    else:
        try:
            stale = store.stale_files(model)
        finally:
            lock.release()
    return [(p, _size(p)) for p in files + stale]


# ---- build ------------------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    from agent import __version__
    from agent.lifecycle.progress import JobProgress
    from agent.lifecycle.standalone import StandaloneBuild, build_standalone, model_name, parse_shapes
    from agent.logs import setup_logging

    setup_logging(args.log_level)
    if args.log_level in ("warning", "error"):
        # TensorRT's own errors reach the user in the BuildError that fails a build; alone they are noise
        # (a CPU-only TensorRT-RTX build logs CUDA driver errors and succeeds).
        logging.getLogger("engines.trt").setLevel(logging.CRITICAL)

    def body() -> int:
        req = StandaloneBuild(
            onnx=Path(args.onnx),
            precision=args.precision,
            shapes=None if args.shapes is None else (parse_shapes(args.shapes),),
            calib=None if args.calib is None else Path(args.calib),
            calib_method=args.calib_method,
            format=args.format,
            out=Path(args.out),
            backend=args.backend,
            name=args.name,
            streams=args.streams,
            workspace_mb=args.workspace_mb,
            target_compute_capability=args.target_cc,
            force=args.force,
            wait_s=args.wait,
        )
        progress = JobProgress(req.name or model_name(req.onnx))
        try:
            result = build_standalone(req, progress.step, __version__)
        finally:
            progress.close()
        if args.json:
            print(json.dumps(result.to_json(), indent=2))
            return 0
        for t in result.tried:
            if t["reason"]:
                print(f"{result.model}: {t['precision']} not built: {t['reason']}")
        if result.built:
            print(
                f"{result.model}: built {result.precision} engine {result.key} in {result.build_s:.1f} s "
                f"({result.device})"
            )
        else:
            print(f"{result.model}: {result.message}")
        print(f"  plan      {result.plan} ({_mb(_size(result.plan))})")
        print(f"  manifest  {result.manifest}")
        if result.previous is not None:
            print(
                f"  previous  {result.previous} "
                f"(kept: `edge-agent engines rollback {result.model} --dir {args.out}`)"
            )
        return 0

    return _run("build", body)
