"""ONNX Runtime's quantiser, calibrated chunk by chunk: memory is bounded by the chunk, not the samples.

    reader = BatchReader(input_name, fixed_batch, batches)
    quantize_ort(src, out, reader, "entropy", excluded, ("Conv",), 99.99)

engines.build.quantize drives it (the Q/DQ recipe, exclusions, FP32 islands, the atomic write).
"""

from __future__ import annotations

import inspect
import logging
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from engines.build.qdq_nodes import QuantizationError

log = logging.getLogger("engines.quantize")

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


class BatchReader:
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


def quantize_ort(
    src: Path,
    out: Path,
    reader: BatchReader,
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
    from onnxruntime.quantization import QuantType, quantize_static

    common = _quantize_options(src, out, method, excluded, op_types, percentile)
    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        # ORT < 1.31 has no public way to hand precomputed ranges to quantize_static.
        log.warning(
            "onnxruntime %s: calibrating in one pass (memory grows with the sample count; entropy "
            "uses ORT's 128-bin default, which equals minmax); onnxruntime >= 1.31 calibrates in chunks",
            onnxruntime.__version__,
        )
        quantize_static(calibration_data_reader=reader, **common)
        return

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
        cache = _calibrate(
            src, calib_src, Path(tmp), reader, common, op_types, method, percentile, chunk_frames
        )
        quantize_static(calibration_data_reader=None, calibration_cache_path=cache, **common)


def _quantize_options(
    src: Path, out: Path, method: str, excluded: list[str], op_types: tuple[str, ...], percentile: float
) -> dict[str, Any]:
    """quantize_static's arguments (bar the calibration data): TensorRT's explicit-quantisation rules."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

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
    return common


def _calibrate(
    src: Path,
    calib_src: Path,
    tmp: Path,
    reader: BatchReader,
    common: dict[str, Any],
    op_types: tuple[str, ...],
    method: str,
    percentile: float,
    chunk_frames: int | None,
) -> Path:
    """The ranges of `calib_src` over the reader's batches, chunk by chunk, saved where quantize_static's
    calibration_cache_path reads them (in `tmp`)."""
    from onnxruntime.quantization.calibrate import TensorsData, create_calibrator, save_tensors_data

    calibrator = create_calibrator(
        calib_src,
        list(op_types),
        augmented_model_path=str(tmp / "augmented_model.onnx"),
        calibrate_method=common["calibrate_method"],
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
    log.debug("calibrated %d tensors in %d chunks of <= %d frames", len(ranges.data), chunks, chunk_frames)
    # A JSON round trip of float32 values is exact: the quantiser sees the very same ranges.
    cache = tmp / "ranges.json"
    save_tensors_data(ranges, cache)
    return cache
