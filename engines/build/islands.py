"""FP32 islands: the tail of a graph that stays FP32 through every precision route.

    parts = split(model)            # None when no node is marked
    base, island = parts
    converted = convert(base)       # FP16 conversion or INT8 Q/DQ of the rest only
    model = join(converted, island)

Why: decode + NMS grafted onto a detector (pipelines.models.graft) compares box areas in input pixels
(up to ~10^5, beyond FP16's 65504) and iterates a Loop that onnxconverter-common cannot convert (measured:
the converted graft fails to load in ONNX Runtime, with or without a node block list). Its nodes carry
names starting with KEEP_FP32; conversions run on the rest and put the island back unchanged, and weakly
typed TensorRT builds pin the island's layers to FP32 (engines.build.trt_plan).

An island must be a tail: it may read tensors of the rest, the rest may not read its tensors.

In a parsed TensorRT network the island is found by reachability, not by name: the ONNX parser names only
the layers it makes from a node after that node, and makes more of its own (a Loop's
"(Unnamed Layer* N) [Recurrence]"/TripLimit/LoopOutput, ONNXTRT_Broadcast_* and ONNXTRT_ShapeShuffle_*,
the island's constants named after their initializers: recorded in tests/data/nanodet_grafted_layers.json).
The rest is what computes rest_outputs(model); every other layer is the island's (island_layers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
from onnx import helper

if TYPE_CHECKING:  # the ONNX side (pipelines.models.graft) must not import the TensorRT layer
    from engines.trt import LayerInfo

KEEP_FP32 = "keep_fp32/"

log = logging.getLogger("engines.islands")


class IslandError(ValueError):
    """The marked nodes are not a tail of the graph (the message names a node and a tensor)."""


@dataclass
class Island:
    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    outputs: list[onnx.ValueInfoProto]  # the whole model's outputs


def marked(name: str) -> bool:
    """A node (or a TensorRT layer the ONNX parser named after it) of an FP32 island."""
    return name.startswith(KEEP_FP32)


def split(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Island] | None:
    """(the model without its island, whose outputs are the tensors the island reads; the island), or None
    when no node is marked. IslandError when the marked nodes are not a tail."""
    graph = model.graph
    island_nodes = [n for n in graph.node if marked(n.name)]
    if not island_nodes:
        return None
    rest = [n for n in graph.node if not marked(n.name)]
    made_by_island = {o for n in island_nodes for o in n.output}
    for node in rest:
        for name in _reads(node):
            if name in made_by_island:
                raise IslandError(f"node {node.name or node.op_type!r} reads {name!r} of the FP32 island")
    island_reads = {name for n in island_nodes for name in _reads(n)}
    rest_reads = {name for n in rest for name in _reads(n)}
    inits = {i.name: i for i in graph.initializer}
    moved = [inits[name] for name in sorted(island_reads & inits.keys())]
    shared = [i.name for i in moved if i.name in rest_reads]
    if shared:
        raise IslandError(f"initializer {shared[0]!r} is read by the FP32 island and by the rest")
    made_by_rest = {o for n in rest for o in n.output} | {i.name for i in graph.input}
    boundary = sorted(island_reads & made_by_rest)
    if not any(o.name in made_by_island for o in graph.output):
        raise IslandError("the FP32 island produces none of the model's outputs")
    kept_outputs = [o for o in graph.output if o.name not in made_by_island]
    typed = _value_infos(model)

    base = onnx.ModelProto()
    base.CopyFrom(model)
    moved_names = {i.name for i in moved}
    del base.graph.node[:]
    base.graph.node.extend(rest)
    keep_inits = [i for i in graph.initializer if i.name not in moved_names]
    del base.graph.initializer[:]
    base.graph.initializer.extend(keep_inits)
    del base.graph.output[:]
    base.graph.output.extend(kept_outputs)
    base.graph.output.extend(
        typed.get(name) or helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        for name in boundary
    )
    island_tensors = made_by_island | moved_names
    kept_info = [v for v in graph.value_info if v.name not in island_tensors]
    del base.graph.value_info[:]
    base.graph.value_info.extend(kept_info)
    return base, Island(island_nodes, moved, list(graph.output))


def rest_outputs(model: onnx.ModelProto) -> list[str] | None:
    """The tensors the graph without its island must still compute (the outputs split()'s base has): the
    model outputs the rest makes, then the rest's tensors the island reads. None when no node is marked."""
    graph = model.graph
    island_nodes = [n for n in graph.node if marked(n.name)]
    if not island_nodes:
        return None
    rest = [n for n in graph.node if not marked(n.name)]
    made_by_rest = {o for n in rest for o in n.output} | {i.name for i in graph.input}
    kept = [o.name for o in graph.output if o.name in made_by_rest]
    boundary = sorted({name for n in island_nodes for name in _reads(n)} & made_by_rest)
    return [*kept, *(b for b in boundary if b not in kept)]


def island_layers(layers: Sequence[LayerInfo], rest_out: Iterable[str] | None) -> set[int]:
    """Indices of the parsed network's layers that belong to the FP32 island: every layer that does not
    help compute `rest_out` (rest_outputs() of the ONNX the network was parsed from: TensorRT keeps those
    tensor names), whatever the parser named it; and every layer named after a marked node. With
    `rest_out` None (no island in the ONNX) or none of its tensors in the network, by name only."""
    named = {layer.index for layer in layers if marked(layer.name)}
    if rest_out is None:
        return named
    producer = {t: layer for layer in layers for t in layer.outputs}
    wanted = list(rest_out)
    inputs = {t for layer in layers for t in layer.inputs if t is not None} - producer.keys()
    missing = [t for t in wanted if t not in producer and t not in inputs]
    if missing:
        none_found = len(missing) == len(wanted)
        log.warning(
            "FP32 island: the network has no tensor %s of the graph's rest; %s",
            ", ".join(repr(t) for t in missing),
            "island found by layer names only" if none_found else "some of the rest may be pinned too",
        )
        if none_found:
            return named
    rest: set[int] = set()
    stack = [producer[t] for t in wanted if t in producer]
    while stack:
        layer = stack.pop()
        if layer.index in rest:
            continue
        rest.add(layer.index)
        stack.extend(producer[t] for t in layer.inputs if t is not None and t in producer)
    return {layer.index for layer in layers if layer.index not in rest} | named


def join(base: onnx.ModelProto, island: Island) -> onnx.ModelProto:
    """The converted base with the island put back: the model's original outputs again."""
    model = onnx.ModelProto()
    model.CopyFrom(base)
    model.graph.node.extend(island.nodes)
    model.graph.initializer.extend(island.initializers)
    del model.graph.output[:]
    model.graph.output.extend(island.outputs)
    return model


def _reads(node: onnx.NodeProto) -> Iterator[str]:
    """Every tensor name a node reads, including those its subgraphs (Loop/If bodies) take from outside."""
    yield from (i for i in node.input if i)
    for attr in node.attribute:
        for sub in _subgraphs(attr):
            inner = {i.name for i in sub.input} | {i.name for i in sub.initializer}
            inner |= {o for n in sub.node for o in n.output}
            for n in sub.node:
                yield from (name for name in _reads(n) if name not in inner)


def _subgraphs(attr: onnx.AttributeProto) -> Iterable[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Types and shapes of the model's tensors as ONNX's shape inference sees them (empty if it cannot)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model shape inference cannot follow still splits; boundary types default to float
        return {}
    g = inferred.graph
    return {v.name: v for v in (*g.value_info, *g.input, *g.output)}
