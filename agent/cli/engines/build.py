"""`edge-agent build`: an engine from an ONNX file into a store without agent.yaml (lifecycle.standalone)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.engines.store import reported
from agent.cli.engines.table import mb, size_of
from agent.service.logs import setup_logging

if TYPE_CHECKING:
    from agent.lifecycle.standalone import StandaloneBuild, StandaloneResult


def cmd_build(args: argparse.Namespace) -> int:
    from agent import __version__
    from agent.lifecycle.progress import JobProgress
    from agent.lifecycle.standalone import build_standalone, model_name

    setup_logging(args.log_level)
    if args.log_level in ("warning", "error"):
        # TensorRT's own errors reach the user in the BuildError that fails a build; alone they are noise
        # (a CPU-only TensorRT-RTX build logs CUDA driver errors and succeeds).
        logging.getLogger("engines.trt").setLevel(logging.CRITICAL)

    def body() -> int:
        req = _request(args)
        progress = JobProgress(req.name or model_name(req.onnx))
        try:
            result = build_standalone(req, progress.step, __version__)
        finally:
            progress.close()
        if args.json:
            print(json.dumps(result.to_json(), indent=2))
        else:
            _say(result, args.out)
        return 0

    return reported("build", body)


def _request(args: argparse.Namespace) -> StandaloneBuild:
    from agent.lifecycle.standalone import StandaloneBuild, parse_shapes

    return StandaloneBuild(
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


FOLDED = "int8 (folded)"  # engines.plan.Step.label of INT8 from the folded Q/DQ graph


def _say(result: StandaloneResult, out: str) -> None:
    tried = result.tried
    for i, t in enumerate(tried):
        if not t["reason"]:
            continue
        if t.get("skipped"):
            print(f"{result.model}: {t['precision']} not built: {t['reason']}")
            continue
        after = tried[i + 1]["precision"] if i + 1 < len(tried) else None
        if after == FOLDED:  # the unfolded Q/DQ graph failed; its folded twin is the step after
            what, then = "int8 from the unfolded Q/DQ graph", "; the folded Q/DQ graph was tried next"
        else:
            what, then = t["precision"], (f"; {after} was tried next" if after else "")
        print(f"{result.model}: {what} failed to build: {t['reason']}{then}")
    if result.built:
        how = " from the folded Q/DQ graph" if tried and tried[-1]["precision"] == FOLDED else ""
        print(
            f"{result.model}: built {result.precision} engine {result.key}{how} in {result.build_s:.1f} s "
            f"({result.device})"
        )
    else:
        print(f"{result.model}: {result.message}")
    print(f"  plan      {result.plan} ({mb(size_of(result.plan))})")
    print(f"  manifest  {result.manifest}")
    if result.previous is not None:
        rollback = f"edge-agent engines rollback {result.model} --dir {out}"
        print(f"  previous  {result.previous} (kept: `{rollback}`)")
