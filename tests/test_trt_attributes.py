"""Every TensorRT attribute the execution path uses exists in the real `tensorrt_rtx` module.

TensorRT cannot run on CI (no supported GPU), so engines/runtimes/{slots,tensorrt,trt_layers}.py and
engines/trt_api.py only meet `fake_tensorrt` there. This test reads their source (ast) for attributes taken
on the TensorRT objects, known by the variable holding them (RECEIVERS: `context.X`, `self.context.X`,
`engine.X`, `self._engine.X`, `runtime.X`, `inspector.X`, ...), and looks each up on the class of the
installed tensorrt_rtx: a method the code calls must be a method there, an attribute it reads or sets must
be a property there. hasattr/getattr probes are not uses (they exist to cope with absence). mypy checks
the same code against the TensorRT 10 stubs (tools/test.sh).
"""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    "engines/runtimes/slots.py",
    "engines/runtimes/tensorrt.py",
    "engines/runtimes/trt_layers.py",
    "engines/trt_api.py",
]

# Variable (or self attribute, leading underscores dropped) holding a TensorRT object -> its class.
RECEIVERS = {
    "context": "IExecutionContext",
    "engine": "ICudaEngine",
    "runtime": "Runtime",
    "inspector": "EngineInspector",
}

# What the execution path is known to use: the extraction must find at least these.
REQUIRED = {
    ("IExecutionContext", "set_input_shape", "call"),
    ("IExecutionContext", "set_tensor_address", "call"),
    ("IExecutionContext", "execute_async_v3", "call"),
    ("IExecutionContext", "set_optimization_profile_async", "call"),
    ("IExecutionContext", "get_tensor_shape", "call"),
    ("ICudaEngine", "create_execution_context", "call"),
    ("ICudaEngine", "num_optimization_profiles", "attr"),
    ("ICudaEngine", "get_tensor_profile_shape", "call"),
    ("ICudaEngine", "num_io_tensors", "attr"),
    ("ICudaEngine", "get_tensor_name", "call"),
    ("ICudaEngine", "get_tensor_mode", "call"),
    ("ICudaEngine", "get_tensor_dtype", "call"),
    ("ICudaEngine", "get_tensor_shape", "call"),
    ("Runtime", "deserialize_cuda_engine", "call"),
    # per-layer view (engines.runtimes.trt_layers, `edge-agent profile`)
    ("ICudaEngine", "create_engine_inspector", "call"),
    ("EngineInspector", "execution_context", "attr"),
    ("EngineInspector", "get_engine_information", "call"),
    ("IExecutionContext", "profiler", "attr"),
}

Use = tuple[str, str, str]  # (class, attribute, "call" | "attr")


def _receiver(node: ast.expr) -> str | None:
    """The TensorRT class of `context` / `self.context` / `self._engine` ..., None for anything else."""
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        name = node.attr
    else:
        return None
    return RECEIVERS.get(name.lstrip("_"))


def extract_source(text: str, name: str, uses: dict[Use, list[str]] | None = None) -> dict[Use, list[str]]:
    """(class, attribute, kind) -> the places ("name:line") using it, in one source text."""
    uses = defaultdict(list) if uses is None else uses
    tree = ast.parse(text, name)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (cls := _receiver(node.value)) is not None:
            kind = "call" if id(node) in called else "attr"
            uses[(cls, node.attr, kind)].append(f"{name}:{node.lineno}")
    return dict(uses)


def extract() -> dict[Use, list[str]]:
    uses: dict[Use, list[str]] = defaultdict(list)
    for rel in SOURCES:
        extract_source((ROOT / rel).read_text(), rel, uses)
    return dict(uses)


def _listing(uses: dict[Use, list[str]]) -> str:
    return "\n".join(f"  {c}.{a} ({k}) at {', '.join(places)}" for (c, a, k), places in sorted(uses.items()))


def test_extraction_finds_the_execution_path():
    uses = extract()
    missing = REQUIRED - set(uses)
    assert not missing, (
        f"the ast extraction no longer finds {sorted(missing)}; it found:\n{_listing(uses)}\n"
        "(renamed variables? update RECEIVERS, or REQUIRED if the code stopped using them)"
    )


