"""Indexes of the TensorRT Python API the agent supports, in one shape: {class: {member: kind}}.

    stub_index()        # TensorRT 10.13, from tensorrt-stubs (tools/trt_stubs.py installs them)
    table_8_6_1()       # TensorRT 8.6.1, from tests/data/trt_api_8_6_1.json (tools/trt_api_table.py)
    live_index(module)  # an importable module (tensorrt_rtx), by introspection
    fake_gaps(fake_tensorrt.make(...))   # what the fake defines that neither real version has

Kinds: "method" (callable), "property" (read/set on an instance), "value" (an enum member, class
constant or nested class); the "__module__" entry holds module-level names, with "class" for classes.
Nested classes are entries of their own ("ILogger.Severity"). Members include inherited ones, as Python
attribute lookup sees them.
"""

from __future__ import annotations

import ast
import enum
import functools
import inspect
import json
import textwrap
import types
from pathlib import Path
from typing import Any

from tools import trt_stubs

MODULE = "__module__"
TABLE_8_6_1 = Path(__file__).resolve().parent / "data" / "trt_api_8_6_1.json"
Index = dict[str, dict[str, str]]

# Test plumbing of tests/fake_tensorrt.py, not TensorRT API and never read by engines/ code: module knobs
# and records, and the state fake objects keep of what they were given (by the TensorRT class the fake
# class stands for). Helper methods/properties that look like API are not here: see KNOWN_FAKE_GAPS in
# tests/test_fake_tensorrt_stubs.py.
FAKE_ONLY = {
    "calls",  # every fake call, in order (assertions)
    "last_network",  # the network the last create_network made (assertions)
    "last_plan_layers",  # the layers and precisions of the last plan built (assertions)
    "ENGINE_IO",  # the IO every fake plan deserialises to
    "ENGINE_PROFILES",  # how many optimisation profiles that engine has
    "refuse_loads",  # the next N plans are refused ...
    "refusal",  # ... with this TensorRT message
    "plugins_registered",  # init_libnvinfer_plugins was called
    "IBuilderConfig.flags_set",  # flags set_flag received
    "IBuilderConfig.cleared",  # flags clear_flag received
    "IBuilderConfig.profiles",  # profiles add_optimization_profile accepted
    "IBuilderConfig.pool_limits",  # set_memory_pool_limit's values
    "IBuilderConfig.timing_cache",  # the cache set_timing_cache accepted
    "INetworkDefinition.flags",  # create_network's flags
    "INetworkDefinition.layers",  # the layers behind num_layers / get_layer
    "INetworkDefinition.outputs",  # the outputs behind num_outputs / get_output
    "INetworkDefinition.tensors",  # every tensor by name
    "ILayer.output_types",  # what set_output_type received
    "OnnxParser.errors",  # the errors behind num_errors / get_error
    "OnnxParser.network",  # the network it fills
    "ICudaEngine.io",  # (name, mode, shape, dtype, profile) rows behind the tensor getters
    "IExecutionContext.shapes",  # what set_input_shape accepted
    "IExecutionContext.addresses",  # what set_tensor_address accepted
    "IOptimizationProfile.shapes",  # what set_shape received
    "ITimingCache.keys",  # the entries behind queryKeys / serialize
    "ITimingCache.version",  # the TensorRT version a cache was made by (set_timing_cache refuses others)
    "IInt8EntropyCalibrator2.base_initialised",  # the subclass called the trampoline's __init__
    "IInt8MinMaxCalibrator.base_initialised",
    "IInt8LegacyCalibrator.base_initialised",
}
# Fake classes that are not module attributes (made and returned by fake methods): the TensorRT class
# each stands for.
FAKE_CLASS_NAMES = {
    "Network": "INetworkDefinition",
    "Layer": "ILayer",
    "Tensor": "ITensor",
    "TimingCache": "ITimingCache",
    "Profile": "IOptimizationProfile",
    "Engine": "ICudaEngine",
    "ExecutionContext": "IExecutionContext",
    "ParserError": "ParserError",
}


def stub_path() -> Path | None:
    """tensorrt.pyi of the repaired tensorrt-stubs (TensorRT 10.13), None where not installed."""
    path = trt_stubs.target() / "tensorrt_bindings" / "tensorrt.pyi"
    return path if (trt_stubs.target() / ".repaired").is_file() and path.is_file() else None


