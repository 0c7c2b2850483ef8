"""What the operator sees of a rollout: the live table while it runs, `fleet rollouts` (list) and
`fleet rollouts ID` (detail). Every text shown that came from a device was cleaned (rollout_state.clean):
no terminal escapes from the network reach the terminal.

    rollout r-20261127-194500-3f2a: detector 2024-06-01.2 to 4 devices, running, wave 2/3, failures 0/0
    WAVE  DEVICE   STAGE      PROGRESS          REASON
    1     cam-a    done       soak 100%
    2     cam-b    deploying  building 40%
    2     cam-c    soaking    soak 35%
    3     cam-d    pending
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from agent.fleet.rollout_state import DEPLOYING, SOAKING, DeviceRecord, Rollout, RolloutStateError, clean

COLUMNS = ("WAVE", "DEVICE", "STAGE", "PROGRESS", "REASON")
REDRAW_S = 0.5  # a TTY redraws at most this often (a stage change redraws at once)


def progress(rec: DeviceRecord) -> str:
    """`building 40%` (the device's own stage and how far within it), `soak 35%`; "" once it is over."""
    if rec.stage == DEPLOYING:
        stage = rec.deployment or "sent"
        return f"{stage} {rec.progress:.0%}" if rec.progress > 0 else stage
    if rec.stage == SOAKING:
        return f"soak {rec.progress:.0%}"
    return ""


def rows(r: Rollout) -> list[tuple[str, ...]]:
    """One row per device, in wave order."""
    out: list[tuple[str, ...]] = []
    for device in r.targets:
        rec = r.devices[device]
        out.append((str(rec.wave + 1), device, rec.stage, progress(rec), rec.reason or ""))
    return out


def header(r: Rollout) -> str:
    wave = min(r.wave + 1, len(r.waves))
    line = (
        f"rollout {r.id}: {clean(r.model, 128)} {clean(r.version, 128)} to {len(r.targets)} devices, "
        f"{r.status}, "
        f"wave {wave}/{len(r.waves)}, failures {r.failures()}/{r.options.max_failures}"
    )
    if r.halted_reason:
        line += f"\nhalted: {clean(r.halted_reason)}"
    return line


def table(lines: list[tuple[str, ...]]) -> str:
    if not lines:
        return ""
    widths = [max(len(row[i]) for row in [COLUMNS, *lines]) for i in range(len(COLUMNS))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*row).rstrip() for row in [COLUMNS, *lines])


def render_detail(r: Rollout) -> str:
    opts = r.options
    said = (
        f"options: canary {opts.canary}, batch {opts.batch}, max failures {opts.max_failures}, soak "
        f"{opts.soak_s:g} s, rollback on halt {'yes' if opts.rollback_on_halt else 'no'}, skip offline "
        f"{'yes' if opts.skip_offline else 'no'}, offline timeout {opts.offline_timeout_s:g} s"
    )
    ago = f"updated {_ago(time.time() - r.updated_at)} ago by {clean(r.driver, 128) or '?'}"
    return f"{header(r)}\ndocument {r.digest[:16]}; {said}\n{ago}\n{table(rows(r))}"


def render_list(found: Mapping[str, Rollout | RolloutStateError], now: float | None = None) -> str:
    """One line per rollout, newest first; an unusable retained document is a line saying why."""
    now = time.time() if now is None else now
    lines: list[tuple[str, ...]] = []
    good = sorted((r for r in found.values() if isinstance(r, Rollout)), key=lambda r: -r.created_at)
    for r in good:
        done = sum(1 for rec in r.devices.values() if rec.stage == "done")
        lines.append(
            (
                r.id,
                clean(r.model, 64) or "",
                clean(r.version, 64) or "",
                r.status,
                f"{min(r.wave + 1, len(r.waves))}/{len(r.waves)}",
                f"{done}/{len(r.targets)}",
                str(r.failures()),
                _ago(now - r.updated_at),
            )
        )
    for rid, bad in sorted(found.items()):
        if isinstance(bad, RolloutStateError):
            lines.append(
                (clean(rid, 64) or "?", "?", "?", "unreadable", "", "", "", clean(str(bad), 120) or "")
            )
    cols = ("ID", "MODEL", "VERSION", "STATUS", "WAVE", "DONE", "FAILED", "UPDATED")
    if not lines:
        return "no rollout"
    widths = [max(len(row[i]) for row in [cols, *lines]) for i in range(len(cols))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*row).rstrip() for row in [cols, *lines])


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def as_json(r: Rollout | RolloutStateError) -> dict[str, Any]:
    if isinstance(r, RolloutStateError):
        return {"status": "unreadable", "error": str(r)}
    return r.fields()


class LiveTable:
    """The on_change callback of a running rollout: on a terminal the whole table redrawn in place; else
    one line per device change (and per change of the rollout's status or wave)."""

    def __init__(self, out: TextIO | None = None, tty: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self._drawn = 0.0
        self._last: tuple[str, int] | None = None

    def __call__(self, r: Rollout, rec: DeviceRecord | None) -> None:
        if self.tty:
            if rec is not None or time.monotonic() - self._drawn >= REDRAW_S or r.status != "running":
                self._drawn = time.monotonic()
                self.out.write("\x1b[H\x1b[2J" + render_detail(r) + "\n")
                self.out.flush()
            return
        now = time.strftime("%H:%M:%S")
        shown = (r.status, min(r.wave, len(r.waves) - 1))
        if shown != self._last:
            self._last = shown
            self.out.write(f"{now} {header(r)}\n")
        if rec is not None:
            detail = " ".join(t for t in (progress(rec), rec.reason or "") if t)
            self.out.write(
                f"{now} wave {rec.wave + 1} {rec.device}: {rec.stage}{' ' + detail if detail else ''}\n"
            )
        self.out.flush()
