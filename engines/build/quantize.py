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

Calibration and Q/DQ placement are ONNX Runtime's quantiser (quantize_static), calibrated in chunks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
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
from engines.errors import BuildError
from engines.store import sha256_file
from engines.store.fsutil import atomic_write_bytes, fsync_dir, temp_path_for

log = logging.getLogger("engines.quantize")

Method = Literal["entropy", "minmax", "percentile"]
METHODS: tuple[str, ...] = ("entropy", "minmax", "percentile")
DEFAULT_OP_TYPES: tuple[str, ...] = ("Conv",)
QUANTIZABLE_OP_TYPES: frozenset[str] = frozenset({"Conv", "Gemm", "MatMul"})
# Calibration runs in chunks of this many frames: ORT's histogram calibrators hold every calibrated tensor
# of every frame handed to one collect_data() call (~60 MB a NanoDet-416 frame), so memory is bounded by
# the chunk, not the sample count. ORT's own CalibMaxIntermediateOutputs is unusable in 1.31: MinMax
# clears each full chunk *without* reducing it (only the last partial chunk counts) and the histogram
# calibrators never receive the option.
CALIB_CHUNK_FRAMES = 8
# ORT's Entropy calibrator defaults to num_bins == num_quantized_bins == 128, which leaves exactly one
# candidate threshold (the whole histogram): "entropy" then equals minmax bit for bit, and
# quantize_static offers no option to change it. 1024 bins give 449 candidates down to 1/8 of the max.
ENTROPY_BINS = 1024
ENTROPY_QUANTIZED_BINS = 128
STEM_LAYERS = 2
# Bump when the recipe (placement, exclusions, settings) changes: cached Q/DQ models are rebuilt.
RECIPE = "ort-qdq-sym-perchannel-nobias/stem2-heads/4"  # 2: real entropy; 4: optional folding


class QuantizationError(BuildError):
    """Quantisation failed; the message names the ONNX file and the step."""


# ---- graph analysis ---------------------------------------------------------------------------


def onnx_input(model: onnx.ModelProto, where: str) -> tuple[str, tuple[int | None, ...]]:
    """The single image input (initializers excluded): name and dims (None = dynamic)."""
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise QuantizationError(f"{where}: expected exactly one input, found {[i.name for i in inputs]}")
    dims = tuple(
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
        for d in inputs[0].type.tensor_type.shape.dim
    )
    return inputs[0].name, dims


def sensitive_nodes(
    model: onnx.ModelProto, op_types: Iterable[str] = DEFAULT_OP_TYPES, stem_layers: int = STEM_LAYERS
) -> list[str]:
    """Quantisable nodes that should stay float: the stem and the output heads.

    Stem: quantisable nodes at most `stem_layers` quantisable layers deep from the image input
    (through Pad, Cast, MaxPool, ...). They see raw pixel statistics, were the most sensitive layers
    of NanoDet in a per-layer sweep, and have few channels, so keeping them float costs little.
    Heads: quantisable nodes that reach a graph output through non-quantisable ops only (the
    Split/Sigmoid/Reshape after the last convs). Found from the graph, so meaningless exported names
    (tf2onnx's `Conv__145`) do not matter.
    """
    ops = set(op_types)
    nodes = list(model.graph.node)  # ONNX requires topological order
    inits = {i.name for i in model.graph.initializer}
    # Quantisable-layer depth of every image-derived tensor (constants stay absent).
    depth: dict[str, int] = {i.name: 0 for i in model.graph.input if i.name not in inits}
    found: list[str] = []
    for n in nodes:
        d_in = max((depth[t] for t in n.input if t in depth), default=None)
        if d_in is None:
            continue
        d_out = d_in + 1 if n.op_type in ops else d_in
        if n.op_type in ops and d_out <= stem_layers and n.name:
            found.append(n.name)
        for t in n.output:
            depth[t] = d_out

    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for inp in n.input:
            consumers.setdefault(inp, []).append(n)
    graph_outputs = {o.name for o in model.graph.output}

    def reaches_output(start: Iterable[str]) -> bool:
        seen: set[str] = set()
        stack = list(start)
        while stack:
            t = stack.pop()
            if t in graph_outputs:
                return True
            if t in seen:
                continue
            seen.add(t)
            for nxt in consumers.get(t, []):
                if nxt.op_type not in ops:  # another quantisable layer stops the walk
                    stack.extend(nxt.output)
        return False

    for n in nodes:
        if n.op_type in ops and n.name and n.name not in found and reaches_output(n.output):
            found.append(n.name)
    return found


