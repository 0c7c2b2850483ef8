"""The agent's state in its status payload (``online``, ``starting``, ``degraded``, ``offline``), from its
cameras' states.

A camera is up when it streams (or, a file played once, ended). Every camera starts ``starting`` until its
first open attempt settles (streaming, or reconnecting after a failed attempt): until then the agent is
``starting``, not ``degraded`` (issue 36.17: dashboards alerted on the first second of every start). The
grace is bounded: a camera whose first attempt has not settled ``STARTING_GRACE_S`` seconds past the
longest ``open_timeout_s`` after the agent's start makes it ``degraded`` like any camera that is down.
"""

from __future__ import annotations

from collections.abc import Sequence

STARTING_GRACE_S = 30.0  # beyond the cameras' open timeout: models load before the cameras open
UP = frozenset({"streaming", "ended"})


def agent_state(
    states: Sequence[str], total: int, stopping: bool, age_s: float, open_timeout_s: float
) -> str:
    """``states``: the camera states reported (fewer than ``total`` while some have not reported yet, which
    counts as starting); ``age_s``: seconds since the agent started; ``open_timeout_s``: the longest of its
    cameras'."""
    if stopping:
        return "offline"
    up = sum(1 for s in states if s in UP)
    if up == total:
        return "online"
    starting = all(s in UP or s == "starting" for s in states)
    if starting and age_s < open_timeout_s + STARTING_GRACE_S:
        return "starting"
    return "degraded"
