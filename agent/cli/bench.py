"""`edge-agent bench`: the parser's options are the benchmark's own (agent.bench.args)."""

from __future__ import annotations

import argparse
from typing import Any

from agent.service.logs import setup_logging


def add_parsers(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="pipeline benchmark: stages, agent overhead, streams x batch sweep (JSON report + plot)",
        description="trtexec-like benchmark of the whole pipeline; see agent/bench/ and docs/BENCHMARKS.md",
    )
    from agent.bench.args import add_arguments  # light: the benchmark itself loads only when it runs

    add_arguments(b)
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from agent.bench.run import run_from_args

    return run_from_args(args)
