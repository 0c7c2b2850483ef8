"""The engine lifecycle on an agent.yaml: `edge-agent check | rebuild | calibrate | validate | profile`
(the work itself: agent.lifecycle)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agent.cli.argtypes import LOG_LEVELS, seconds, whole
from agent.config import AgentConfig, load_config
from agent.service.logs import setup_logging
from engines.precision import REQUESTABLE


def add_parsers(sub: Any) -> None:
    _add_check(sub)
    _add_rebuild(sub)
    _add_calibrate(sub)
    _add_validate(sub)
    _add_profile(sub)


def _add_check(sub: Any) -> None:
    c = sub.add_parser(
        "check", help="check every engine against this device (exit 0 fit, 1 rebuild, 2 error)"
    )
    c.add_argument("-c", "--config", required=True)
    c.add_argument("--model")
    c.add_argument("--json", action="store_true")
    c.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    c.set_defaults(func=cmd_check)


def _add_rebuild(sub: Any) -> None:
    rb = sub.add_parser(
        "rebuild",
        help="build engines that do not fit (or all with --force); daemon may run",
        description="Build the engines that do not fit this device (all of them with --force); a running "
        "daemon picks them up. With engines.cache, an engine that does not fit is pulled from the fleet's "
        "cache where it holds one of the key (else built here and pushed, one build per key across the "
        "fleet as in the daemon); --force always builds here and never pulls.",
    )
    rb.add_argument("-c", "--config", required=True)
    rb.add_argument("--model")
    rb.add_argument(
        "--force", action="store_true", help="build here even if the stored engine fits (never pulled)"
    )
    rb.add_argument("--precision", choices=REQUESTABLE)
    rb.add_argument(
        "--wait",
        type=seconds(86400, zero=True),
        default=0.0,
        metavar="S",
        help="wait up to S seconds for another build of the same model (default: fail at once)",
    )
    rb.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    rb.set_defaults(func=cmd_rebuild)


def _add_calibrate(sub: Any) -> None:
    cal = sub.add_parser(
        "calibrate", help="capture the INT8 calibration set (+ held-out gate frames) from cameras or a folder"
    )
    cal.add_argument("-c", "--config", required=True)
    cal.add_argument("--model", help="default: every model")
    cal.add_argument("--from", dest="source", metavar="DIR", help="images/videos instead of cameras")
    cal.add_argument(
        "--samples",
        type=whole(0, 100_000),
        help="calibration frames, 0..100000 (default: models.M.calibration.samples)",
    )
    cal.add_argument(
        "--held-out", type=whole(1, 100_000), help="gate frames on top (default: samples/9, at least 20)"
    )
    cal.add_argument(
        "--interval",
        type=seconds(86400),
        metavar="S",
        help="live cameras: seconds apart (default: its calibration.interval_s)",
    )
    cal.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    cal.set_defaults(func=cmd_calibrate)


def _add_validate(sub: Any) -> None:
    val = sub.add_parser("validate", help="accuracy gate on the held-out frames (exit 0 pass, 1 fail)")
    val.add_argument("-c", "--config", required=True)
    val.add_argument("--model", help="default: every model")
    val.add_argument("--precision", choices=REQUESTABLE, help="default: the model's")
    val.add_argument("--method", choices=["entropy", "minmax", "percentile"], help="int8 calibration method")
    val.add_argument("--json", action="store_true", help="print the validation object (+ model, precision)")
    val.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    val.set_defaults(func=cmd_validate)


def _add_profile(sub: Any) -> None:
    pr = sub.add_parser(
        "profile", help="per-layer time (p50, share) of one inference: table, JSON report and bar chart"
    )
    pr.add_argument("-c", "--config", required=True)
    pr.add_argument("--model", help="default: every model")
    pr.add_argument(
        "--precision",
        choices=["fp32", "fp16", "int8"],
        help="default: the model's (best: int8); on ONNX Runtime fp16/int8 are profiled next to fp32",
    )
    # --iterations and --top: whole numbers here, >= 1 checked by run_profile (its own message, exit 2)
    pr.add_argument("--iterations", type=int, default=50, help="profiled inferences (after one warm-up)")
    pr.add_argument("--top", type=int, default=15, help="layers in the table and the chart")
    pr.add_argument("--out", default="profile-out", help="folder for {model}.json, .png and ORT traces")
    pr.add_argument("--json", action="store_true", help="print the report instead of the table")
    pr.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    pr.set_defaults(func=cmd_profile)


def _configured(args: argparse.Namespace) -> AgentConfig:
    """The config that -c names, then logging at --log-level."""
    cfg = load_config(args.config)
    setup_logging(args.log_level)
    return cfg


def cmd_check(args: argparse.Namespace) -> int:
    cfg = _configured(args)
    from agent.lifecycle.commands import run_check

    return run_check(cfg, args.model, args.json)


def cmd_rebuild(args: argparse.Namespace) -> int:
    cfg = _configured(args)
    from agent.lifecycle.commands import run_rebuild

    return run_rebuild(cfg, args.model, args.force, args.precision, args.wait)


def cmd_calibrate(args: argparse.Namespace) -> int:
    cfg = _configured(args)
    from agent.lifecycle.commands import run_calibrate

    folder = Path(args.source) if args.source else None
    return run_calibrate(cfg, args.model, folder, args.samples, args.held_out, args.interval)


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = _configured(args)
    from agent.lifecycle.commands import run_validate

    return run_validate(cfg, args.model, args.precision, args.method, args.json)


def cmd_profile(args: argparse.Namespace) -> int:
    cfg = _configured(args)
    from agent.lifecycle.profile import run_profile

    return run_profile(cfg, args.model, args.precision, args.iterations, args.top, Path(args.out), args.json)
