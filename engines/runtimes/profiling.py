"""Per-layer profiles: where the milliseconds of one inference go, node by node.

    run = profile_onnx(path, batch, iterations=50)   # ONNX Runtime's own profiler (enable_profiling)
    run.layers                 # LayerTiming per executed node, slowest first: p50 ms, share of the total
    run.op_types()             # the same summed per op type
    compare(fp32_run, int8_run)   # side by side per source ONNX node and per op type

ONNX Runtime writes a Chrome trace (JSON list of events): every node execution is an event of category
"Node" named "<node>_kernel_time" with its op type in args.op_name and its duration in microseconds; every
inference is a "Session" event "model_run". Events are assigned to the run they fall in, the warm-up runs
are dropped, a node's time per run is summed (a node inside a loop runs more than once), and the p50 over
the runs is reported. Shares are of the sum of the nodes' p50s (the kernels' time; `run_ms_p50` adds
ORT's own overhead between them).

ORT profiles the graph it executes, i.e. after its optimisations (node fusions, NCHWc layouts, Q/DQ pairs
turned into QLinearConv): the profile lists the nodes of that graph (`graph.executed_nodes`), saved for
the purpose with `optimized_model_filepath`. Each executed node is mapped back to the node of the source
ONNX it computes (for a Q/DQ or FP16 model: of the FP32 model it was made from), as far as names allow
(`source`): its own name without ORT's affixes ("_token_12", "_nchwc", "InsertedPrecisionFreeCast_"),
else the one source node consuming the same weights/bias (fused convolutions keep the bias, quantised
weights are named "<w>_quantized"), else the source node producing the tensor it is named after
("Resize__112:0_nchwc"). Nodes ORT or the quantiser added (Q/DQ, layout reorders, casts) have none.
TensorRT profiles (engines.runtimes.trt_layers) use the same records.
"""

from __future__ import annotations

import bisect
import json
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.errors import EngineError

SCHEMA = "edge-agent/profile/1"
WARMUP_RUNS = 1  # the first run allocates buffers and tunes thread pools: never representative
_KERNEL = "_kernel_time"
# What ORT's graph transformers add to the names they keep: NCHWc and Q/DQ fusions append suffixes; running
# FP16 on the CPU wraps nodes in casts ("InsertedPrecisionFreeCast_<node>") and renames their constants.
_ORT_SUFFIXES = re.compile(r"(?:_token_\d+|_nchwc)+$")
_ORT_PREFIXES = re.compile(r"^(?:InsertedPrecisionFreeCast_|FusedBack_)+")
_QUANTIZED = re.compile(r"_quantized$")


class ProfileError(EngineError):
    """A profile could not be taken; the message names the model file."""


@dataclass(frozen=True)
class LayerTiming:
    """One node (ONNX Runtime) or engine layer (TensorRT) of a profile."""

    name: str
    op_type: str
    p50_ms: float
    share: float  # of the profile's total_ms (0..1)
    samples: int  # runs it was measured in
    source: str | None = None  # the source ONNX node it computes (None: added by ORT / the quantiser)
    precision: str | None = None  # TensorRT: from the engine inspector
    tactic: str | None = None  # TensorRT: from the engine inspector


@dataclass
class ProfileRun:
    """One model file (or engine) profiled on one runtime."""

    runtime: str  # onnxruntime | tensorrt | tensorrt_rtx
    precision: str
    model: str  # the ONNX file or plan profiled
    iterations: int
    run_ms_p50: float | None  # whole inference (kernels + the runtime's own work between them)
    layers: list[LayerTiming]
    graph: dict[str, Any] = field(default_factory=dict)
    # How run_ms_p50 was timed: "profiler_attached" (ONNX Runtime: its profiler runs in every timed run)
    # or "separate_profile_run" (TensorRT: timed without the profiler, layers from a second, profiled run).
    timing: dict[str, Any] = field(default_factory=lambda: {"method": "profiler_attached"})

    @property
    def total_ms(self) -> float:
        return float(sum(layer.p50_ms for layer in self.layers))

    def op_types(self) -> list[dict[str, Any]]:
        """{op_type, nodes, p50_ms, share} per op type, slowest first."""
        groups: dict[str, list[LayerTiming]] = defaultdict(list)
        for layer in self.layers:
            groups[layer.op_type].append(layer)
        total = self.total_ms or 1.0
        rows = [
            {
                "op_type": op,
                "nodes": len(items),
                "p50_ms": round(sum(i.p50_ms for i in items), 4),
                "share": round(sum(i.p50_ms for i in items) / total, 4),
            }
            for op, items in groups.items()
        ]
        return sorted(rows, key=lambda r: (-r["p50_ms"], r["op_type"]))

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "precision": self.precision,
            "model": self.model,
            "iterations": self.iterations,
            "run_ms_p50": self.run_ms_p50,
            "total_ms": round(self.total_ms, 4),
            "graph": self.graph,
            "timing": self.timing,
            "layers": [asdict(layer) for layer in self.layers],
            "op_types": self.op_types(),
        }


