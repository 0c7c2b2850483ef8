"""One model, resolved once: what is served, how its outputs are decoded, its labels and input.

    spec = resolve_onnx("detector", Path("m.onnx"), "yolov8", labels)   # host decoding, or the graph's own
    spec = spec.grafted_as(path, params)                                # after the graft (agent.lifecycle)
    adapter = spec.adapter()                                            # host or graph decoding, decided here

The agent resolves it from a ModelConfig (agent.lifecycle.model.resolve_spec), grafting the ONNX there when
`postprocess: graph` asks for it. A grafted ONNX says how it was made in its metadata_props (GRAFT_KEY, as
Ultralytics writes its export metadata): format, classes, thresholds, max detections, NMS and source, so
reading one back needs no configuration and a config that disagrees with it is told so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from engines.runtimes.base import TensorSpec
from pipelines.models.base import ModelAdapter, is_grafted
from pipelines.models.registry import FORMATS, adapter_class, make_adapter

if TYPE_CHECKING:
    import onnx

PostprocessMode = Literal["host", "graph"]
GRAFT_KEY = "edge_agent.postprocess"  # metadata_props key of a grafted ONNX: GraftRecord as JSON


class SpecError(ValueError):
    """A model cannot be resolved; `key` is the model config key it is about (onnx, format, labels)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class GraftParams:
    """The decode + NMS constants of a grafted graph (a changed one is a different ONNX)."""

    score_threshold: float
    iou_threshold: float = 0.5
    max_det: int = 300
    nms: str = "matrix"
    pre_nms_top_k: int = 1000

    @property
    def tag(self) -> str:
        """The part of the grafted file's name that tells its parameters apart."""
        return f"s{self.score_threshold:g}-i{self.iou_threshold:g}-k{self.max_det}"


@dataclass(frozen=True)
class GraftRecord:
    """What a grafted ONNX records of itself (GRAFT_KEY)."""

    format: str
    num_classes: int
    params: GraftParams
    source: str = ""  # the ONNX grafted onto, as the grafting process named it ("": not told)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "params": asdict(self.params)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GraftRecord:
        d = json.loads(text)
        params = GraftParams(**d["params"])
        return cls(str(d["format"]), int(d["num_classes"]), params, str(d.get("source", "")))


def write_record(model: onnx.ModelProto, record: GraftRecord) -> None:
    kept = [p for p in model.metadata_props if p.key != GRAFT_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=GRAFT_KEY, value=record.to_json())


def read_record(model: onnx.ModelProto) -> GraftRecord | None:
    """The graft record of `model`; None when it has none. ValueError when it is malformed."""
    for prop in model.metadata_props:
        if prop.key == GRAFT_KEY:
            try:
                return GraftRecord.from_json(prop.value)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"its {GRAFT_KEY} metadata is malformed ({exc})") from None
    return None


@dataclass(frozen=True)
class ModelSpec:
    """A model as inference serves it. `onnx` is the served graph, `source_onnx` the one the config names
    (the same unless grafted); `graft` the parameters of a graph-mode model (None: host, or a graph grafted
    before records were written)."""

    name: str
    format: str
    labels: tuple[str, ...]
    input: TensorSpec
    onnx: Path
    source_onnx: Path
    postprocess: PostprocessMode = "host"
    graft: GraftParams | None = None

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def adapter(self) -> ModelAdapter:
        """A new adapter: preprocessing for `input`, host decoding or the grafted detections."""
        return make_adapter(self.format, self.input, self.num_classes, grafted=self.postprocess == "graph")

    def grafted_as(self, onnx_path: Path, params: GraftParams) -> ModelSpec:
        """This model served as `onnx_path`, its decode + NMS grafted on with `params`."""
        return replace(self, onnx=onnx_path, postprocess="graph", graft=params)


def resolve_onnx(name: str, path: Path, fmt: str, labels: Sequence[str]) -> ModelSpec:
    """The spec of the ONNX at `path` as it is: host decoding, or graph decoding for a graph with the graft
    on it (its record, or the det_* outputs of one grafted before records). SpecError naming the key."""
    try:
        adapter_class(fmt)
    except ValueError as exc:
        raise SpecError("format", str(exc)) from None
    if not labels:
        raise SpecError("labels", "no labels")
    import onnx  # here, not at import: serving a resolved model needs no onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # OSError, protobuf's DecodeError and friends
        raise SpecError("onnx", f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    spec = ModelSpec(name, fmt.lower(), tuple(labels), _input(model, path), Path(path), Path(path))
    try:
        record = read_record(model)
    except ValueError as exc:
        raise SpecError("onnx", f"{path}: {exc}") from None
    if record is None:
        grafted = is_grafted([o.name for o in model.graph.output])
        return replace(spec, postprocess="graph") if grafted else spec
    if record.format not in FORMATS or adapter_class(record.format) is not adapter_class(fmt):
        raise SpecError("format", f"{fmt}: {path} was grafted for {record.format} outputs")
    if record.num_classes != spec.num_classes:
        raise SpecError(
            "labels", f"{len(labels)} labels, but {path} was grafted for {record.num_classes} classes"
        )
    return replace(spec, source_onnx=Path(record.source or path), postprocess="graph", graft=record.params)


def _input(model: onnx.ModelProto, path: Path) -> TensorSpec:
    """The one image input (initializers excluded), None for a symbolic or unknown dim."""
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        names = [i.name for i in inputs]
        raise SpecError("onnx", f"{path} has inputs {names}; expected one image")
    dims = tuple(
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
        for d in inputs[0].type.tensor_type.shape.dim
    )
    return TensorSpec(inputs[0].name, dims, np.dtype(np.float32))
