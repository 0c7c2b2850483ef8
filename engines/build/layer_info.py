"""What a built TensorRT engine is made of, layer by layer: names, types, precisions, tactics.

    layers = layers_from_inspector(json_text)     # IEngineInspector.get_engine_information(JSON)
    layers = layers_from_build_log(text)          # the builder's verbose "Layers:" block (TensorRT-RTX)
    summarize(layers, "inspector")                # the manifest's build.layers: {total, precisions, source}

Two sources of the same information, both only as detailed as the build's profiling verbosity (the
builder sets ProfilingVerbosity.DETAILED where it exists):
- the engine inspector (TensorRT docs: `ICudaEngine.create_engine_inspector()`,
  `get_engine_information(LayerInformationFormat.JSON)` -> {"Layers": [...], "Bindings": [...]}); it needs
  a deserialised engine, hence a GPU (engines.runtimes.trt_layers);
- the builder's own log: TensorRT-RTX 1.7 logs, at VERBOSE and only with DETAILED verbosity, one message
  "Layers:" followed by one line per engine layer in the inspector's ONELINE format
  ("Name: ..., LayerType: ..., Inputs: [ { Name: ..., Datatype: Float, ... } ], ..., TacticName: ...").
  That is what runs on this project's CPU-only CI (measured, not documented by NVIDIA).

A layer's precision is the data type of its first input, as NVIDIA's TensorRT Engine Explorer (trex)
counts it: an INT8 convolution reads INT8; a layer without inputs (constants, synchronisation markers)
has none ("none" in the summary). Integer inputs other than INT8/INT4 are shape or index arithmetic
("other"). Pure functions: testable on any text.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

# Always present in a summary (0 when absent), so consumers can read them without a default.
MAIN_PRECISIONS = ("FP32", "FP16", "INT8")
SOURCES = ("inspector", "build_log")
# Data type words in the inspector's "Format/Datatype" ("Channel major FP16 format ...", "Half") or RTX's
# "Datatype" ("Float", "Int8"). Order matters: UINT8 contains INT8, BFLOAT16 contains FLOAT.
_PRECISION_WORDS: tuple[tuple[str, str], ...] = (
    ("BFLOAT16", "BF16"),
    ("BF16", "BF16"),
    ("FP8", "FP8"),
    ("E4M3", "FP8"),
    ("FP4", "FP4"),
    ("E2M1", "FP4"),
    ("UINT8", "other"),
    ("INT8", "INT8"),
    ("INT4", "INT4"),
    ("FP16", "FP16"),
    ("HALF", "FP16"),
    ("FP32", "FP32"),
    ("FLOAT", "FP32"),
)
BUILD_LOG_MARK = "Layers:"
_ONELINE = re.compile(r"^Name: (?P<name>.*?), LayerType: (?P<type>[^,]*), Inputs: \[(?P<rest>.*)$")
_AFTER_INPUTS = re.compile(r"\], (?:Constants|Outputs): \[")
_DATATYPE = re.compile(r"(?:Format/)?Datatype: (?P<dtype>[^,}]+)")
_TACTIC = re.compile(r"Tactic(?:Name|Value): (?P<tactic>[^,]*)")
# Where a layer came from: "[ONNX Layer: Conv__145][ONNX Layer: .../LeakyRelu_1]" (inspector "Metadata").
_ONNX_NODE = re.compile(r"\[ONNX Layer: (?P<node>[^\]]*)\]")


class LayerInfoError(ValueError):
    """Layer information that cannot be read; the message says what was expected."""


@dataclass(frozen=True)
class EngineLayer:
    name: str
    type: str  # the inspector's LayerType ("CaskConvolution", RTX "runtime_fusion", ...); "" if unknown
    precision: str  # FP32 | FP16 | BF16 | FP8 | FP4 | INT8 | INT4 | other | none | unknown
    tactic: str | None = None  # None where TensorRT names none (RTX fusions compiled at run time)
    onnx_nodes: tuple[str, ...] = ()  # the ONNX nodes fused into this layer, from its metadata


def _tactic(value: Any) -> str | None:
    return None if value is None else (str(value).strip() or None)


def _onnx_nodes(metadata: Any) -> tuple[str, ...]:
    return tuple(m["node"] for m in _ONNX_NODE.finditer(str(metadata or "")))


def precision_of(datatype: str | None) -> str:
    """FP32/FP16/INT8/... from a data type or format description; "none" without one."""
    if not datatype:
        return "none"
    text = datatype.upper()
    return next((p for word, p in _PRECISION_WORDS if word in text), "other")


def _from_dict(d: dict[str, Any]) -> EngineLayer:
    inputs = d.get("Inputs") or []
    first = inputs[0] if inputs and isinstance(inputs[0], dict) else {}
    dtype = first.get("Format/Datatype") or first.get("Datatype")
    return EngineLayer(
        str(d.get("Name", "")),
        str(d.get("LayerType", "")),
        precision_of(str(dtype)) if inputs else "none",
        _tactic(d.get("TacticName") or d.get("TacticValue")),
        _onnx_nodes(d.get("Metadata")),
    )


def layers_from_inspector(text: str) -> list[EngineLayer]:
    """Layers of `get_engine_information(LayerInformationFormat.JSON)`. Built with LAYER_NAMES_ONLY the
    inspector gives names only: their precision is "unknown"."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise LayerInfoError(f"engine inspector output is not JSON: {e}") from e
    raw = data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(raw, list):
        raise LayerInfoError("engine inspector output has no 'Layers' list")
    return [
        _from_dict(item) if isinstance(item, dict) else EngineLayer(str(item), "", "unknown") for item in raw
    ]


def layers_from_build_log(text: str) -> list[EngineLayer]:
    """Layers of the builder's "Layers:" message (ONELINE format, one layer per line)."""
    out = []
    for line in text.splitlines():
        m = _ONELINE.match(line)
        if m is None:
            continue
        inputs = _AFTER_INPUTS.split(m["rest"], maxsplit=1)[0]
        dtype = _DATATYPE.search(inputs)
        tactic = _TACTIC.search(line)
        out.append(
            EngineLayer(
                m["name"],
                m["type"].strip(),
                precision_of(dtype["dtype"].strip()) if dtype else "none",
                _tactic(tactic["tactic"]) if tactic else None,
                _onnx_nodes(line),
            )
        )
    return out


def summarize(layers: list[EngineLayer], source: str) -> dict[str, Any]:
    """The manifest's `build.layers`: {total, precisions {FP32, FP16, INT8, ...: count}, source}."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    counts = Counter(layer.precision for layer in layers)
    precisions = {p: counts.pop(p, 0) for p in MAIN_PRECISIONS}
    precisions.update(sorted(counts.items()))
    return {"total": len(layers), "precisions": precisions, "source": source}


def check_summary(value: Any) -> str | None:
    """None when `value` is a valid layer summary, else what is wrong with it (for the manifest check)."""
    if not isinstance(value, dict):
        return "must be an object"
    total, precisions = value.get("total"), value.get("precisions")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        return "'total' must be a non-negative integer"
    if not isinstance(precisions, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in precisions.items()
    ):
        return "'precisions' must map precision names to counts"
    if sum(precisions.values()) != total:
        return f"'precisions' add up to {sum(precisions.values())}, not 'total' {total}"
    return None
