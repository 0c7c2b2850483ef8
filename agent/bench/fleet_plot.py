"""bench.png's panels of the fleet sections: each device's seconds to serving with and without the shared
cache (coloured by how its plan came), and the rollouts' per-device deployment stages in time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STAGE_COLOURS = {
    "accepted": "C7", "downloading": "C0", "verifying": "C9", "building": "C1", "gating": "C4",
    "shadow": "C5", "watching": "C8", "serving": "C2", "rejected": "C3", "failed": "C3", "rolled_back": "C6",
}
ORIGIN_COLOURS = {"built": "C1", "cache": "C2", "store": "C0"}


def fleet_panels(report: dict[str, Any]) -> list[Callable[[Any, dict[str, Any]], None]]:
    panels: list[Callable[[Any, dict[str, Any]], None]] = []
    if report.get("fleet_cache"):
        panels.append(_cache)
    if report.get("fleet_rollout"):
        panels += [_good, _broken]
    return panels


def _cache(ax: Any, report: dict[str, Any]) -> None:
    sec = report["fleet_cache"]
    for y0, run in ((0.0, sec["independent"]), (0.4, sec["cached"])):
        for i, row in enumerate(run["devices"]):
            colour = ORIGIN_COLOURS.get(row.get("origin", ""), "C7")
            ax.barh(i + y0, row["serving_s"], 0.38, color=colour, hatch="" if y0 else "//",
                    edgecolor="black" if not y0 else None)
            ax.plot([row.get("first_state_s", 0.0)] * 2, [i + y0 - 0.19, i + y0 + 0.19], "k-", lw=2)
    ax.set_yticks([i + 0.2 for i in range(len(sec["cached"]["devices"]))],
                  [r["device"] for r in sec["cached"]["devices"]])
    ax.set_xlabel("seconds from the agents' start to a plan serving")
    ax.set_title(f"{sec['agents']} agents: independent builds vs shared cache "
                 f"({sec['builds']} build + {sec['pulls']} pulls)", fontsize="small")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=f"origin {o}") for o, c in ORIGIN_COLOURS.items() if o != "store"]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="independent builds"))
    handles.append(Line2D([], [], color="black", lw=2, label="first engine state\n(agent started)"))
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _good(ax: Any, report: dict[str, Any]) -> None:
    _timeline(ax, report["fleet_rollout"]["good"], "rollout")


def _broken(ax: Any, report: dict[str, Any]) -> None:
    _timeline(ax, report["fleet_rollout"]["broken"], "broken version (--rollback-on-halt)")


def _timeline(ax: Any, run: dict[str, Any], what: str) -> None:
    """Each device's stages as bars from one state's time to the next (the last one to the CLI's end)."""
    devices = sorted(run["timeline"])
    seen: set[str] = set()
    for y, device in enumerate(devices):
        states = run["timeline"][device]
        if not states:
            ax.text(0.2, y, "no state of this version: untouched", va="center", fontsize="small")
        for k, (t, stage, _version) in enumerate(states):
            end = states[k + 1][0] if k + 1 < len(states) else max(t + 0.5, run["cli"]["seconds"])
            label = stage if stage not in seen else None
            seen.add(stage)
            ax.barh(y, max(end - t, 0.2), left=t, color=STAGE_COLOURS.get(stage, "C7"), label=label)
    ax.set_yticks(list(range(len(devices))), devices)
    ax.set_ylim(len(devices) - 0.5, -0.5)  # the first device on top, room for the last one's text
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds from `fleet deploy`")
    ax.set_title(f"{what} {run['version']}: exit {run['cli']['rc']}, {len(run['touched'])} touched",
                 fontsize="small")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
