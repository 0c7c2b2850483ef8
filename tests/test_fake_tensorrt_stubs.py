"""tests/fake_tensorrt.py pretends no TensorRT API that TensorRT lacks, and the API indexes it is held to
are right.

The fake stands in for TensorRT 8.x-11 where no TensorRT can run; code that passes against it must not use
a name real TensorRT does not have. Every public attribute a fake module defines (module names, class
attributes and enum members, instance attributes its methods set, and the classes its methods return:
Network, Layer, Engine, ... under the TensorRT class each stands for) must exist in TensorRT 10.13
(tensorrt-stubs) or 8.6.1 (tests/data/trt_api_8_6_1.json, from NVIDIA's bindings); test plumbing is
FAKE_ONLY (tests/trt_stub_index.py). Known gaps are KNOWN_FAKE_GAPS, printed on every run; a new one
fails. The indexes themselves are checked against facts of the TensorRT docs and release notes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fake_tensorrt
import pytest
import trt_stub_index as idx
from trt_stub_index import MODULE, SKIP_REASON, stub_index, stub_path, table_8_6_1

ROOT = Path(__file__).resolve().parent.parent

OPTION_SETS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    (("11.0.0",), {"weak": False, "explicit_batch": False}),
    (("8.2.0",), {"memory_pool": False, "opt_level": False, "progress": False, "node_names": False}),
    (("10.3.0",), {"int8": True}),
]

# Public helpers of the fake that look like TensorRT API but exist in neither 8.6.1 nor 10.13 (found by
# this test; fake_tensorrt.py is not changed here). Code using them would pass on the fake and fail on
# TensorRT; engines/ code does not (tests/test_trt_attributes.py would say). Renaming them with a leading
# "_" ends the listing.
KNOWN_FAKE_GAPS: set[str] = set()  # fake-only helpers are private ('_'); keep it empty

needs_stubs = pytest.mark.skipif(stub_path() is None, reason=SKIP_REASON)


def _make(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fake_tensorrt.make(*args, **kwargs)


@needs_stubs
@pytest.mark.parametrize(("args", "kwargs"), OPTION_SETS, ids=lambda v: repr(v))
def test_fake_defines_nothing_tensorrt_lacks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    gaps = idx.fake_gaps(_make(args, kwargs))
    known = sorted(set(gaps) & KNOWN_FAKE_GAPS)
    print("KNOWN_FAKE_GAPS present:", ", ".join(known) or "none")
    new = sorted(set(gaps) - KNOWN_FAKE_GAPS)
    assert not new, (
        f"fake_tensorrt.make{args + tuple(f'{k}={v!r}' for k, v in kwargs.items())} defines names that "
        f"neither TensorRT 8.6.1 nor 10.13 has: {new}\n(use the real name, prefix a fake-only helper "
        "with '_', or add test plumbing to trt_stub_index.FAKE_ONLY)"
    )


@needs_stubs
@pytest.mark.parametrize(("args", "kwargs"), OPTION_SETS, ids=lambda v: repr(v))
def test_fake_kinds_match_tensorrt(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A fake method where TensorRT has a property (or the reverse) lets wrong calls pass."""
    assert idx.fake_kind_mismatches(_make(args, kwargs)) == []


@needs_stubs
def test_fake_gaps_names_what_is_not_tensorrt() -> None:
    """fake_gaps itself: an invented class attribute, enum member and module name are named; plumbing,
    underscores and real names are not."""
    mod = fake_tensorrt.make()
    mod.Builder.invented_method = lambda self: None
    mod.Builder._private = 1
    mod.not_a_trt_function = lambda: None
    mod.calls = []
    import enum

    mod.BuilderFlag = enum.IntEnum("BuilderFlag", {"FP16": 0, "NOT_A_FLAG": 1})
    gaps = idx.fake_gaps(mod)
    assert {"Builder.invented_method", "BuilderFlag.NOT_A_FLAG", "not_a_trt_function"} <= set(gaps)
    assert not {"Builder._private", "calls", "BuilderFlag.FP16"} & set(gaps)
    hidden = idx.fake_members(fake_tensorrt.make())
    assert "get_layer" in hidden["INetworkDefinition"]  # reached through Builder.create_network's closure


