"""INT8 post-training quantisation to a TensorRT-compatible Q/DQ ONNX.

    info = make_qdq_onnx(src, dst, batches, "entropy")   # {method, samples, sha256, excluded, ...}

The Q/DQ graph is what strongly typed TensorRT (RTX, 11) builds INT8 from, and what ONNX Runtime runs
for the accuracy gate. Settings follow TensorRT's explicit-quantisation rules: symmetric int8
activations and weights (TensorRT supports zero point 0 only), per-channel weights, bias left in float
(an Int32 DequantizeLinear on the bias is rejected by the parser, FEASIBILITY.md), Q/DQ only around
Conv by default (ORT's Entropy calibration of every op hit inf ranges on NanoDet).

Sensitive nodes are kept in float: by default the first quantisable layer (it sees raw pixel ranges)
and the output heads (class scores and box distributions are decoded with thresholds / softmax).
Exported names are often meaningless (tf2onnx: `Conv__145`), so they are found from the graph
structure; `exclude_nodes` adds names or fnmatch patterns on top.

Calibration and Q/DQ placement are ONNX Runtime's quantiser (quantize_static), calibrated in chunks
(engines.build.ort_calibration); which nodes stay float: engines.build.qdq_nodes.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from engines.build import islands
from engines.build.ort_calibration import BatchReader, quantize_ort
from engines.build.qdq_nodes import (
    DEFAULT_OP_TYPES,
    QuantizationError,
    onnx_input,
    resolve_exclusions,
    sensitive_nodes,
)
from engines.store import sha256_file
from engines.store.fsutil import atomic_write_bytes, fsync_dir, temp_path_for

log = logging.getLogger("engines.quantize")

Method = Literal["entropy", "minmax", "percentile"]
METHODS: tuple[str, ...] = ("entropy", "minmax", "percentile")
QUANTIZABLE_OP_TYPES: frozenset[str] = frozenset({"Conv", "Gemm", "MatMul"})
# Bump when the recipe (placement, exclusions, settings) changes: cached Q/DQ models are rebuilt.
RECIPE = "ort-qdq-sym-perchannel-nobias/stem2-heads/4"  # 2: real entropy; 4: optional folding


sha256_of = sha256_file  # the store's streaming hash, under the name the gate uses


class _LogWriter(io.TextIOBase):
    def write(self, text: str) -> int:
        if text.strip():
            log.debug("quantiser: %s", text.strip())
        return len(text)


_ORT_NOISE = ("pre-process",)


@contextlib.contextmanager
def _quiet_root(fragments: tuple[str, ...]) -> Iterator[None]:
    def keep(record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in fragments)

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


# ---- the quantiser ----------------------------------------------------------------------------


def make_qdq_onnx(
    src: Path,
    dst: Path,
    batches: Iterable[np.ndarray],
    method: Method = "entropy",
    exclude_nodes: list[str] | None = None,
    percentile: float = 99.99,
    *,
    op_types: Iterable[str] = DEFAULT_OP_TYPES,
    auto_exclude: bool = True,
    fold: bool = False,
) -> dict[str, Any]:
    """Write an INT8 Q/DQ copy of `src` to `dst` (atomically), calibrated on `batches`.

    `fold`: quantise the graph after ONNX Runtime's basic optimisations (see fold_graph). Off by
    default: on the bundled NanoDet, the folded Q/DQ model agrees less with FP32 (mAP50 0.84 vs 0.97,
    minmax, 100 calibration / 40 held-out frames), so it is only the fallback for a TensorRT that
    cannot build the unfolded one.

    `batches`: preprocessed float32 NCHW arrays (any batch size; re-chunked to a fixed ONNX batch).
    `exclude_nodes`: node names or fnmatch patterns kept float, added to the automatically found
    sensitive nodes (first layer, output heads) unless `auto_exclude` is False.
    Returns {method, samples, sha256, percentile, op_types, excluded, recipe, folded}.
    """
    src, dst = Path(src), Path(dst)
    if method not in METHODS:
        raise QuantizationError(f"calibration method {method!r} is not one of {list(METHODS)}")
    op_types = tuple(op_types)
    bad = set(op_types) - QUANTIZABLE_OP_TYPES
    if bad:
        raise QuantizationError(f"op types {sorted(bad)} cannot be quantised here (use Conv/Gemm/MatMul)")
    if not 0.0 < percentile <= 100.0:
        raise QuantizationError(f"percentile must be in (0, 100], got {percentile}")
    if not src.is_file():
        raise QuantizationError(f"ONNX model {src} does not exist")
    with tempfile.TemporaryDirectory(prefix="edge-agent-qdq-") as work:
        # An FP32 island (engines.build.islands: grafted decode + NMS) is quantised around: the rest alone is
        # folded and quantised, then the island goes back unchanged.
        base, island = _without_island(src, Path(work))
        target = dst if island is None else Path(work) / "qdq-base.onnx"
        graph = base
        if fold:
            graph = Path(work) / "folded.onnx"
            fold_graph(base, graph)
        info = _make_qdq(
            src, graph, target, batches, method, exclude_nodes, percentile, op_types, auto_exclude
        )
        if island is not None:
            atomic_write_bytes(dst, islands.join(onnx.load(str(target)), island).SerializeToString())
            info["sha256"] = sha256_file(dst)
        return {**info, "folded": fold}


def _without_island(src: Path, work: Path) -> tuple[Path, islands.Island | None]:
    """(src, None) for a graph without an FP32 island; else (the rest written to `work`, the island)."""
    try:
        parts = islands.split(onnx.load(str(src)))
    except islands.IslandError as e:
        raise QuantizationError(f"{src}: {e}") from e
    except Exception as e:
        raise QuantizationError(f"cannot read ONNX model {src}: {e}") from e
    if parts is None:
        return src, None
    base = work / "base.onnx"
    onnx.save(parts[0], str(base))
    return base, parts[1]


def fold_graph(src: Path, out: Path) -> None:
    """Fold constant and shape subgraphs with ONNX Runtime's basic (EP-independent) optimisations.

    Why: tf2onnx exports carry Pad/ScatterND/shape arithmetic around the convolutions; quantised as they
    are, TensorRT-RTX 1.7 fails to build the Q/DQ graph (internal assertion), folded it builds. The
    basic level only emits standard ONNX ops; the float graph computes the same, but its Q/DQ version
    measured less accurate here (see make_qdq_onnx), hence opt-in.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out)
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types; name the file
        raise QuantizationError(f"cannot prepare {src} for quantisation (ONNX Runtime: {e})") from e