SKIP_REASON = "tensorrt-stubs are not installed: run `python tools/trt_stubs.py` once"


# --- the 10.13 stubs ------------------------------------------------------------------------------
def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("typing.ClassVar", "ClassVar"))


def _class_members(node: ast.ClassDef, prefix: str, out: Index, bases: dict[str, list[str]]) -> None:
    name = f"{prefix}{node.name}"
    members: dict[str, str] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            decorators = [ast.unparse(d) for d in item.decorator_list]
            prop = any(d == "property" or d.endswith((".setter", ".getter", ".deleter")) for d in decorators)
            members[item.name] = "property" if prop else "method"
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = "value" if _is_classvar(item.annotation) else "property"
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                if isinstance(t, ast.Name):
                    members[t.id] = "value"
        elif isinstance(item, ast.ClassDef):
            members[item.name] = "value"  # read as an attribute of its class: ILogger.Severity
            _class_members(item, f"{name}.", out, bases)
    out[name] = members
    bases[name] = [ast.unparse(b) for b in node.bases]


def _flatten(own: Index, bases: dict[str, list[str]]) -> Index:
    done: Index = {}

    def resolve(name: str) -> dict[str, str]:
        if name not in done:
            merged: dict[str, str] = {}
            for base in bases.get(name, []):
                if base in own:
                    merged.update(resolve(base))
            merged.update(own[name])
            done[name] = merged
        return done[name]

    return {name: resolve(name) for name in own}


def parse_stub(text: str, extra_module_text: str = "") -> Index:
    """Index of a .pyi text; `extra_module_text` adds module-level names (the package __init__.pyi)."""
    own: Index = {}
    bases: dict[str, list[str]] = {}
    module: dict[str, str] = {}
    for tree in (ast.parse(text), ast.parse(extra_module_text)):
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                _class_members(node, "", own, bases)
                module[node.name] = "class"
            elif isinstance(node, ast.FunctionDef):
                module[node.name] = "method"
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                module.setdefault(node.target.id, "value")
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id != "__all__":
                        module.setdefault(t.id, "value")
    index = _flatten(own, bases)
    index[MODULE] = module
    return index


@functools.cache
def stub_index() -> Index:
    """{class: {member: kind}} of TensorRT 10.13 (tensorrt-stubs); empty where they are not installed."""
    path = stub_path()
    if path is None:
        return {}
    init = path.parent / "__init__.pyi"  # nptype, volume: Python functions of the wheel's __init__.py
    return parse_stub(path.read_text(), init.read_text() if init.is_file() else "")


# --- the 8.6.1 table ------------------------------------------------------------------------------
@functools.cache
def table_8_6_1() -> Index:
    """{class: {member: kind}} of TensorRT 8.6.1, from the committed table."""
    doc = json.loads(TABLE_8_6_1.read_text())
    index: Index = {name: dict(members) for name, members in doc["classes"].items()}
    module = {name: "class" for name in doc["classes"] if "." not in name}
    module.update(dict.fromkeys(doc["functions"], "method"))
    module.update(dict.fromkeys(doc["values"], "value"))
    index[MODULE] = module
    return index


def table_source() -> str:
    return str(json.loads(TABLE_8_6_1.read_text())["source"])


# --- an importable module -------------------------------------------------------------------------
def _kind(value: Any) -> str:
    if isinstance(value, property | types.GetSetDescriptorType | types.MemberDescriptorType):
        return "property"
    if isinstance(value, staticmethod | classmethod) or (callable(value) and not isinstance(value, type)):
        return "method" if not isinstance(value, enum.Enum) else "value"
    return "value"