@needs_stubs
def test_fake_kind_mismatch_is_named() -> None:
    mod = fake_tensorrt.make()
    mod.Builder.num_DLA_cores = lambda self: 0  # a property in TensorRT
    assert "Builder.num_DLA_cores (method in the fake, property in TensorRT)" in idx.fake_kind_mismatches(mod)


# --- the indexes -------------------------------------------------------------------------------------------
def test_table_8_6_1_facts() -> None:
    """TensorRT 8.6.1 as NVIDIA's bindings define it (python/src at tag v8.6.1)."""
    t = table_8_6_1()
    doc = json.loads(idx.TABLE_8_6_1.read_text())
    assert doc["source"].startswith(
        "NVIDIA/TensorRT v8.6.1 (commit a25ca8bba2a164179046afc2f5d7f478e280f8c0)"
    )
    config = t["IBuilderConfig"]
    assert config["max_workspace_size"] == "property"  # deprecated in 8.4, still there; removed in 10
    for method in (
        "set_memory_pool_limit",
        "set_flag",
        "clear_flag",
        "can_run_on_DLA",
        "set_calibration_profile",
    ):
        assert config[method] == "method", method
    assert config["DLA_core"] == config["int8_calibrator"] == config["profiling_verbosity"] == "property"
    assert "progress_monitor" not in config  # IProgressMonitor arrived in TensorRT 10
    flags = t["BuilderFlag"]
    for flag in (
        "FP16",
        "INT8",
        "TF32",
        "STRICT_TYPES",
        "PREFER_PRECISION_CONSTRAINTS",
        "OBEY_PRECISION_CONSTRAINTS",
    ):
        assert flags[flag] == "value", flag
    assert "STRONGLY_TYPED" not in t["NetworkDefinitionCreationFlag"]  # TensorRT 9
    assert t["NetworkDefinitionCreationFlag"]["EXPLICIT_BATCH"] == "value"
    context = t["IExecutionContext"]
    for method in (
        "execute_async_v3",
        "set_tensor_address",
        "set_input_shape",
        "set_optimization_profile_async",
    ):
        assert context[method] == "method", method
    assert context["nvtx_verbosity"] == context["profiler"] == "property"
    assert t["Runtime"]["DLA_core"] == t["Runtime"]["num_DLA_cores"] == "property"
    assert t["Builder"]["num_DLA_cores"] == "property"
    assert t["ICudaEngine"]["num_io_tensors"] == "property" and "create_engine_inspector" in t["ICudaEngine"]
    assert "queryKeys" not in t["ITimingCache"]  # TensorRT 10
    assert {"parse", "parse_from_file", "get_error"} <= set(t["OnnxParser"]) and "node_name" not in t[
        "ParserError"
    ]
    assert t[MODULE]["init_libnvinfer_plugins"] == "method" and t[MODULE]["nptype"] == "method"
    assert t[MODULE]["Logger"] == "class" and t["Logger"]["WARNING"] == "value"  # __init__.py's copy
    assert t["ILogger.Severity"]["VERBOSE"] == "value" and t["ILogger"]["Severity"] == "value"
    assert t["IConvolutionLayer"]["precision"] == "property"  # ILayer's, inherited
    assert t["DataType"]["itemsize"] == "property" and "BF16" not in t["DataType"]  # BF16: TensorRT 9


@needs_stubs
def test_stub_index_10_13_facts() -> None:
    s = stub_index()
    config = s["IBuilderConfig"]
    assert "max_workspace_size" not in config and config["set_memory_pool_limit"] == "method"
    assert config["progress_monitor"] == "property" and s[MODULE]["IProgressMonitor"] == "class"
    assert s["ITimingCache"]["queryKeys"] == "method"
    assert "STRICT_TYPES" not in s["BuilderFlag"] and s["BuilderFlag"]["FP16"] == "value"
    assert s["NetworkDefinitionCreationFlag"]["STRONGLY_TYPED"] == "value"
    assert s["ParserError"]["node_name"] == "method"
    assert s["IExecutionContext"]["execute_async_v3"] == "method"
    assert s["ILogger.Severity"]["ERROR"] == "value" and s["Logger"]["Severity"] == "value"
    assert s[MODULE]["nptype"] == s[MODULE]["volume"] == "method"  # the package's __init__.pyi
    assert s["IConvolutionLayer"]["precision"] == "property"  # inherited from ILayer


