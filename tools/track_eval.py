#!/usr/bin/env python3
"""Tracking defaults measured on real trajectories: the MOT15 sequences py-motmetrics ships.

For each sequence (TUD-Campus, TUD-Stadtmitte) and detection source (agent/bench/mot15.py: "test",
test.txt's boxes; "gt_noisy", the ground truth through a noisy detector, seeds 0..N-1), prints IDF1 / MOTA /
ID switches at each ``tracking.low_score``, and the zone entries counted on two zones drawn on the scenes
against the true ones at each zone inertia (frames, seconds). ``--cpu`` adds the host's decode + NMS cost
per frame of the bundled NanoDet on the bundled clip at each low_score (the route decodes down to it).

    .venv/bin/python tools/track_eval.py [--seeds 3] [--cpu] [--json out.json]

tests/test_track_eval.py runs the same evaluation at the shipped defaults and checks quality floors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.bench.mot15 import MOT15, MotSequence, evaluate_sequence, every, load_mot15
from agent.config.analytics import TrackingConfig, ZoneConfig
from pipelines.tracking import TrackerParams

LOW_SCORES = (0.1, 0.12, 0.15, 0.2, 0.25)
INERTIA = ((2, 0.0), (1, 0.0), (1, 0.1), (1, 0.2), (1, 0.3), (1, 0.4))  # (frames, seconds)
MIN_SCORE = 0.4  # the camera's default min_score (agent/config/camera.py); new tracks from 0.5


def defaults() -> tuple[float, int, float]:
    """The shipped low_score, zone inertia (frames) and inertia_s."""
    zone = ZoneConfig.model_fields
    low = TrackingConfig.model_fields["low_score"].default
    return low, zone["inertia"].default, zone["inertia_s"].default


def params(low_score: float) -> TrackerParams:
    return TrackerParams(high_score=MIN_SCORE, new_score=MIN_SCORE + 0.1, low_score=low_score)


def sequences(seeds: int) -> list[tuple[str, MotSequence]]:
    out = [("test", load_mot15(name, "test")) for name in MOT15]
    for seed in range(seeds):
        out += [(f"gt_noisy seed {seed}", load_mot15(name, "gt_noisy", seed=seed)) for name in MOT15]
    return out


def evaluate(
    seqs: list[tuple[str, MotSequence]], low: float, inertia: int, inertia_s: float
) -> list[dict[str, Any]]:
    rows = []
    for source, seq in seqs:
        r = evaluate_sequence(seq, params(low), MIN_SCORE, inertia, inertia_s)
        m = r.metrics
        rows.append(
            {
                "source": source,
                "sequence": seq.name,
                "low_score": low,
                "inertia": inertia,
                "inertia_s": inertia_s,
                "mota": round(m.mota, 4),
                "idf1": round(m.idf1, 4),
                "id_switches": m.id_switches,
                "entries": r.entries,
                "truth": r.truth,
                "entry_error": sum(abs(r.entries[z] - r.truth[z]) for z in r.truth),
            }
        )
    return rows


def decode_cost(floors: tuple[float, ...], frames: int = 48, repeats: int = 5) -> dict[str, float]:
    """Host CPU (ms per frame, best of ``repeats``) of the bundled NanoDet's decode + NMS on the bundled
    clip's first ``frames`` frames at each score floor; ONNX Runtime's outputs recorded once first."""
    from agent.bench.args import BenchOptions
    from agent.bench.streams import read_clip
    from engines.runtimes.ort import OrtBackend
    from pipelines.models import resolve_onnx
    from pipelines.postprocess import load_labels

    o = BenchOptions()
    spec = resolve_onnx(o.model.stem, o.model, o.format, load_labels(o.labels))
    ort = OrtBackend(str(o.model))
    ort.load()
    adapter = spec.adapter()
    recorded = []
    for img in read_clip(o.clip, frames):
        tensor, lb = adapter.preprocess([img])
        recorded.append((ort.infer(tensor), lb))
    ort.close()
    out = {}
    for floor in floors:
        best = float("inf")
        boxes = 0
        for _ in range(repeats):
            t0 = time.thread_time()
            boxes = sum(len(adapter.postprocess(outs, lb, floor)[0]) for outs, lb in recorded)
            best = min(best, (time.thread_time() - t0) / len(recorded))
        out[str(floor)] = round(1000 * best, 4)
        out[f"{floor} boxes"] = round(boxes / len(recorded), 1)
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [title, "source                   sequence        MOTA    IDF1   IDsw  entries (counted/true)"]
    for r in rows:
        ent = ", ".join(f"{z} {r['entries'][z]}/{r['truth'][z]}" for z in r["truth"])
        head = f"{r['source']:<24} {r['sequence']:<15}"
        lines.append(f"{head} {r['mota']:.3f}  {r['idf1']:.3f}  {r['id_switches']:>4}  {ent}")
    noisy = [r for r in rows if r["source"] != "test"]
    if noisy:
        lines.append(
            f"{'gt_noisy mean':<40} {_mean(noisy, 'mota'):.3f}  {_mean(noisy, 'idf1'):.3f}  "
            f"{_mean(noisy, 'id_switches'):>4.1f}  entry error {_mean(noisy, 'entry_error'):.2f} a sequence"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="gt_noisy seeds per sequence (default 3)")
    p.add_argument("--cpu", action="store_true", help="also the host decode + NMS cost per low_score")
    p.add_argument("--json", type=Path, help="write every row here")
    args = p.parse_args(argv)
    low0, inertia0, inertia_s0 = defaults()
    seqs = sequences(args.seeds)
    report: dict[str, Any] = {"defaults": {"low_score": low0, "inertia": inertia0, "inertia_s": inertia_s0}}
    print(f"defaults: low_score {low0}, zone inertia {inertia0} frame(s) and {inertia_s0} s")
    report["low_score"] = []
    for low in LOW_SCORES:
        rows = evaluate(seqs, low, inertia0, inertia_s0)
        report["low_score"] += rows
        print(table(rows, f"\n== low_score {low} (inertia {inertia0} frames, {inertia_s0} s)"))
    report["inertia"] = []
    for stride in (1, 2):  # 25 fps, and every other frame: the same scenes at 12.5 fps
        fps_seqs = [(source, every(seq, stride)) for source, seq in seqs]
        fps = seqs[0][1].fps / stride
        for frames, seconds in INERTIA:
            rows = evaluate(fps_seqs, low0, frames, seconds)
            for r in rows:
                r["fps"] = fps
            report["inertia"] += rows
            title = f"\n== zone inertia {frames} frame(s), {seconds} s at {fps:g} fps (low_score {low0})"
            print(table(rows, title))
    if args.cpu:
        report["decode_nms_ms"] = cost = decode_cost(LOW_SCORES)
        print("\n== host decode + NMS per frame, bundled NanoDet on the bundled clip (ms; boxes a frame)")
        for low in LOW_SCORES:
            print(f"low_score {low}: {cost[str(low)]:.3f} ms, {cost[f'{low} boxes']} boxes")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
