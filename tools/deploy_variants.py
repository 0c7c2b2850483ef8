"""Second versions of the bundled NanoDet for the deployment targets (issue 37), made at test time by graph
surgery on agent/assets/nanodet-m-416.onnx (nothing large is stored in the repository):

    good          weights unchanged, a new file (a version tag in the ONNX metadata): passes every check
    shuffled      the good ONNX with its labels file permuted: the gate's agreement falls to ~0 (rejected)
    slow          the same outputs plus a chain of large MatMuls on a side branch, multiplied by 0 and added
                  to an output (it depends on the input, so ONNX Runtime cannot fold it away): several
                  times slower, rejected in shadow (latency p95 ratio)
    night_blind   the same outputs, but the graph errs on dark frames (mean of the normalised input below
                  DARK_BELOW: an out-of-range Gather): the clip's daylight frames pass verify, gate and
                  shadow; when a camera's scene turns dark after the promotion its frames fail in the
                  engine and the watch rolls the version back (engine errors on that camera)

    from deploy_variants import build_variants, artifact, measure_latency_ms
    variants = build_variants(folder)            # {name: Variant(onnx, labels)}

Used by tests/test_deploy_targets.py and `edge-agent bench --sections deploy` (agent/bench/deploy.py), and
by hand:

    .venv/bin/python tools/deploy_variants.py --out /tmp/variants   # writes them, prints their latency
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deploy_gate_agreement import (  # the gate's measurement holds the shared surgery
    CLIP,
    LABELS,
    NANODET,
    clip_frames,
    shuffled_labels,
)
from deploy_gate_agreement import slow as _slow

# The adapter's normalised input ((pixel - mean) / std, letterbox padding black): the bundled clip's frames
# average -1.51..-0.99, an all-black frame -1.99, videotestsrc's "ball" pattern (a white ball on black,
# tools/rtsp_server.py --pattern) -1.93, the all-zero probe the runtime loads a model with 0.
DARK_BELOW = -1.8
SLOW_MATMULS = 60  # ~5x the bundled model's latency on ONNX Runtime (CPU); see measure_latency_ms


@dataclass(frozen=True)
class Variant:
    onnx: Path
    labels: Path


def tagged(dst: Path, tag: str, src: Path = NANODET) -> Path:
    """The same graph and weights, a different file: `tag` in the ONNX metadata (a new sha256)."""
    model = onnx.load(str(src))
    model.metadata_props.append(onnx.StringStringEntryProto(key="edge-agent.variant", value=tag))
    onnx.save(model, str(dst))
    return dst


def slow(dst: Path, matmuls: int = SLOW_MATMULS, src: Path = NANODET) -> Path:
    """The same outputs plus `matmuls` (1248 x 416) @ (416 x 416) products of the input, added as 0."""
    return _slow(dst, matmuls, src)


def night_blind(dst: Path, dark_below: float = DARK_BELOW, src: Path = NANODET) -> Path:
    """The same outputs on every frame whose normalised input averages >= `dark_below`; on a darker frame
    ONNX Runtime fails the run (Gather index 1 of a 1-element tensor), as a version that crashes on night
    scenes would. The side branch is multiplied by 0 and added to the first output: it depends on the
    input, so it stays in the graph."""
    model = onnx.load(str(src))
    g = model.graph
    name = g.input[0].name

    def const(n: str, value: np.ndarray) -> str:
        g.initializer.append(numpy_helper.from_array(value, n))
        return n

    below = const("deploy_dark_below", np.array(dark_below, np.float32))
    table = const("deploy_dark_table", np.zeros(1, np.float32))
    zero = const("deploy_dark_zero", np.array(0.0, np.float32))
    out = g.output[0].name
    for node in g.node:
        node.output[:] = ["deploy_dark_out" if o == out else o for o in node.output]
    g.node.extend(
        [
            helper.make_node("ReduceMean", [name], ["deploy_dark_mean"], keepdims=0),
            helper.make_node("Less", ["deploy_dark_mean", below], ["deploy_dark_is"]),
            helper.make_node("Cast", ["deploy_dark_is"], ["deploy_dark_index"], to=onnx.TensorProto.INT64),
            helper.make_node("Gather", [table, "deploy_dark_index"], ["deploy_dark_value"], axis=0),
            helper.make_node("Mul", ["deploy_dark_value", zero], ["deploy_dark_nothing"]),
            helper.make_node("Add", ["deploy_dark_out", "deploy_dark_nothing"], [out]),
        ]
    )
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))
    return dst


def build_variants(folder: Path, names: tuple[str, ...] | None = None) -> dict[str, Variant]:
    """The variants (all of them, or `names`) and the bundled labels written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = folder / "coco.names"
    shutil.copy(LABELS, labels)
    makers = {
        "good": lambda: Variant(tagged(folder / "good.onnx", "good"), labels),
        "shuffled": lambda: Variant(
            tagged(folder / "shuffled.onnx", "shuffled"), shuffled_labels(folder / "shuffled.names")
        ),
        "slow": lambda: Variant(slow(folder / "slow.onnx"), labels),
        "night_blind": lambda: Variant(night_blind(folder / "night_blind.onnx"), labels),
    }
    return {n: makers[n]() for n in (names or tuple(makers))}


def artifact(path: Path, url: str) -> dict[str, object]:
    """The document's `{url, sha256, size}` of a file served at `url`."""
    data = path.read_bytes()
    return {"url": url, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def measure_latency_ms(onnx_path: Path, images: list[np.ndarray], repeat: int = 1) -> float:
    """Median ONNX Runtime inference time (ms, one intra-op thread) of `onnx_path` over `images`."""
    from agent.config import ModelConfig
    from agent.lifecycle.model import resolve_spec
    from engines.runtimes.ort import OrtBackend

    cfg = ModelConfig.model_validate(
        {"onnx": onnx_path, "labels": LABELS, "format": "nanodet", "backend": "onnxruntime",
         "precision": "fp32"}
    )
    adapter = resolve_spec("nanodet", cfg).adapter()
    backend = OrtBackend(onnx_path, intra_threads=1)
    backend.load()
    try:
        times = []
        for _ in range(repeat):
            for image in images:
                batch, _ = adapter.preprocess([image])
                t0 = time.perf_counter()
                backend.infer(batch)
                times.append(1000.0 * (time.perf_counter() - t0))
        return float(np.median(times))
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=10)
    args = ap.parse_args(argv)
    variants = build_variants(args.out)
    images = clip_frames(args.frames, every=5, clip=CLIP)
    base = measure_latency_ms(NANODET, images, repeat=2)
    print(f"bundled      {base:7.1f} ms")
    for name, v in variants.items():
        ms = measure_latency_ms(v.onnx, images, repeat=2)
        print(f"{name:12s} {ms:7.1f} ms  x{ms / base:.2f}  {v.onnx} {v.labels.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