def test_stub_path_is_none_without_the_stubs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not installed (no `.repaired` marker): None, so the tests skip with SKIP_REASON, never a crash."""
    monkeypatch.setattr(idx.trt_stubs, "target", lambda: tmp_path / "absent")
    assert idx.stub_path() is None
    mod = fake_tensorrt.make()
    idx.stub_index.cache_clear()
    try:
        assert idx.stub_index() == {} and idx.fake_gaps(mod) == []
    finally:
        idx.stub_index.cache_clear()


def test_table_generator_reads_pybind11_bindings() -> None:
    """tools/trt_api_table.py on a snippet in the style of NVIDIA's bindings: classes, enums, properties,
    nested enums with export_values, bases, module functions and aliases, inactive #if branches."""
    from tools.trt_api_table import build

    cpp = """
    // comment with .def("not_this")
    py::class_<ILogger, PyLogger> baseLoggerBinding{m, "ILogger", py::module_local()};
    baseLoggerBinding.def(py::init<>()).def("log", &ILogger::log, "severity"_a);
    py::enum_<ILogger::Severity>(baseLoggerBinding, "Severity", py::arithmetic())
        .value("ERROR", ILogger::Severity::kERROR)
        .export_values();
    py::class_<ILayer, std::unique_ptr<ILayer, py::nodelete>>(m, "ILayer")
        .def_property("precision", &ILayer::getPrecision, &ILayer::setPrecision)
        .def("set_output_type", [](ILayer& self, int i) { return self.f(i, "x;y"); }, "index"_a);
    py::class_<IConvolutionLayer, ILayer, std::unique_ptr<IConvolutionLayer, py::nodelete>>(
        m, "IConvolutionLayer")
        .def_property_readonly("num_groups", &IConvolutionLayer::getNbGroups)
#if ENABLE_INETWORK_SERIALIZE
        .def("serialize", lambdas::network_serialize)
#endif
        ;
    py::enum_<SampleMode>(m, "SampleMode").value("STRICT_BOUNDS", SampleMode::kSTRICT_BOUNDS);
    m.attr("SliceMode") = m.attr("SampleMode");
    m.attr("float32") = DataType::kFLOAT;
    m.def("init_libnvinfer_plugins", &initLibNvInferPlugins, "logger"_a, "namespace"_a);
    """
    init_py = (
        "from .##TENSORRT_MODULE## import *\ndef nptype(t):\n    pass\nILayer.extra = property(lambda s: 1)\n"
    )
    doc = build({"x.cpp": cpp}, init_py, "snippet")
    c = doc["classes"]
    assert c["ILogger"] == {"ERROR": "value", "Severity": "value", "log": "method"}
    assert c["ILogger.Severity"] == {"ERROR": "value", "name": "property", "value": "property"}
    assert c["IConvolutionLayer"] == {
        "extra": "property",
        "num_groups": "property",
        "precision": "property",
        "set_output_type": "method",
    }
    assert c["SliceMode"] == c["SampleMode"]
    assert doc["functions"] == ["init_libnvinfer_plugins", "nptype"] and doc["values"] == ["float32"]


def test_table_generator_refuses_what_it_cannot_read() -> None:
    from tools.trt_api_table import ScanError, build

    with pytest.raises(ScanError, match=r"unknown chain link \.def_magic"):
        build({"x.cpp": 'py::class_<A>(m, "A").def_magic("x");'}, "", "snippet")
    with pytest.raises(ScanError, match=r"no \(scope"):
        build({"x.cpp": 'py::class_<A>(m, name).def("x", f);'}, "", "snippet")
