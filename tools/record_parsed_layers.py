"""Record how TensorRT's ONNX parser turns the grafted NanoDet into layers (tests/fake_tensorrt replays it).

    python tools/record_parsed_layers.py --out tests/data/nanodet_grafted_layers.json

Grafts decode + NMS onto the bundled NanoDet (pipelines.models.graft, as tools/graft_model.py does), parses
the grafted graph and the graph without its FP32 island (engines.build.islands.split) with the installed
TensorRT-RTX parser, and writes each layer of the grafted network (name, type, input and output tensors,
output dtypes, whether the island-free parse has it) plus the network inputs and outputs of both. The
parser names the layers it makes itself (loops, broadcasts, shape helpers) as TensorRT does, not after the
ONNX nodes: tests that pin or select layers run on these names instead of invented ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.build import islands  # noqa: E402
from engines.trt import TrtApi, import_trt  # noqa: E402
from pipelines.models import GraftParams, ModelSpec  # noqa: E402
from pipelines.models.graft import graft_spec  # noqa: E402

MODEL = ROOT / "agent" / "assets" / "nanodet-m-416.onnx"


def grafted_nanodet() -> onnx.ModelProto:
    from engines.runtimes.ort import OrtBackend

    backend = OrtBackend(str(MODEL))
    backend.load()
    input_spec = backend.input_spec
    backend.close()
    labels = tuple(f"class{i}" for i in range(80))
    spec = ModelSpec(MODEL.stem, "nanodet", labels, input_spec, MODEL, MODEL)
    return graft_spec(spec, GraftParams(0.35, 0.5, 100))


def parse(api: TrtApi, model: onnx.ModelProto) -> tuple[list[Any], list[str], list[str]]:
    """(layers, network inputs, network outputs) of `model` as the parser makes them."""
    logger = api.logger()
    builder = api.mod.Builder(logger)
    network = builder.create_network(api.network_flags())
    parser = api.mod.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        raise SystemExit("parse failed: " + "; ".join(api.parser_errors(parser)))
    layers, outputs = api.network_layers(network)
    inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    return layers, inputs, outputs


def record() -> dict[str, Any]:
    api = import_trt("tensorrt_rtx")
    model = grafted_nanodet()
    parts = islands.split(model)
    assert parts is not None, "the graft marks no FP32 island"
    layers, inputs, outputs = parse(api, model)
    base_layers, _, base_outputs = parse(api, parts[0])
    # The island-free parse has the grafted one's first layers; a few names the parser numbers from its
    # own counters differ ("..._Split_164_37" there, "..._Split_164_35" here): matched by what they do.
    base = {(layer.type, layer.inputs, layer.outputs): layer.name for layer in base_layers}
    found = {(layer.type, layer.inputs, layer.outputs) for layer in layers}
    missing = [layer.name for layer in base_layers if (layer.type, layer.inputs, layer.outputs) not in found]
    if missing:
        raise SystemExit(f"the island-free parse has layers the grafted one lacks: {missing[:5]}")
    renames = {
        layer.name: base[key]
        for layer in layers
        if (key := (layer.type, layer.inputs, layer.outputs)) in base and base[key] != layer.name
    }
    return {
        "source": f"{api.label} ONNX parser; {MODEL.name} grafted (score 0.35, IoU 0.5, 100 boxes)",
        "inputs": inputs,
        "outputs": outputs,
        "island_free_outputs": base_outputs,
        "island_free_renames": renames,
        # [name, type, inputs, outputs, output dtypes, in the island-free parse]
        "layers": [
            [
                layer.name,
                layer.type,
                list(layer.inputs),
                list(layer.outputs),
                list(layer.output_dtypes),
                (layer.type, layer.inputs, layer.outputs) in base,
            ]
            for layer in layers
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    data = record()
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(data['layers'])} layers, {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
