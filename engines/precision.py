"""Precision: how a requested precision becomes a network TensorRT builds.

    prepared = prepare_model(api, onnx_path, "fp16")

Strongly typed flavours (TensorRT-RTX, TensorRT 11) take precision from the graph: FP16 means
converting the ONNX with onnxconverter-common (`keep_io_types=True`, so the engine still takes and
returns float32 like the ONNX Runtime fallback). Weakly typed TensorRT (<= 10) keeps the FP32 graph
and sets the FP16 builder flag. int8/best arrive with the precision issue (calibration + accuracy gate).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx

from engines.errors import BuildError, UnavailableError
from engines.trt_api import TrtApi

log = logging.getLogger("engines.precision")


@dataclass(frozen=True)
class PreparedModel:
    onnx_path: Path
    model_bytes: bytes | None  # a converted graph; None: parse onnx_path itself
    builder_flag: str  # precision flag for weakly typed builders ("fp32": none)
    precision: str


def prepare_model(api: TrtApi, onnx_path: Path, precision: str) -> PreparedModel:
    if precision not in api.precisions():
        raise UnavailableError(
            f"precision {precision!r} is not available on {api.flavor} {api.version} "
            f"(this build of the engine manager supports {', '.join(api.precisions())})"
        )
    if precision == "fp32":
        return PreparedModel(onnx_path, None, "fp32", precision)
    if api.weakly_typed:
        return PreparedModel(onnx_path, None, precision, precision)
    return PreparedModel(onnx_path, convert_fp16(onnx_path), "fp32", precision)


def convert_fp16(onnx_path: Path) -> bytes:
    """FP16 copy of the graph with float32 inputs/outputs (casts inserted at the edges)."""
    try:
        from onnxconverter_common import float16
    except ImportError as e:
        raise UnavailableError(
            "FP16 on a strongly typed TensorRT needs onnxconverter-common (pip install onnxconverter-common)"
        ) from e
    try:
        model = onnx.load(str(onnx_path))
    except Exception as e:
        raise BuildError(
            f"cannot read ONNX model {onnx_path}: not a valid ONNX file (truncated?): {e}"
        ) from e
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            converted = float16.convert_float_to_float16(model, keep_io_types=True)
        except Exception as e:
            raise BuildError(f"FP16 conversion of {onnx_path} failed: {e}") from e
    if caught:
        # Constants outside the FP16 range get clamped; worth a line, not one per constant.
        log.info(
            "fp16 conversion of %s clamped %d constants (e.g. %s)", onnx_path, len(caught), caught[0].message
        )
    return converted.SerializeToString()
