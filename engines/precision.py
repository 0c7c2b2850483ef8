"""Precision: how a requested precision becomes a network TensorRT builds.

    prepared = prepare_model(api, onnx_path, "fp16")

Strongly typed flavours (TensorRT-RTX, TensorRT 11) take precision from the graph: FP16 means
converting the ONNX with onnxconverter-common (`keep_io_types=True`, so the engine still takes and
returns float32 like the ONNX Runtime fallback); INT8 means the caller's Q/DQ ONNX (engines.build.quantize).
Weakly typed TensorRT (<= 10) keeps the FP32 graph and sets builder flags: FP16, or INT8 + FP16 with a
calibrator (engines.build.calibrator) - or, given a Q/DQ ONNX there too, INT8 + FP16 without a calibrator.
`best` is the agent's to resolve (accuracy gate) before anything is built: refused here.

The precision names live here too, typed and parsed once where they enter (config, CLI, a JSON request):

    precision: Precision = parse_precision(text, "--precision")   # ValueError naming where, else typed
    built: Built = "fp16"                                          # what an engine is; never `best`

Light on purpose (onnx is imported where a graph is converted): the config imports these names.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from engines.errors import BuildError, UnavailableError

if TYPE_CHECKING:
    from engines.trt import TrtApi

log = logging.getLogger("engines.precision")

Precision = Literal["fp32", "fp16", "int8", "best"]  # what a model may ask for (models.M.precision)
Built = Literal["fp32", "fp16", "int8"]  # what an engine is built as: `best` resolved by the accuracy gate
REQUESTABLE: tuple[Precision, ...] = get_args(Precision)
ORDER: tuple[Built, ...] = ("int8", "fp16", "fp32")  # most reduced first; fp32 is the reference


def parse_precision(value: object, where: str = "precision") -> Precision:
    """`value` as a Precision; ValueError naming `where` otherwise. Called where a precision enters."""
    for precision in REQUESTABLE:
        if value == precision:
            return precision
    raise ValueError(f"{where}: {value!r} is not one of {', '.join(REQUESTABLE)}")


@dataclass(frozen=True)
class PreparedModel:
    onnx_path: Path
    model_bytes: bytes | None  # a converted graph; None: parse onnx_path itself
    builder_flag: Built  # precision flag for weakly typed builders ("fp32": none)
    precision: Built
    quantized: bool = False  # onnx_path is a Q/DQ graph (explicit quantisation: scales in the graph)
    calibrate: bool = False  # weakly typed implicit INT8: needs a calibrator (or a reusable cache)


def refuse_best(precision: Precision, model: str | Path) -> Built:
    if precision == "best":
        raise BuildError(
            f"precision 'best' of {model} must be resolved by the agent's accuracy gate "
            "(int8 -> fp16 -> fp32) before building; the builder builds fp32, fp16 or int8 only"
        )
    return precision


def require_precision(api: TrtApi, precision: Precision, what: str | Path) -> Built:
    """The precision to build; BuildError for `best`, UnavailableError where this TensorRT cannot."""
    built = refuse_best(precision, what)
    if built not in api.precisions():
        raise UnavailableError(
            f"precision {built!r} is not available on {api.flavor} {api.version} "
            f"(this build of the engine manager supports {', '.join(api.precisions())})"
        )
    return built


def prepare_model(
    api: TrtApi, onnx_path: Path, requested: Precision, *, qdq_onnx: Path | None = None
) -> PreparedModel:
    precision = require_precision(api, requested, onnx_path)
    if precision == "int8":
        return _prepare_int8(api, onnx_path, qdq_onnx)
    if precision == "fp32":
        return PreparedModel(onnx_path, None, "fp32", precision)
    if api.weakly_typed:
        return PreparedModel(onnx_path, None, precision, precision)
    return PreparedModel(onnx_path, convert_fp16(onnx_path), "fp32", precision)


def _prepare_int8(api: TrtApi, onnx_path: Path, qdq_onnx: Path | None) -> PreparedModel:
    if qdq_onnx is not None:
        if not qdq_onnx.is_file():
            raise BuildError(f"qdq_onnx {qdq_onnx} (INT8 model for {onnx_path}) does not exist")
        # Weakly typed builders still need the INT8 flag to accept Q/DQ layers; strongly typed need none.
        return PreparedModel(qdq_onnx, None, "int8" if api.weakly_typed else "fp32", "int8", quantized=True)
    if api.strongly_typed:
        raise UnavailableError(
            f"precision 'int8' on {api.label} needs a Q/DQ ONNX of {onnx_path} (BuildSettings.qdq_onnx, "
            "made by engines.build.quantize): strongly typed TensorRT has no calibrators"
        )
    return PreparedModel(onnx_path, None, "int8", "int8", calibrate=True)


def convert_fp16(onnx_path: Path) -> bytes:
    """FP16 copy of the graph with float32 inputs/outputs (casts inserted at the edges)."""
    import onnx

    from engines.build import islands

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
    try:
        parts = islands.split(model)  # an FP32 island (e.g. grafted NMS) is converted around, not through
    except islands.IslandError as e:
        raise BuildError(f"FP16 conversion of {onnx_path}: {e}") from e
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            converted = float16.convert_float_to_float16(parts[0] if parts else model, keep_io_types=True)
        except Exception as e:
            raise BuildError(f"FP16 conversion of {onnx_path} failed: {e}") from e
    if parts:
        converted = islands.join(converted, parts[1])
    if caught:
        # Constants outside the FP16 range get clamped; worth a line, not one per constant.
        log.info(
            "fp16 conversion of %s clamped %d constants (e.g. %s)", onnx_path, len(caught), caught[0].message
        )
    return converted.SerializeToString()