def test_extraction_sees_calls_and_attributes():
    """The extraction itself, on a snippet: receivers by name and self attribute, kind, no probes."""
    src = (
        "def f(self, engine, context, runtime, other):\n"
        "    self.context.execute_async_v3(0); engine.num_io_tensors\n"
        "    self._runtime.deserialize_cuda_engine(b'')\n"
        "    other.get_tensor_name(0); hasattr(engine, 'probe'); context.set_input_shape('x', (1,))\n"
    )
    uses = set(extract_source(src, "snippet"))
    assert uses == {
        ("IExecutionContext", "execute_async_v3", "call"),
        ("ICudaEngine", "num_io_tensors", "attr"),
        ("Runtime", "deserialize_cuda_engine", "call"),
        ("IExecutionContext", "set_input_shape", "call"),
    }


def test_every_used_attribute_exists_in_tensorrt_rtx():
    trt = pytest.importorskip("tensorrt_rtx")
    uses = extract()
    problems = []
    for (cls_name, attr, kind), places in sorted(uses.items()):
        cls = getattr(trt, cls_name, None)
        where = f"{cls_name}.{attr} ({kind}) at {', '.join(places)}"
        if cls is None:
            problems.append(f"{where}: tensorrt_rtx has no class {cls_name}")
            continue
        try:
            found = inspect.getattr_static(cls, attr)
        except AttributeError:
            problems.append(f"{where}: missing")
            continue
        if kind == "call" and (isinstance(found, property) or not callable(found)):
            problems.append(f"{where}: called, but it is a {type(found).__name__}")
        elif kind == "attr" and not isinstance(found, property):
            problems.append(f"{where}: read as an attribute, but it is a {type(found).__name__}")
    assert not problems, (
        f"TensorRT attributes the agent uses that tensorrt_rtx {trt.__version__} lacks (as used):\n  "
        + "\n  ".join(problems)
        + f"\nall uses extracted:\n{_listing(uses)}"
    )


def test_module_level_names_of_the_runtime_path_exist():
    """trt_api reaches these through the module: Runtime(logger), TensorIOMode.INPUT, nptype()."""
    trt = pytest.importorskip("tensorrt_rtx")
    assert callable(trt.Runtime) and hasattr(trt.TensorIOMode, "INPUT") and callable(trt.nptype)


def test_module_level_names_of_the_layer_view_exist():
    """trt_api / trt_layers reach these through the module: the DETAILED verbosity set on the builder
    config, the inspector's JSON format, and the IProfiler base class with its callback."""
    trt = pytest.importorskip("tensorrt_rtx")
    assert hasattr(trt.ProfilingVerbosity, "DETAILED") and hasattr(trt.LayerInformationFormat, "JSON")
    assert isinstance(inspect.getattr_static(trt.IBuilderConfig, "profiling_verbosity"), property)
    assert callable(inspect.getattr_static(trt.IProfiler, "report_layer_time"))


@pytest.mark.slow
def test_real_rtx_plan_up_to_deserialisation(tmp_path: Path) -> None:
    """A real TensorRT-RTX plan through TensorRTBackend.load as far as this CPU machine allows: the plan is
    read and verified, TensorRT-RTX's Runtime deserialises it and refuses for want of a CUDA driver, and
    the error names the plan and TensorRT's reason."""
    import dataclasses

    pytest.importorskip("tensorrt_rtx")
    from engines.builder import build
    from engines.fingerprint import probe_fingerprint
    from engines.runtimes.base import BackendError
    from engines.runtimes.tensorrt import TensorRTBackend
    from engines.settings import BuildSettings
    from engines.store import EngineStore
    from engines.trt_api import import_trt

    api = import_trt("tensorrt_rtx")
    fp = probe_fingerprint(api)
    store = EngineStore(tmp_path)
    result = build(
        store,
        "det",
        BuildSettings(onnx=ROOT / "agent" / "assets" / "nanodet-m-416.onnx"),
        api=api,
        fingerprint=fp,
    )
    # Claim a GPU so load() gets past its own "no CUDA GPU" refusal to TensorRT's deserialiser.
    claimed = dataclasses.replace(fp, gpu_name="claimed for the test")
    backend = TensorRTBackend(store, "det", result.key, api=api, fingerprint=claimed, contexts=2)
    with pytest.raises(
        BackendError, match=r"tensorrt_rtx: TensorRT refused .*det/.*\.plan: .*deserializeCudaEngine"
    ):
        backend.load()
    assert not backend.loaded
