"""`edge-agent` (agent.cli:main). Exit codes: 0 success, 1 check/gate failed, 2 usage or runtime error."""

from __future__ import annotations

import argparse
import sys

from agent.cli.parser import build_parser
from agent.cli.stdout import READER_LEFT, discard_stdout, stdout_reader_left
from agent.config import ConfigError
from engines.errors import EngineError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _command(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is handled below like any other write
    except BrokenPipeError:
        if not stdout_reader_left():
            raise  # --debug on another pipe's (a child's, a socket's): its traceback
        # `edge-agent check --json | head -3`: the reader has what it wanted. End quietly, as Unix tools do.
        discard_stdout()
        return READER_LEFT
    return code


def _command(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except (ConfigError, EngineError) as exc:
        print(f"edge-agent: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # a bug, or bad input we did not foresee: one line, the traceback on --debug
        if isinstance(exc, BrokenPipeError) and stdout_reader_left():
            raise  # main() ends quietly; any other broken pipe (a child's, a socket's) is an error to report
        if args.debug:
            raise
        why = f"{type(exc).__name__}: {exc}"
        print(f"edge-agent: internal error: {why} (--debug shows the traceback)", file=sys.stderr)
        return 2
