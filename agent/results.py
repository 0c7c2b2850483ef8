"""Turning pipeline results into what users read: MQTT detection payload fields and console lines."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import TextIO

import numpy as np

from pipelines.frames import stage_latencies_ms
from pipelines.scheduler import Result


def detection_fields(result: Result, labels: list[str]) -> dict:
    """Fields of an `edge-agent/detections/1` payload (schema and ts are added by the publisher)."""
    d = result.detections
    frame = result.frame
    h, w = frame.image.shape[:2]
    # One vectorised rounding, then plain Python values for JSON.
    boxes = np.round(d.boxes.astype(np.float64), 1).tolist()
    scores = np.round(d.scores.astype(np.float64), 3).tolist()
    ids = d.class_ids.tolist()
    n_labels = len(labels)
    items = [
        {"label": labels[c] if 0 <= c < n_labels else str(c), "class_id": c, "score": s, "box": b}
        for c, s, b in zip(ids, scores, boxes, strict=True)
    ]
    if result.analysis is not None:  # tracking on: the track of each detection (null until confirmed)
        for item, track in zip(items, result.analysis.track_ids.tolist(), strict=True):
            item["track_id"] = track or None
    lat = {k: round(v, 2) for k, v in stage_latencies_ms(frame).items()}
    return {
        "camera": frame.camera,
        "frame_id": frame.frame_id,
        "ts_capture": frame.ts_capture,
        "image": {"w": int(w), "h": int(h)},
        "model": result.model,
        "engine": {"backend": result.backend, "precision": result.precision},
        "latency_ms": lat,
        "detections": items,
    }


def label_counts(result: Result, labels: list[str]) -> Counter[str]:
    ids, counts = np.unique(result.detections.class_ids, return_counts=True)
    return Counter(
        {(labels[i] if 0 <= i < len(labels) else str(i)): int(n) for i, n in zip(ids, counts, strict=True)}
    )


class ConsoleSink:
    """One readable line per camera per interval: fps, latency, labels and counts of the last frame."""

    def __init__(
        self, labels: dict[str, list[str]], interval_s: float = 1.0, out: TextIO | None = None
    ) -> None:
        self._labels = labels
        self._interval = interval_s
        self._out = out or sys.stdout
        self._lock = threading.Lock()
        self._state: dict[str, dict] = {}

    def __call__(self, result: Result) -> None:
        cam = result.frame.camera
        now = time.monotonic()
        with self._lock:
            st = self._state.setdefault(cam, {"t0": now, "n": 0})
            st["n"] += 1
            if now - st["t0"] < self._interval:
                return
            fps = st["n"] / (now - st["t0"])
            st["t0"], st["n"] = now, 0
        lat = stage_latencies_ms(result.frame)
        counts = label_counts(result, self._labels.get(result.model, []))
        seen = ", ".join(f"{k} x{v}" for k, v in counts.most_common()) or "nothing"
        line = (
            f"{time.strftime('%H:%M:%S')} {cam:<12} {fps:5.1f} fps  "
            f"infer {lat.get('infer', 0):5.1f} ms  total {lat.get('total', 0):6.1f} ms  "
            f"[{result.backend}/{result.precision} b{result.batch_size}]  {seen}"
        )
        print(line, file=self._out, flush=True)
