"""argparse types for numbers on the command line: out of range is a usage error (exit 2) naming the option;
NaN and infinities are refused (they pass float() and break the waits behind them)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

LOG_LEVELS = ["debug", "info", "warning", "error"]  # the choices of every --log-level


def whole(low: int, high: int) -> Callable[[str], int]:
    """A whole number in low..high."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: must be {low}..{high}")
        return value

    return parse


def port(text: str) -> int:
    """A TCP port."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port {text}: not a whole number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {text}: must be 1..65535")
    return value


def seconds(most: float, zero: bool = False) -> Callable[[str], float]:
    """Seconds: a finite number above 0 (or 0 where `zero` says it means something), at most `most`."""
    rule = f"a number of seconds, {'0' if zero else 'more than 0'} {'to' if zero else 'and at most'} {most:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not a number of seconds") from None
        if not (math.isfinite(value) and (value > 0 or (zero and value == 0)) and value <= most):
            raise argparse.ArgumentTypeError(f"{text}: must be {rule}")
        return abs(value)  # -0 is 0

    return parse
