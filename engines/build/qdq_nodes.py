"""Which nodes an INT8 Q/DQ quantisation leaves float: the stem and the output heads, found from the graph
structure (engines.build.quantize), plus names or fnmatch patterns given by the user."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import onnx

from engines.errors import BuildError

DEFAULT_OP_TYPES: tuple[str, ...] = ("Conv",)
STEM_LAYERS = 2


class QuantizationError(BuildError):
    """Quantisation failed; the message names the ONNX file and the step."""


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