def resolve_exclusions(
    model: onnx.ModelProto, patterns: Iterable[str], op_types: Iterable[str], where: str
) -> list[str]:
    """Node names matching names or fnmatch patterns among the quantisable nodes; unknown names fail."""
    ops = set(op_types)
    names = [n.name for n in model.graph.node if n.op_type in ops and n.name]
    out: list[str] = []
    for pat in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise QuantizationError(
                f"{where}: exclude pattern {pat!r} matches no {'/'.join(sorted(ops))} node "
                f"(e.g. {', '.join(names[:3])})"
            )
        out.extend(h for h in hits if h not in out)
    return out


# ---- calibration data -------------------------------------------------------------------------


class _Reader:
    """ORT CalibrationDataReader over NCHW batches, re-chunked to the model's fixed batch dim."""

    def __init__(self, input_name: str, fixed_batch: int | None, batches: Iterable[np.ndarray]) -> None:
        self.input_name = input_name
        self.samples = 0
        self._it = self._feeds(fixed_batch, batches)

    def _feeds(self, fixed: int | None, batches: Iterable[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for batch in batches:
            batch = np.ascontiguousarray(batch, dtype=np.float32)
            if batch.ndim != 4:
                raise QuantizationError(f"calibration batch has shape {batch.shape}; expected NCHW")
            self.samples += batch.shape[0]
            if fixed is None:
                yield {self.input_name: batch}
                continue
            # A partial last chunk is dropped rather than zero-padded: zeros would skew the ranges.
            for i in range(0, batch.shape[0] - fixed + 1, fixed):
                yield {self.input_name: batch[i : i + fixed]}

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


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
    reader = _Reader(input_name, fixed, itertools.chain([first], it))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dst)
    try:
        # ORT prints calibration progress to stdout (would corrupt `validate --json`) and logs a
        # "consider pre-processing" warning on the root logger every call: send both to our log.
        with contextlib.redirect_stdout(_LogWriter()), _quiet_root(_ORT_NOISE):
            _quantize_ort(folded, tmp, reader, method, excluded, op_types, percentile)
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


class _FeedReader:
    """ORT CalibrationDataReader over an iterator of feeds (one calibration chunk)."""

    def __init__(self, feeds: Iterator[dict[str, np.ndarray]]) -> None:
        self._feeds = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def _chunk(
    first: dict[str, np.ndarray], feeds: Iterator[dict[str, np.ndarray]], input_name: str, frames: int
) -> Iterator[dict[str, np.ndarray]]:
    """`first` and then further feeds of the shared iterator until about `frames` frames were given."""
    yield first
    n = first[input_name].shape[0]
    while n < frames and (feed := next(feeds, None)) is not None:
        n += feed[input_name].shape[0]
        yield feed


def calibrator_options(method: str, percentile: float) -> dict[str, Any]:
    """create_calibrator's extra_options: what quantize_static derives from our extra_options, plus bins.

    CalibTensorRangeSymmetric -> symmetric and CalibPercentile -> percentile (quantize_static's own
    mapping); num_bins only for entropy, which quantize_static cannot set (see ENTROPY_BINS).
    """
    opts: dict[str, Any] = {"symmetric": True, "percentile": percentile}
    if method == "entropy":
        opts |= {"num_bins": ENTROPY_BINS, "num_quantized_bins": ENTROPY_QUANTIZED_BINS}
    return opts


def _quantize_ort(
    src: Path,
    out: Path,
    reader: _Reader,
    method: str,
    excluded: list[str],
    op_types: tuple[str, ...],
    percentile: float,
    chunk_frames: int | None = None,
) -> None:
    """Calibrate chunk by chunk with ORT's own calibrator, then quantise with quantize_static.

    Equivalent to quantize_static(calibration_data_reader=reader) except for memory: quantize_static
    feeds the whole reader to one collect_data() call. collect_data() may be called repeatedly (MinMax
    merges each call's min/max into its running range, the histogram calibrators merge histograms),
    so chunks keep peak memory at about `chunk_frames` frames of intermediate tensors. The ranges
    reach the quantiser through quantize_static's public calibration cache (calibration_cache_path,
    ORT >= 1.31), so Q/DQ placement and every quantiser option stay exactly quantize_static's.
    MinMax ranges equal the one-pass ones exactly. Histograms are merged onto the first chunk's bin
    width, so percentile/entropy thresholds can differ from a one-pass histogram by a bin or so
    (entropy more for tensors whose KL minimum is flat; tests/test_quantize_memory.py).
    """
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    calib = {
        "entropy": CalibrationMethod.Entropy,
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    extra = {
        "ActivationSymmetric": True,  # TensorRT: zero point must be 0
        "WeightSymmetric": True,
        "QuantizeBias": False,  # Int32 bias DQ is rejected by TensorRT's parser
        "CalibTensorRangeSymmetric": True,
        "CalibPercentile": percentile,
    }
    common: dict[str, Any] = {
        "model_input": str(src),
        "model_output": str(out),
        "quant_format": QuantFormat.QDQ,
        "op_types_to_quantize": list(op_types),
        "per_channel": True,
        "reduce_range": False,
        "activation_type": QuantType.QInt8,
        "weight_type": QuantType.QInt8,
        "nodes_to_exclude": excluded,
        "calibrate_method": calib,
        "extra_options": extra,
    }
    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        # ORT < 1.31 has no public way to hand precomputed ranges to quantize_static.
        log.warning(
            "onnxruntime %s: calibrating in one pass (memory grows with the sample count; entropy "
            "uses ORT's 128-bin default, which equals minmax); onnxruntime >= 1.31 calibrates in chunks",
            onnxruntime.__version__,
        )
        quantize_static(calibration_data_reader=reader, **common)
        return

    from onnxruntime.quantization.calibrate import TensorsData, create_calibrator, save_tensors_data
    from onnxruntime.quantization.quant_utils import update_opset_version

    with tempfile.TemporaryDirectory(prefix="edge-agent-calib.") as tmp:
        # quantize_static calibrates the opset-updated model when it has to update it (opset < 10).
        calib_src = src
        model = onnx.load(str(src))
        updated = update_opset_version(model, QuantType.QInt8, QuantType.QInt8)
        if updated is not model:
            calib_src = Path(tmp) / "model_input.onnx"
            onnx.save_model(updated, str(calib_src), save_as_external_data=True)
        del model, updated
        calibrator = create_calibrator(
            calib_src,
            list(op_types),
            augmented_model_path=str(Path(tmp) / "augmented_model.onnx"),
            calibrate_method=calib,
            extra_options=calibrator_options(method, percentile),
        )
        chunk_frames = chunk_frames or CALIB_CHUNK_FRAMES  # looked up late: tests shrink it
        feeds = iter(reader.get_next, None)
        chunks = 0
        while (first := next(feeds, None)) is not None:
            calibrator.collect_data(_FeedReader(_chunk(first, feeds, reader.input_name, chunk_frames)))
            chunks += 1
        if chunks == 0:
            raise QuantizationError(f"{src}: no calibration batch filled the model's fixed batch dimension")
        ranges = calibrator.compute_data()
        if not isinstance(ranges, TensorsData):
            raise QuantizationError(f"{src}: calibrator returned {type(ranges).__name__}, not TensorsData")
        del calibrator  # its session and histograms are not needed while quantising
        log.debug(
            "calibrated %d tensors in %d chunks of <= %d frames", len(ranges.data), chunks, chunk_frames
        )
        # A JSON round trip of float32 values is exact: the quantiser sees the very same ranges.
        cache = Path(tmp) / "ranges.json"
        save_tensors_data(ranges, cache)
        del ranges
        quantize_static(calibration_data_reader=None, calibration_cache_path=cache, **common)
