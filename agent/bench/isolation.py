"""Isolation (--flap): each sweep point with K more cameras whose RTSP source drops them every few seconds,
against K that stay up and against none; what the flapping costs the steady cameras."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agent.bench.args import BenchOptions

# Isolation variants of each point: the steady cameras alone; beside K more RTSP cameras that stay up (the
# control: what K more cameras cost on this machine); beside K cameras whose source drops them every few s.
VARIANTS = ("without", "control", "flapping")


@contextlib.contextmanager
def flapping_sources(opts: BenchOptions) -> Iterator[list[tuple[str, str | None]]]:
    """--flap: two RTSP servers (tools/annexb_rtsp_server.py) serving the clip, one of them dropping every
    client after --flap-every seconds; yields (variant, URL of the K extra cameras or None) to run."""
    if not opts.flap:
        yield [("without", None)]
        return
    script = Path(__file__).resolve().parents[2] / "tools" / "annexb_rtsp_server.py"
    if not script.is_file():
        raise RuntimeError(f"--flap needs {script} (run the bench from a repository checkout)")
    stream = opts.clip
    if stream.suffix.lower() not in (".h264", ".264", ".h265", ".265", ".hevc"):
        opts.out.mkdir(parents=True, exist_ok=True)
        stream = opts.out / f"{opts.clip.stem}.h264"
        cmd = [sys.executable, str(script), "--from-mp4", str(opts.clip), "--write-annexb", str(stream)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    servers = []
    try:
        urls = []
        for close_after in (0.0, opts.flap_every_s):
            cmd = [sys.executable, str(script), str(stream), "--port", "0", "--fps", f"{opts.fps:g}"]
            cmd += ["--close-after", f"{close_after:g}"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            servers.append(proc)
            out = proc.stdout
            port = out.readline().strip() if out is not None else ""  # its first line; "" when it exited
            if not port.isdigit():
                raise RuntimeError(f"an RTSP server for --flap did not start: {' '.join(cmd)}")
            urls.append(f"rtsp://127.0.0.1:{port}/extra")
        yield list(zip(VARIANTS, [None, *urls], strict=True))
    finally:
        for proc in servers:
            proc.kill()
            proc.wait(10)


def isolation(runs: list[dict[str, Any]], opts: BenchOptions) -> list[dict[str, Any]]:
    """Each point's steady cameras alone, beside K cameras that stay up (control), and beside K that flap
    (medians over --repeat rounds): what the flapping costs them is `vs_control` (`vs_without` adds the
    load of K more cameras)."""
    points: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        points.setdefault((run["streams"], run["batch"]), {}).setdefault(run["variant"], []).append(run)
    out = []
    for (streams, batch), by in points.items():
        steady = {name: _median_steady(by[name]) for name in VARIANTS}
        out.append(
            {
                "streams": streams,
                "batch": batch,
                "flap": opts.flap,
                "flap_every_s": opts.flap_every_s,
                "rounds": len(by["flapping"]),
                "flap_reconnects": sum(r["flap_reconnects"] or 0 for r in by["flapping"]),
                **steady,
                "vs_control": _delta(steady["control"], steady["flapping"]),
                "vs_without": _delta(steady["without"], steady["flapping"]),
            }
        )
    return out


def _median_steady(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The steady cameras' processed frames/s and frame age percentiles, medians over the rounds."""
    st = [r["steady"] for r in runs]
    return {
        "processed_fps": float(np.median([s["processed_fps"] for s in st])),
        "latency_ms": {
            q: round(float(np.median([s["latency_ms"][q] for s in st])), 3) for q in ("p50", "p95", "p99")
        },
        "p99_per_round": [s["latency_ms"]["p99"] for s in st],
    }


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """Steady cameras' processed frames (relative change) and frame age p99 (ms) from run a to run b."""
    pa, pb = a["latency_ms"]["p99"], b["latency_ms"]["p99"]
    return {
        "processed_change": round(b["processed_fps"] / a["processed_fps"] - 1, 4)
        if a["processed_fps"]
        else None,
        "age_p99_delta_ms": round(pb - pa, 2) if pa is not None and pb is not None else None,
    }