def layer_timings(samples: dict[str, list[float]], info: dict[str, dict[str, Any]]) -> list[LayerTiming]:
    """LayerTimings (slowest first) from per-layer samples in ms; `info[name]` gives op_type and any of
    source/precision/tactic. Layers never measured are left out (the caller reports them)."""
    p50 = {name: float(np.median(v)) for name, v in samples.items() if v}
    total = sum(p50.values()) or 1.0
    out = [
        LayerTiming(
            name=name,
            op_type=str(info.get(name, {}).get("op_type", "")),
            p50_ms=round(ms, 4),
            share=round(ms / total, 4),
            samples=len(samples[name]),
            source=info.get(name, {}).get("source"),
            precision=info.get(name, {}).get("precision"),
            tactic=info.get(name, {}).get("tactic"),
        )
        for name, ms in p50.items()
    ]
    return sorted(out, key=lambda t: (-t.p50_ms, t.name))


# ---- ONNX Runtime ----------------------------------------------------------------------------------


def parse_ort_trace(
    events: list[dict[str, Any]], warmup_runs: int = WARMUP_RUNS
) -> tuple[dict[str, list[float]], dict[str, str], list[float]]:
    """(node -> ms per measured run, node -> op type, ms per measured run) from ORT's trace events."""
    runs = sorted(
        (float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    starts = [ts for ts, _ in runs]
    per_run: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    op_types: dict[str, str] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith(_KERNEL):
            continue  # fences and session events
        run = bisect.bisect_right(starts, float(e["ts"])) - 1
        if run < warmup_runs:
            continue
        node = name[: -len(_KERNEL)]
        per_run[node][run] += float(e["dur"]) / 1000.0
        op_types[node] = str(e.get("args", {}).get("op_name", ""))
    samples = {node: list(by_run.values()) for node, by_run in per_run.items()}
    return samples, op_types, [dur / 1000.0 for _, dur in runs[warmup_runs:]]


def source_nodes(source: Any, executed: Any) -> dict[str, str | None]:
    """Executed node name -> the source ONNX node it computes, or None (see the module docstring).
    `source`, `executed`: onnx.ModelProto."""
    names = {n.name for n in source.graph.node}
    weights = {i.name for i in source.graph.initializer}
    consumers: dict[str, set[str]] = defaultdict(set)
    producer: dict[str, str] = {}
    for n in source.graph.node:
        for i in n.input:
            if i in weights:
                consumers[i].add(n.name)
        producer.update((o, n.name) for o in n.output)
    out: dict[str, str | None] = {}
    for n in executed.graph.node:
        base = _ORT_SUFFIXES.sub("", _ORT_PREFIXES.sub("", n.name))
        # input 0 is the activation: weights and bias come after it
        weights_in = (_QUANTIZED.sub("", _ORT_PREFIXES.sub("", i)) for i in n.input[1:])
        owners = {c for i in weights_in for c in consumers.get(i, ())}
        if base in names:
            out[n.name] = base
        elif len(owners) == 1:
            out[n.name] = owners.pop()
        else:
            out[n.name] = producer.get(base)
    return out


def _load_onnx(path: Path) -> Any:
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ProfileError(f"cannot read ONNX model {path}: {e}") from e


def _profiling_options(work: Path, executed_path: Path, intra_threads: int, inter_threads: int) -> Any:
    """ORT session options that profile into `work` and save the graph ORT runs (to map nodes back)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(work / "ort")
    so.optimized_model_filepath = str(executed_path)  # the graph ORT runs, to map nodes back
    # Saving an NCHWc-optimised graph warns that it is CPU-specific; it is only read back here.
    so.log_severity_level = 3
    if intra_threads > 0:
        so.intra_op_num_threads = intra_threads
    if inter_threads > 0:
        so.inter_op_num_threads = inter_threads
    return so


def profile_onnx(
    path: Path,
    batch: np.ndarray,
    iterations: int,
    *,
    precision: str = "fp32",
    source_onnx: Path | None = None,
    intra_threads: int = 0,
    inter_threads: int = 0,
    trace_out: Path | None = None,
) -> ProfileRun:
    """Profile `path` on ONNX Runtime (CPU) over `iterations` runs of `batch` (after WARMUP_RUNS).
    `source_onnx`: the model node names are mapped back to (default `path`; for a Q/DQ model the FP32
    model it was made from, so both profiles name the same nodes). `trace_out`: keep ORT's raw trace
    there (chrome://tracing, Perfetto)."""
    import onnxruntime as ort

    if iterations < 1:
        raise ProfileError(f"iterations must be >= 1, got {iterations}")
    if not path.is_file():
        raise ProfileError(f"ONNX model {path} does not exist")
    profiled = _load_onnx(path)
    source = profiled if source_onnx is None else _load_onnx(source_onnx)
    with tempfile.TemporaryDirectory(prefix="edge-agent-profile-") as work:
        executed_path = Path(work) / "executed.onnx"
        so = _profiling_options(Path(work), executed_path, intra_threads, inter_threads)
        try:
            session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            feed = {session.get_inputs()[0].name: np.ascontiguousarray(batch, dtype=np.float32)}
            for _ in range(WARMUP_RUNS + iterations):
                session.run(None, feed)
            trace = Path(session.end_profiling())
        except Exception as e:  # ORT's pybind exceptions; name the model
            raise ProfileError(f"onnxruntime cannot profile {path}: {e}") from e
        events = json.loads(trace.read_text())
        if trace_out is not None:
            shutil.copyfile(trace, trace_out)
        executed = _load_onnx(executed_path)
    samples, op_types, runs = parse_ort_trace(events)
    mapping = source_nodes(source, executed)
    executed_names = [n.name for n in executed.graph.node]
    info = {name: {"op_type": op, "source": mapping.get(name)} for name, op in op_types.items()}
    return ProfileRun(
        runtime="onnxruntime",
        precision=precision,
        model=str(path),
        iterations=iterations,
        run_ms_p50=round(float(np.median(runs)), 4) if runs else None,
        layers=layer_timings(samples, info),
        graph={
            "onnx_nodes": len(profiled.graph.node),
            "executed_nodes": len(executed_names),
            "not_profiled": [n for n in executed_names if n not in samples],
            "runtime_version": ort.__version__,
        },
    )


# ---- comparison -------------------------------------------------------------------------------------


def _by_source(layers: Iterable[LayerTiming]) -> dict[str, tuple[float, set[str]]]:
    groups: dict[str, tuple[float, set[str]]] = {}
    for layer in layers:
        # Added nodes have no source: they are summed per op type, e.g. "[added] QuantizeLinear".
        key = layer.source or f"[added] {layer.op_type}"
        ms, ops = groups.get(key, (0.0, set()))
        groups[key] = (ms + layer.p50_ms, ops | {layer.op_type})
    return groups


def _row(key: str, ref: tuple[float, set[str]] | None, cand: tuple[float, set[str]] | None) -> dict[str, Any]:
    ref_ms = ref[0] if ref else None
    cand_ms = cand[0] if cand else None
    return {
        "node": key,
        "reference_ops": "+".join(sorted(ref[1])) if ref else None,
        "candidate_ops": "+".join(sorted(cand[1])) if cand else None,
        "reference_ms": None if ref_ms is None else round(ref_ms, 4),
        "candidate_ms": None if cand_ms is None else round(cand_ms, 4),
        "speedup": round(ref_ms / cand_ms, 3) if ref_ms and cand_ms else None,
    }


def compare(reference: ProfileRun, candidate: ProfileRun) -> dict[str, Any]:
    """Side by side: per source node (what quantisation sped up, and what it added) and per op type."""
    ref, cand = _by_source(reference.layers), _by_source(candidate.layers)
    # Slowest first on either side: what got faster and what the candidate added both come up top.
    nodes = sorted(
        (_row(k, ref.get(k), cand.get(k)) for k in ref.keys() | cand.keys()),
        key=lambda r: (-max(r["reference_ms"] or 0.0, r["candidate_ms"] or 0.0), r["node"]),
    )
    ref_ops = {r["op_type"]: r["p50_ms"] for r in reference.op_types()}
    cand_ops = {r["op_type"]: r["p50_ms"] for r in candidate.op_types()}
    op_types = sorted(
        (
            {"op_type": op, "reference_ms": ref_ops.get(op), "candidate_ms": cand_ops.get(op)}
            for op in ref_ops.keys() | cand_ops.keys()
        ),
        key=lambda r: (-(r["reference_ms"] or 0.0), -(r["candidate_ms"] or 0.0), r["op_type"]),
    )
    return {
        "reference": reference.precision,
        "candidate": candidate.precision,
        "reference_total_ms": round(reference.total_ms, 4),
        "candidate_total_ms": round(candidate.total_ms, 4),
        "speedup": round(reference.total_ms / candidate.total_ms, 3) if candidate.total_ms else None,
        "nodes": nodes,
        "op_types": op_types,
    }
