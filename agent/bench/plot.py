"""bench.png: throughput vs streams and latency vs batch from a sweep, or the stage/overhead bars."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

MISSING = (
    "plot skipped: matplotlib is not installed (pip install 'edge-agent[bench]' or pip install matplotlib)"
)


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Write the plot; returns its path, or None (saying why on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"edge-agent bench: {MISSING}", file=sys.stderr)
        return None
    runs = report.get("runs") or []
    panels = [p for p in (_throughput, _latency) if runs] or [_stages, _overhead]
    panels = [p for p in panels if p is not _stages or "stages_ms" in report]
    panels = [p for p in panels if p is not _overhead or "overhead_ms" in report]
    if (report.get("deploy") or {}).get("runs"):
        panels.append(_deploy)
    from agent.bench.fleet_plot import fleet_panels

    panels += fleet_panels(report)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        panel(ax, report)
    engine = report.get("engine") or {}
    if engine.get("kind") == "simulated":
        fig.suptitle(
            f"{report['model']} outputs replayed by a simulated engine ({engine['ms_per_batch']:g} ms/batch, "
            f"{engine['slots']} slot(s)), {report.get('resolution', '')}"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _throughput(ax: Any, report: dict[str, Any]) -> None:
    runs = report["runs"]
    for batch in sorted({r["batch"] for r in runs}):
        rs = sorted((r for r in runs if r["batch"] == batch), key=lambda r: r["streams"])
        ax.plot([r["streams"] for r in rs], [r["processed_fps"] for r in rs], "o-", label=f"batch <= {batch}")
    streams = sorted({r["streams"] for r in runs})
    offered = [max(r["nominal_fps"] for r in runs if r["streams"] == s) for s in streams]
    ax.plot(streams, offered, "k--", label="offered")
    ax.set_xlabel("streams")
    ax.set_ylabel("frames/s processed")
    ax.set_title("Throughput vs streams")
    ax.legend()


def _latency(ax: Any, report: dict[str, Any]) -> None:
    runs = report["runs"]
    for i, streams in enumerate(sorted({r["streams"] for r in runs})):
        rs = sorted((r for r in runs if r["streams"] == streams), key=lambda r: r["batch"])
        xs = [r["batch"] for r in rs]
        color = f"C{i}"
        ax.plot(xs, [r["latency_ms"]["p50"] for r in rs], "o-", color=color, label=f"{streams} streams p50")
        ax.plot(xs, [r["latency_ms"]["p95"] for r in rs], "x:", color=color, label=f"{streams} streams p95")
    ax.set_xlabel("max batch")
    ax.set_ylabel("frame age at delivery, ms")
    ax.set_title("Latency vs batch")
    ax.legend(fontsize="small")


def _stages(ax: Any, report: dict[str, Any]) -> None:
    stages = report["stages_ms"]
    names = list(stages)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [stages[k]["p50"] for k in names], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [stages[k]["p95"] for k in names], 0.4, label="p95")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("ms per frame")
    ax.set_title(f"Stages, {report['model']} on {report['clip']} (ONNX Runtime CPU)")
    ax.legend()


def _overhead(ax: Any, report: dict[str, Any]) -> None:
    res = list(report["overhead_ms"])
    x = range(len(res))
    ax.bar(
        [i - 0.2 for i in x], [report["overhead_ms"][r]["per_frame"]["p50"] for r in res], 0.4, label="p50"
    )
    ax.bar(
        [i + 0.2 for i in x], [report["overhead_ms"][r]["per_frame"]["p95"] for r in res], 0.4, label="p95"
    )
    for i, r in enumerate(res):
        target = report["overhead_target_ms"].get(r)
        if target is not None:
            ax.plot([i - 0.4, i + 0.4], [target, target], "r--")
    ax.set_xticks(list(x), res)
    ax.set_title("Agent overhead per frame, inference replayed (red: target)")
    ax.legend()


def _deploy(ax: Any, report: dict[str, Any]) -> None:
    """Command to serving per run: the seconds of each stage stacked, frames processed meanwhile."""
    runs = report["deploy"]["runs"]
    stages = [k for k in ("downloading", "verifying", "building", "gating", "shadow") if any(
        k in r["stage_s"] for r in runs)]
    for y, r in enumerate(runs):
        left = 0.0
        for i, k in enumerate(stages):
            w = r["stage_s"].get(k, 0.0)
            ax.barh(y, w, left=left, color=f"C{i}", label=k if y == 0 else None)
            left += w
        ax.text(left, y, f" {r['frames_during_pct_of_before']:.0f}% frames", va="center", fontsize="small")
    ax.set_yticks(list(range(len(runs))), [r["version"] for r in runs])
    ax.set_xlabel("seconds from cmd/deploy (shadow includes the promotion)")
    ax.margins(x=0.25)  # room for the frames label
    ax.set_title("Deployment: command to serving")
    ax.legend(fontsize="small")
