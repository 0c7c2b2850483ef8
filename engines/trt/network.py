"""The network part of TrtApi: creation flags, parser errors, layers as plain data and per-layer
precision constraints (weakly typed TensorRT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from engines.trt.module import TrtModule, enum_name

if TYPE_CHECKING:  # type-checked against tensorrt-stubs (the TensorRT 10 Python API)
    import tensorrt as trt

_FLOATS = ("FLOAT", "HALF", "BF16")


@dataclass(frozen=True)
class LayerInfo:
    """One network layer as plain data (names of its input/output tensors, output dtypes)."""

    index: int
    name: str
    type: str  # LayerType member name: "CONVOLUTION", "ACTIVATION", ...
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    output_dtypes: tuple[str, ...]  # DataType member names: "FLOAT", "HALF", "INT32", ...


class NetworkCalls(TrtModule):
    """Network calls, the same on every version (a TrtApi part)."""

    def network_flags(self) -> int:
        flags = 0
        ndcf: Any = getattr(self.mod, "NetworkDefinitionCreationFlag", None)
        # Required on TensorRT <= 9, ignored (deprecated) on 10, absent on 11 and RTX.
        if hasattr(ndcf, "EXPLICIT_BATCH"):
            flags |= 1 << int(ndcf.EXPLICIT_BATCH)
        # Required where weak typing is gone; the flag itself may be gone too (always strong then).
        if self.strongly_typed and hasattr(ndcf, "STRONGLY_TYPED"):
            flags |= 1 << int(ndcf.STRONGLY_TYPED)
        return flags

    def parser_errors(self, parser: trt.OnnxParser) -> list[str]:
        """Parser errors as text, naming node and op where the parser reports them."""
        out = []
        for i in range(parser.num_errors):
            err = cast("trt.ParserError", parser.get_error(i))
            desc = err.desc() if hasattr(err, "desc") else str(err)
            node = err.node() if hasattr(err, "node") else -1
            parts = []
            # node_name()/node_operator() arrived in TensorRT 10; older parsers only give the index.
            name = err.node_name() if hasattr(err, "node_name") else ""
            op = err.node_operator() if hasattr(err, "node_operator") else ""
            if name or op:
                parts.append(f"node {name or node!s} (op {op or '?'})")
            elif isinstance(node, int) and node >= 0:
                parts.append(f"node #{node}")
            code = err.code() if hasattr(err, "code") else None
            code_s = str(code).split(".")[-1] if code is not None else ""
            out.append(": ".join([*parts, *([code_s] if code_s else []), desc]))
        return out

    def network_layers(self, network: trt.INetworkDefinition) -> tuple[list[LayerInfo], list[str]]:
        """(layers in network order, network output tensor names) as plain data for layer selection."""
        layers = []
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            inputs = []
            for j in range(layer.num_inputs):
                t = layer.get_input(j)
                inputs.append(t.name if t is not None else None)
            outputs, dtypes = [], []
            for j in range(layer.num_outputs):
                t = layer.get_output(j)
                outputs.append(t.name)
                dtypes.append(enum_name(t.dtype))
            layers.append(
                LayerInfo(
                    i,
                    layer.name,
                    enum_name(layer.type),
                    tuple(inputs),
                    tuple(outputs),
                    tuple(dtypes),
                )
            )
        outs = [network.get_output(i).name for i in range(network.num_outputs)]
        return layers, outs

    def constrain_layer(self, network: trt.INetworkDefinition, index: int, precision: str) -> None:
        """Run layer `index` in `precision` (fp16 | fp32), its float outputs in that type too (integer and
        BOOL outputs, e.g. of shape layers, keep theirs). Weakly typed TensorRT only: strongly typed
        networks carry their precision in the graph."""
        if not self.weakly_typed:
            self.fail_unavailable("per-layer precision constraints")
        dtype = self.mod.DataType.HALF if precision == "fp16" else self.mod.DataType.FLOAT
        layer = network.get_layer(index)
        layer.precision = dtype
        for j in range(layer.num_outputs):
            if enum_name(layer.get_output(j).dtype) in _FLOATS:
                layer.set_output_type(j, dtype)

    def constrain_float_layer(self, network: trt.INetworkDefinition, index: int) -> bool:
        """Run layer `index` in FP32 where it touches floats. A layer reading a float (a comparison whose
        output is BOOL included: it would otherwise be free to read FP16) computes in FLOAT; only its float
        outputs get an output type (BOOL and integer outputs keep theirs). Returns whether anything was
        constrained (layers on integers or booleans only are left alone)."""
        if not self.weakly_typed:
            self.fail_unavailable("per-layer precision constraints")
        layer = network.get_layer(index)
        reads_float = any(
            (t := layer.get_input(j)) is not None and enum_name(t.dtype) in _FLOATS
            for j in range(layer.num_inputs)
        )
        floats = [j for j in range(layer.num_outputs) if enum_name(layer.get_output(j).dtype) in _FLOATS]
        if reads_float or floats:
            layer.precision = self.mod.DataType.FLOAT
        for j in floats:
            layer.set_output_type(j, self.mod.DataType.FLOAT)
        return bool(reads_float or floats)

    def explain_int8_build_failure(self, errors: list[str]) -> str | None:
        """An actionable hint for a failed explicit-quantisation (Q/DQ) build, None when we know none.

        Measured on TensorRT-RTX 1.7.1.116 (CPU AOT, sm86): Q/DQ convolutions build (single convs,
        depthwise, padded; and NanoDet after ONNX Runtime's basic graph optimisation), but the raw tf2onnx
        NanoDet with any Q/DQ fails in the builder with "Internal Error (Assertion count >= 0 failed" in
        weightsPtr.cpp: unfolded constant/shape subgraphs around the quantised layers trip it.
        """
        text = " ".join(errors)
        if self.flavor == "tensorrt_rtx" and "Internal Error" in text:
            return (
                f"{self.label} hit an internal error on this Q/DQ graph; graphs quantised without folding "
                "their constant/shape subgraphs trigger it (fold first, e.g. ONNX Runtime "
                "GraphOptimizationLevel.ORT_ENABLE_BASIC with optimized_model_filepath, then quantise "
                "again), or use precision fp16, or TensorRT (weakly typed, calibrated INT8) on a "
                "Jetson/datacenter GPU"
            )
        return None
