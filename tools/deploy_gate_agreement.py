"""The deployment gate's agreement (agent.deploy.gate) of second versions of the bundled NanoDet against it,
on frames of the bundled clip, on ONNX Runtime: what deploy.gate.min_agreement must separate.

    .venv/bin/python tools/deploy_gate_agreement.py [--frames 50] [--every 5]

Versions (made here by graph surgery; the functions are also the deploy flow tests' broken models):
  reexport       the same graph saved again (onnx.save): what a plain re-export is
  retrained-1%/2%/3%  Conv/MatMul weights and biases times (1 + N(0, s)): stand-ins
                      for a retrained model that differs
  labels-shuffled     the same ONNX, its labels file permuted
  normalisation       Mul + Add on the input: the model sees 0-1 pixels where it was trained on mean/std
  input-size          Resize x0.5 + Pad on the input: objects at half their scale (a model made for another
                      input size than its adapter feeds)
  slow                the same outputs plus heavy MatMul work (shadow's latency check, not the gate's)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
NANODET = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"
LABELS = ROOT / "agent" / "assets" / "coco.names"
CLIP = ROOT / "agent" / "assets" / "bikes.mp4"
SCORE = 0.4  # the camera default min_score (agent.lifecycle.model.DEFAULT_SCORE_THRESHOLD)


def clip_frames(n: int, every: int = 1, start: int = 0, clip: Path = CLIP) -> list[np.ndarray]:
    import cv2

    cap = cv2.VideoCapture(str(clip))
    frames: list[np.ndarray] = []
    i = 0
    try:
        while len(frames) < n:
            ok, frame = cap.read()
            if not ok:
                break
            if i >= start and (i - start) % every == 0:
                frames.append(frame)
            i += 1
    finally:
        cap.release()
    return frames


def _input_rewired(model: onnx.ModelProto, inner: str) -> str:
    """Point every consumer of the graph input at `inner` (to be produced by new nodes); the input name."""
    name = model.graph.input[0].name
    for node in model.graph.node:
        node.input[:] = [inner if i == name else i for i in node.input]
    return name


def _const(model: onnx.ModelProto, name: str, value: np.ndarray) -> str:
    model.graph.initializer.append(numpy_helper.from_array(value, name))
    return name


def reexport(dst: Path, src: Path = NANODET) -> Path:
    onnx.save(onnx.load(str(src)), str(dst))
    return dst


def retrained(dst: Path, sigma: float, seed: int = 0, src: Path = NANODET) -> Path:
    model = onnx.load(str(src))
    rng = np.random.default_rng(seed)
    weights = {i for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm") for i in n.input[1:]}
    for i, init in enumerate(model.graph.initializer):
        a = numpy_helper.to_array(init)
        if init.name in weights and a.dtype == np.float32:
            noisy = a * (1.0 + rng.normal(0.0, sigma, a.shape)).astype(np.float32)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(noisy, init.name))
    onnx.save(model, str(dst))
    return dst


def shuffled_labels(dst: Path, seed: int = 0, src: Path = LABELS) -> Path:
    names = src.read_text().splitlines()
    order = np.random.default_rng(seed).permutation(len(names))
    dst.write_text("".join(names[i] + "\n" for i in order))
    return dst


def wrong_normalisation(dst: Path, src: Path = NANODET) -> Path:
    """x -> x * 57.6/255 + 114/255: the mean/std input the adapter gives, seen as 0-1 pixels."""
    model = onnx.load(str(src))
    name = _input_rewired(model, "deploy_inner_input")
    mul = _const(model, "deploy_norm_mul", np.array(57.6 / 255.0, np.float32))
    add = _const(model, "deploy_norm_add", np.array(114.0 / 255.0, np.float32))
    model.graph.node.insert(0, helper.make_node("Add", ["deploy_scaled", add], ["deploy_inner_input"]))
    model.graph.node.insert(0, helper.make_node("Mul", [name, mul], ["deploy_scaled"]))
    onnx.save(model, str(dst))
    return dst


def wrong_input_size(dst: Path, src: Path = NANODET) -> Path:
    """The image resized to half inside the graph and padded back: objects at half their scale."""
    model = onnx.load(str(src))
    name = _input_rewired(model, "deploy_inner_input")
    h = model.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    w = model.graph.input[0].type.tensor_type.shape.dim[3].dim_value
    scales = _const(model, "deploy_scales", np.array([1, 1, 0.5, 0.5], np.float32))
    pads = _const(model, "deploy_pads", np.array([0, 0, 0, 0, 0, 0, h - h // 2, w - w // 2], np.int64))
    nodes = [
        helper.make_node("Resize", [name, "", scales], ["deploy_small"], mode="linear"),
        helper.make_node("Pad", ["deploy_small", pads], ["deploy_inner_input"], mode="constant"),
    ]
    for node in reversed(nodes):
        model.graph.node.insert(0, node)
    onnx.save(model, str(dst))
    return dst


def slow(dst: Path, matmuls: int = 60, src: Path = NANODET) -> Path:
    """The same outputs, plus `matmuls` (1248 x 416) @ (416 x 416) products of the input added as 0 to an
    output (not foldable: they depend on the input)."""
    model = onnx.load(str(src))
    g = model.graph
    name = g.input[0].name
    dims = [d.dim_value for d in g.input[0].type.tensor_type.shape.dim]
    rows, cols = dims[0] * dims[1] * dims[2], dims[3]
    shape = _const(model, "deploy_slow_shape", np.array([rows, cols], np.int64))
    weight = np.random.default_rng(0).normal(0, 1 / np.sqrt(cols), (cols, cols)).astype(np.float32)
    w = _const(model, "deploy_slow_w", weight)
    zero = _const(model, "deploy_slow_zero", np.array(0.0, np.float32))
    nodes = [helper.make_node("Reshape", [name, shape], ["deploy_slow_0"])]
    for k in range(matmuls):
        nodes.append(helper.make_node("MatMul", [f"deploy_slow_{k}", w], [f"deploy_slow_{k + 1}"]))
    nodes.append(helper.make_node("ReduceMean", [f"deploy_slow_{matmuls}"], ["deploy_slow_mean"], keepdims=0))
    nodes.append(helper.make_node("Mul", ["deploy_slow_mean", zero], ["deploy_slow_nothing"]))
    out = g.output[0].name
    for node in g.node:
        node.output[:] = ["deploy_slow_out" if o == out else o for o in node.output]
    nodes.append(helper.make_node("Add", ["deploy_slow_out", "deploy_slow_nothing"], [out]))
    g.node.extend(nodes)
    onnx.save(model, str(dst))
    return dst


def agreement(
    onnx_path: Path, labels: Path, frames: list[np.ndarray], score: float = SCORE
) -> dict[str, float | int]:
    from agent.config import ModelConfig
    from agent.deploy.gate import Side, agreement_of
    from agent.lifecycle.model import resolve_spec
    from engines.runtimes.ort import OrtBackend

    def side(path: Path, lab: Path) -> Side:
        cfg = ModelConfig.model_validate(
            {"onnx": path, "labels": lab, "format": "nanodet", "backend": "onnxruntime", "precision": "fp32"}
        )
        backend = OrtBackend(path)
        backend.load()
        return Side(backend, resolve_spec("nanodet", cfg))

    serving, candidate = side(NANODET, LABELS), side(onnx_path, labels)
    try:
        return agreement_of(serving, candidate, frames, score, 0.5)
    finally:
        serving.backend.close()
        candidate.backend.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--every", type=int, default=5, help="take every k-th frame of the clip")
    args = ap.parse_args(argv)
    frames = clip_frames(args.frames, args.every)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cases = [
            ("reexport", reexport(d / "r.onnx"), LABELS),
            ("retrained-1%", retrained(d / "t1.onnx", 0.01), LABELS),
            ("retrained-2%", retrained(d / "t2.onnx", 0.02), LABELS),
            ("retrained-3%", retrained(d / "t3.onnx", 0.03), LABELS),
            ("labels-shuffled", NANODET, shuffled_labels(d / "shuffled.names")),
            ("normalisation", wrong_normalisation(d / "n.onnx"), LABELS),
            ("input-size", wrong_input_size(d / "s.onnx"), LABELS),
        ]
        print(f"{len(frames)} frames of {CLIP.name} (every {args.every}), score >= {SCORE}")
        for name, path, labels in cases:
            a = agreement(path, labels, frames)
            print(f"{name:16s} map50 {a['map50']:.3f}  mean_iou {a['mean_iou']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
