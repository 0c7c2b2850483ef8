"""Which layers to keep out of INT8 in a calibrated (weakly typed) INT8 build.

    keep = select_layers(layers, outputs, ("@first_conv", "@head", r"(?i)sigmoid|softmax"))
    # {layer index: "@first_conv" | "@head" | the regex that matched}

Patterns are regular expressions searched in TensorRT layer names (ONNX node names after parsing),
plus two structural selectors, because detector layer names depend on the exporter:
- "@first_conv": the first convolution in network order (it sees near-raw pixels; INT8 hurts most there).
- "@head": walking back from each network output through layers that only reshape, slice, concatenate,
  activate or cast, everything up to and including the first convolution/matmul met. These are the box and
  score heads whose small errors move boxes and thresholds.
Only layers whose outputs are all float can take a precision; others (shape arithmetic) are skipped.
Pure functions over engines.trt.LayerInfo: testable on any network description.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from engines.trt import LayerInfo

COMPUTE = frozenset({"CONVOLUTION", "DECONVOLUTION", "MATRIX_MULTIPLY", "FULLY_CONNECTED"})
# Layers a head passes through between its last convolution and the network output.
PASS_THROUGH = frozenset(
    {
        "SHUFFLE",
        "SLICE",
        "CONCATENATION",
        "ACTIVATION",
        "SOFTMAX",
        "CAST",
        "IDENTITY",
        "ELEMENTWISE",
        "SCALE",
        "UNARY",
        "GATHER",
        "RESIZE",
    }
)
FLOAT_TYPES = frozenset({"FLOAT", "HALF", "BF16"})


def _is_float(layer: LayerInfo) -> bool:
    return bool(layer.output_dtypes) and all(d in FLOAT_TYPES for d in layer.output_dtypes)


def _head_layers(layers: list[LayerInfo], outputs: Iterable[str]) -> list[LayerInfo]:
    producer = {name: layer for layer in layers for name in layer.outputs}
    found: dict[int, LayerInfo] = {}
    stack = [producer[o] for o in outputs if o in producer]
    seen: set[int] = set()
    while stack:
        layer = stack.pop()
        if layer.index in seen:
            continue
        seen.add(layer.index)
        if layer.type in COMPUTE:
            found[layer.index] = layer  # the head's own convolution: stop here
        elif layer.type in PASS_THROUGH:
            found[layer.index] = layer
            stack.extend(producer[i] for i in layer.inputs if i is not None and i in producer)
        # anything else (constants, pooling, shape ops...) ends the walk on that branch
    return [found[i] for i in sorted(found)]


def select_layers(layers: list[LayerInfo], outputs: Iterable[str], patterns: Iterable[str]) -> dict[int, str]:
    """Layer index -> the selector/pattern that chose it (first match wins), float layers only."""
    chosen: dict[int, str] = {}
    regexes = []
    for pattern in patterns:
        if pattern == "@first_conv":
            first = next((layer for layer in layers if layer.type == "CONVOLUTION"), None)
            if first is not None:
                chosen.setdefault(first.index, pattern)
        elif pattern == "@head":
            for layer in _head_layers(layers, outputs):
                chosen.setdefault(layer.index, pattern)
        elif pattern.startswith("@"):
            raise ValueError(f"int8_keep_layers: unknown selector {pattern!r} (known: @first_conv, @head)")
        else:
            regexes.append((pattern, re.compile(pattern)))
    for layer in layers:
        for pattern, rx in regexes:
            if rx.search(layer.name):
                chosen.setdefault(layer.index, pattern)
                break
    by_index = {layer.index: layer for layer in layers}
    return {i: why for i, why in sorted(chosen.items()) if _is_float(by_index[i])}