def live_index(mod: types.ModuleType) -> Index:
    """{class: {member: kind}} of an imported TensorRT module (tensorrt_rtx), by static lookup."""
    index: Index = {}

    def add(name: str, cls: type) -> None:
        members: dict[str, str] = {}
        for attr in dir(cls):
            try:
                value = inspect.getattr_static(cls, attr)
            except AttributeError:
                continue
            members[attr] = _kind(value)
            nested = isinstance(value, type) and value.__module__ == cls.__module__ and name.count(".") < 2
            if nested and not attr.startswith("__"):
                add(f"{name}.{attr}", value)
        index[name] = members

    module: dict[str, str] = {}
    for attr in dir(mod):
        value = getattr(mod, attr)
        if isinstance(value, type):
            module[attr] = "class"
            add(attr, value)
        else:
            module[attr] = "method" if callable(value) else "value"
    index[MODULE] = module
    return index


# --- the fake -------------------------------------------------------------------------------------
def _instance_attributes(cls: type) -> set[str]:
    """Names a class's own functions assign on `self` (self.x = ..., self.a, self.b = ...)."""
    names: set[str] = set()
    for value in vars(cls).values():
        func = value.fget if isinstance(value, property) else value
        if not inspect.isfunction(func) or func.__name__ == "<lambda>":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError):
            continue
        args = tree.body[0].args.args if isinstance(tree.body[0], ast.FunctionDef) else []
        if not args:
            continue
        me = args[0].arg
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == me:
                        names.add(el.attr)
    return names


def _closure_classes(cls: type) -> list[type]:
    """Classes a class's functions reach through their closures (the fake's hidden Network, Layer...)."""
    found = []
    for value in vars(cls).values():
        func = value.fget if isinstance(value, property) else value
        for cell in getattr(func, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(content, type):
                found.append(content)
    return found


def fake_members(mod: types.ModuleType) -> dict[str, dict[str, str]]:
    """{TensorRT class name: {public attribute: kind}} of what a fake module defines; MODULE for its
    own names. Enums contribute their members; instance attributes set in the fake's methods count."""
    out: dict[str, dict[str, str]] = {MODULE: {}}
    seen: set[type] = set()

    def add(name: str, cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        members = out.setdefault(name, {})
        if issubclass(cls, enum.Enum):
            members.update(dict.fromkeys(cls.__members__, "value"))
            return
        for klass in cls.__mro__[:-1]:  # not `object`
            for attr, value in vars(klass).items():
                if attr.startswith("_"):
                    continue
                members.setdefault(attr, _kind(value))
                if isinstance(value, type):
                    add(f"{name}.{attr}", value)
            for attr in _instance_attributes(klass):
                if not attr.startswith("_"):
                    members.setdefault(attr, "property")
        for hidden in _closure_classes(cls):
            add(FAKE_CLASS_NAMES.get(hidden.__name__, hidden.__name__), hidden)

    for attr, value in vars(mod).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, type):
            out[MODULE][attr] = "class"
            add(attr, value)
        else:
            out[MODULE][attr] = _kind(value)
    return out


def fake_gaps(mod: types.ModuleType) -> list[str]:
    """Every public name the fake defines that NEITHER TensorRT 10.13 (stubs) NOR 8.6.1 (table) has, as
    "Class.attr" (module-level: "name"); FAKE_ONLY and names starting with "_" are allowed. Empty where
    the stubs are missing: check stub_path() first."""
    if stub_path() is None:
        return []
    real = (stub_index(), table_8_6_1())
    gaps = []
    for cls, members in sorted(fake_members(mod).items()):
        for attr in sorted(members):
            label = attr if cls == MODULE else f"{cls}.{attr}"
            if label in FAKE_ONLY:
                continue
            if not any(attr in index.get(cls, {}) for index in real):
                gaps.append(label)
    return gaps


def fake_kind_mismatches(mod: types.ModuleType) -> list[str]:
    """Fake attributes that exist for real but as another kind (a method where TensorRT has a property,
    or the reverse) in every real version that has them: code passing on the fake would fail for real."""
    if stub_path() is None:
        return []
    real = (stub_index(), table_8_6_1())
    out = []
    for cls, members in sorted(fake_members(mod).items()):
        if cls == MODULE:
            continue
        for attr, kind in sorted(members.items()):
            kinds = {index[cls][attr] for index in real if attr in index.get(cls, {})}
            callable_here, callable_there = kind == "method", {k == "method" for k in kinds}
            if kinds and callable_here not in callable_there:
                out.append(f"{cls}.{attr} ({kind} in the fake, {'/'.join(sorted(kinds))} in TensorRT)")
    return out