def _make_qdq(
    src: Path,
    folded: Path,
    dst: Path,
    batches: Iterable[np.ndarray],
    method: Method,
    exclude_nodes: list[str] | None,
    percentile: float,
    op_types: tuple[str, ...],
    auto_exclude: bool,
) -> dict[str, Any]:
    try:
        model = onnx.load(str(folded))
    except Exception as e:
        raise QuantizationError(f"cannot read ONNX model {src}: {e}") from e
    input_name, dims = onnx_input(model, str(src))
    fixed = dims[0] if dims else None
    excluded = sensitive_nodes(model, op_types) if auto_exclude else []
    for name in resolve_exclusions(model, exclude_nodes or [], op_types, str(src)):
        if name not in excluded:
            excluded.append(name)
    it = iter(batches)
    first = next(it, None)
    if first is None:
        raise QuantizationError(f"{src}: no calibration samples were given (empty calibration set?)")
    reader = BatchReader(input_name, fixed, itertools.chain([first], it))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dst)
    try:
        # ORT prints calibration progress to stdout (would corrupt `validate --json`) and logs a
        # "consider pre-processing" warning on the root logger every call: send both to our log.
        with contextlib.redirect_stdout(_LogWriter()), _quiet_root(_ORT_NOISE):
            quantize_ort(folded, tmp, reader, method, excluded, op_types, percentile)
        if reader.samples == 0:
            raise QuantizationError(f"{src}: no calibration samples were given")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except QuantizationError:
        raise
    except Exception as e:  # ORT raises plain exceptions; name the files
        raise QuantizationError(f"INT8 quantisation of {src} -> {dst} failed: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dst.parent)
    info = {
        "method": method,
        "samples": reader.samples,
        "sha256": sha256_of(dst),
        "percentile": percentile if method == "percentile" else None,
        "op_types": list(op_types),
        "excluded": excluded,
        "recipe": RECIPE,
    }
    log.info("INT8 Q/DQ %s from %s: %s", dst, src, info)
    return info
