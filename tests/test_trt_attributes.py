"""Every TensorRT attribute the agent uses exists where it runs: TensorRT-RTX (installed), and TensorRT
8.6.1 and 10.13 (the versions the agent supports on Jetson / datacenter GPUs).

TensorRT cannot run on CI (no supported GPU), so the TensorRT-facing code (SOURCES) only meets
`fake_tensorrt` there. This test reads that code (ast) for attributes taken on TensorRT objects, known by
the variable holding them (RECEIVERS: `config.X`, `self.context.X`, `network.get_layer(i).X`, ...; an
annotation `engine: trt.ICudaEngine` wins over the name), and on the module (`self.mod.X`, `api.mod.X.Y`,
`flags.Y` after `flags = self.mod.BuilderFlag`). Each use is looked up per version: a method the code calls
must be a method there, an attribute it reads or sets a property (or enum value) there.

Probes cope with absence, so a use is checked only where the guards around it hold: `if hasattr(x, "n")`,
`self._has("Cls", "n")`, TrtApi's probe properties (`api.has_dla`, `self.weakly_typed`, ...: read from
engines/trt/module.py), in an `if`/`elif`/`x if ... else`/`and` chain, or before it in the same block as an
early exit (`if not hasattr(...): return/raise/self.fail_unavailable(...)`). A guard naming something a
version lacks makes the code after it unreachable there (so `config.max_workspace_size` under
`hasattr(config, "max_workspace_size")` is not checked on 10.13); a hasattr on an object of unknown class
exempts that attribute name. Unguarded uses must exist in ALL versions. Known exceptions are KNOWN_GAPS,
printed on every run; a new gap fails.

The 8.6.1 table comes from NVIDIA's binding sources (tools/trt_api_table.py), 10.13 from tensorrt-stubs
(tools/trt_stubs.py; the test skips without them), RTX from the installed module. mypy checks the same
code against the 10.13 stubs (tools/test.sh).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trt_stub_index import (
    MODULE,
    SKIP_REASON,
    Index,
    live_index,
    stub_index,
    stub_path,
    table_8_6_1,
    table_source,
)

ROOT = Path(__file__).resolve().parent.parent
TRT_MODULE = ROOT / "engines" / "trt" / "module.py"  # TrtModule, the base of TrtApi: its probe properties
# Every file under engines/ and agent/ that reaches into the TensorRT module (test_sources_cover_...).
SOURCES = [
    "engines/build/trt_plan.py",
    "engines/build/calibrator.py",
    "engines/fingerprint.py",
    "engines/build/int8.py",
    "engines/runtimes/slots.py",
    "engines/runtimes/slot_memory.py",
    "engines/runtimes/dynamic_outputs.py",
    "engines/runtimes/tensorrt.py",
    "engines/runtimes/trt_layers.py",
    "engines/trt/config.py",
    "engines/trt/module.py",
    "engines/trt/network.py",
    "engines/trt/runtime.py",
    "engines/trt/timing_cache.py",
]
SEARCHED = ("engines", "agent")

# Variable name -> the TensorRT class of what it holds, in SOURCES.
RECEIVERS = {
    "builder": "Builder",
    "config": "IBuilderConfig",
    "network": "INetworkDefinition",
    "layer": "ILayer",
    "parser": "OnnxParser",
    "err": "ParserError",
    "cache": "ITimingCache",
    "profile": "IOptimizationProfile",
    "runtime": "Runtime",
    "engine": "ICudaEngine",
    "context": "IExecutionContext",
    "inspector": "EngineInspector",
    "tensor": "ITensor",
    "t": "ITensor",
}
# `self.X` / `self._X` holding a TensorRT object (self.cache: a CalibrationCache in engines.build.calibrator).
SELF_RECEIVERS = {"context": "IExecutionContext", "engine": "ICudaEngine", "runtime": "Runtime"}
# What TensorRT methods return, for chains like `network.get_output(i).name`.
RETURNS = {
    ("Builder", "create_network"): "INetworkDefinition",
    ("Builder", "create_builder_config"): "IBuilderConfig",
    ("Builder", "create_optimization_profile"): "IOptimizationProfile",
    ("INetworkDefinition", "get_layer"): "ILayer",
    ("INetworkDefinition", "get_input"): "ITensor",
    ("INetworkDefinition", "get_output"): "ITensor",
    ("ILayer", "get_input"): "ITensor",
    ("ILayer", "get_output"): "ITensor",
    ("OnnxParser", "get_error"): "ParserError",
    ("IBuilderConfig", "create_timing_cache"): "ITimingCache",
    ("Runtime", "deserialize_cuda_engine"): "ICudaEngine",
    ("ICudaEngine", "create_execution_context"): "IExecutionContext",
    ("ICudaEngine", "create_engine_inspector"): "EngineInspector",
}
# Variables with a receiver's name that hold no TensorRT object ("file:function:name": what they hold).
# Loop and comprehension variables, and parameters annotated with a non-TensorRT type, are known anyway.
NOT_TRT = {
    "engines/build/int8.py:calibration_shape:profile": "{input: Shapes} from profiles_from_json",
}

# What each file is known to use: the extraction must find at least these (calibrator.py and
# int8_build.py reach TensorRT only through TrtApi: nothing of their own).
REQUIRED: dict[str, set[tuple[str, str, str]]] = {
    "engines/build/trt_plan.py": {
        (MODULE, "Builder", "call"),
        (MODULE, "OnnxParser", "call"),
        ("Builder", "create_network", "call"),
        ("Builder", "create_builder_config", "call"),
        ("Builder", "create_optimization_profile", "call"),
        ("Builder", "build_serialized_network", "call"),
        ("IOptimizationProfile", "set_shape", "call"),
        ("OnnxParser", "parse", "call"),
        ("OnnxParser", "parse_from_file", "call"),
        ("OnnxParser", "num_errors", "attr"),
        ("IBuilderConfig", "progress_monitor", "attr"),
    },
    "engines/trt/module.py": set(),  # probes only: hasattr on the module and its classes
    "engines/trt/network.py": {
        ("DataType", "FLOAT", "attr"),
        ("INetworkDefinition", "num_layers", "attr"),
        ("INetworkDefinition", "get_layer", "call"),
        ("INetworkDefinition", "get_output", "call"),
        ("ILayer", "get_output", "call"),
        ("ILayer", "precision", "attr"),
        ("ILayer", "set_output_type", "call"),
        ("ITensor", "dtype", "attr"),
        ("OnnxParser", "num_errors", "attr"),
        ("OnnxParser", "get_error", "call"),
        ("ParserError", "desc", "call"),
    },
    "engines/trt/config.py": {
        ("BuilderFlag", "INT8", "attr"),
        ("IBuilderConfig", "set_flag", "call"),
        ("IBuilderConfig", "add_optimization_profile", "call"),
        ("IBuilderConfig", "set_memory_pool_limit", "call"),
        ("IBuilderConfig", "max_workspace_size", "attr"),
        ("IBuilderConfig", "int8_calibrator", "attr"),
        ("IBuilderConfig", "DLA_core", "attr"),
        ("IBuilderConfig", "can_run_on_DLA", "call"),
    },
    "engines/trt/timing_cache.py": {
        ("IBuilderConfig", "create_timing_cache", "call"),
        ("IBuilderConfig", "set_timing_cache", "call"),
        ("ITimingCache", "combine", "call"),
        ("ITimingCache", "serialize", "call"),
    },
    "engines/trt/runtime.py": {
        (MODULE, "Runtime", "call"),
        ("Runtime", "deserialize_cuda_engine", "call"),
        ("ICudaEngine", "num_io_tensors", "attr"),
        ("ICudaEngine", "get_tensor_name", "call"),
        ("ICudaEngine", "get_tensor_mode", "call"),
        ("ICudaEngine", "get_tensor_dtype", "call"),
        ("ICudaEngine", "get_tensor_shape", "call"),
        ("ICudaEngine", "get_tensor_profile_shape", "call"),
    },
    "engines/fingerprint.py": set(),  # a DLA count, through TrtApi since the Runtime probe
    "engines/runtimes/slots.py": {
        ("ICudaEngine", "create_execution_context", "call"),
        ("ICudaEngine", "num_optimization_profiles", "attr"),
        ("ICudaEngine", "get_tensor_profile_shape", "call"),
        ("IExecutionContext", "set_input_shape", "call"),
        ("IExecutionContext", "set_tensor_address", "call"),
        ("IExecutionContext", "execute_async_v3", "call"),
        ("IExecutionContext", "set_optimization_profile_async", "call"),
        ("IExecutionContext", "get_tensor_shape", "call"),
    },
    "engines/runtimes/slot_memory.py": set(),  # the activation block through TrtApi
    "engines/runtimes/dynamic_outputs.py": {("IExecutionContext", "set_output_allocator", "call")},
    "engines/runtimes/tensorrt.py": {("IExecutionContext", "profiler", "attr")},
    "engines/runtimes/trt_layers.py": {
        ("ICudaEngine", "create_engine_inspector", "call"),
        ("EngineInspector", "execution_context", "attr"),
        ("EngineInspector", "get_engine_information", "call"),
        ("LayerInformationFormat", "JSON", "attr"),
    },
    "engines/build/calibrator.py": set(),
    "engines/build/int8.py": set(),
}

# Unguarded uses that a supported version lacks, found by this test; each is a possible defect of
# engines/ code (not fixed here), "Class.attr" -> why it is listed. Printed on every run; a gap not listed
# fails the test. KNOWN_GAPS: TensorRT 8.6.1 / 10.13; KNOWN_RTX_GAPS: the installed tensorrt_rtx.
# Unguarded uses a supported TensorRT lacks. Empty: the builder attaches its progress monitor under
# api.has_progress_monitor and TrtApi.constrain_* probe weakly_typed themselves. Keep it empty.
KNOWN_GAPS: dict[str, str] = {}
KNOWN_RTX_GAPS: dict[str, str] = {}

Fact = tuple[str, str]  # (class or MODULE, attribute) known to exist; ("*", name): on something unknown


@dataclass(frozen=True)
class Use:
    cls: str  # TensorRT class ("ILogger.Severity" for nested ones), MODULE for the module itself
    attr: str
    kind: str  # "call" | "attr"
    place: str  # "file:line"
    facts: frozenset[Fact] = field(default=frozenset(), compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cls, self.attr, self.kind)


# --- what the guards say -------------------------------------------------------------------------------
@dataclass
class _Resolved:
    what: str  # "instance" | "class" | "module" | "none" (known not to be TensorRT)
    cls: str = ""


_NONE = _Resolved("none")


@dataclass
class _Scope:
    names: dict[str, _Resolved]
    function: str
    parent: _Scope | None = None

    def get(self, name: str) -> _Resolved | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None


def _is_module(node: ast.expr) -> bool:
    """`self.mod`, `api.mod`, `self._api.mod`, `backend.trt_api.mod`: the TensorRT module of a TrtApi."""
    if not (isinstance(node, ast.Attribute) and node.attr == "mod"):
        return False
    v = node.value
    return (isinstance(v, ast.Name) and v.id in ("self", "api")) or (
        isinstance(v, ast.Attribute) and v.attr in ("_api", "api", "trt_api")
    )


def _annotation(node: ast.expr | None) -> _Resolved | None:
    """The class an annotation names: trt.X (also in a string or `| None`), None for Any/absent."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _annotation(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [p for p in (_annotation(node.left), _annotation(node.right)) if p is not None]
        trt = [p for p in parts if p.what == "instance"]
        return trt[0] if trt else (_NONE if parts else None)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trt":
        return _Resolved("instance", node.attr)
    if isinstance(node, ast.Name) and node.id == "Any":
        return None
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    return _NONE  # any other type: not a TensorRT object


def _exits(body: list[ast.stmt]) -> bool:
    """The block never falls through: return/raise/continue/break, or a NoReturn fail_unavailable()."""
    last = body[-1]
    if isinstance(last, ast.Return | ast.Raise | ast.Continue | ast.Break):
        return True
    return (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and isinstance(last.value.func, ast.Attribute)
        and last.value.func.attr == "fail_unavailable"
    )


class _Extractor:
    """Uses of TensorRT attributes in one source, each with the facts its guards establish."""

    def __init__(self, name: str, probes: dict[str, frozenset[Fact]], ensures: dict[str, frozenset[Fact]]):
        self.name, self.probes, self.ensures = name, probes, ensures
        self.uses: list[Use] = []
        self.not_trt_seen: set[str] = set()

    # -- classes of expressions
    def resolve(self, node: ast.expr, scope: _Scope) -> _Resolved | None:
        if _is_module(node):
            return _Resolved("module", MODULE)
        if isinstance(node, ast.Name):
            found = scope.get(node.id)
            if found is not None:
                return found if found.what != "none" else None
            return _Resolved("instance", RECEIVERS[node.id]) if node.id in RECEIVERS else None
        if isinstance(node, ast.Attribute):
            v = node.value
            if isinstance(v, ast.Name) and v.id == "self" and node.attr.lstrip("_") in SELF_RECEIVERS:
                return _Resolved("instance", SELF_RECEIVERS[node.attr.lstrip("_")])
            base = self.resolve(v, scope)
            if base is not None and base.what == "module":
                return _Resolved("class", node.attr)
            if base is not None and base.what == "class":
                return _Resolved("class", f"{base.cls}.{node.attr}")
            return None
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2:
                base = self.resolve(node.args[0], scope)
                n = node.args[1]
                if base is not None and isinstance(n, ast.Constant) and isinstance(n.value, str):
                    return self.resolve(ast.Attribute(node.args[0], n.value, ast.Load()), scope)
                return None
            callee = self.resolve(f, scope) if isinstance(f, ast.Attribute) else None
            if callee is not None and callee.what == "class":  # self.mod.Runtime(logger)
                return _Resolved("instance", callee.cls)
            if isinstance(f, ast.Attribute):
                owner = self.resolve(f.value, scope)
                if owner is not None and owner.what == "instance" and (owner.cls, f.attr) in RETURNS:
                    return _Resolved("instance", RETURNS[(owner.cls, f.attr)])
        return None

    # -- facts
    def pos(self, node: ast.expr, scope: _Scope) -> frozenset[Fact]:
        """What holds where `node` is true."""
        if isinstance(node, ast.BoolOp):
            parts = [self.pos(v, scope) for v in node.values]
            if isinstance(node.op, ast.And):
                return frozenset().union(*parts)
            return frozenset.intersection(*parts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self.neg(node.operand, scope)
        if isinstance(node, ast.Attribute) and node.attr in self.probes:
            return self.probes[node.attr]
        if isinstance(node, ast.Call):
            f, args = node.func, node.args
            strs = [a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if isinstance(f, ast.Name) and f.id == "hasattr" and len(args) == 2 and len(strs) == 1:
                owner = self.resolve(args[0], scope)
                return frozenset({(owner.cls if owner is not None else "*", strs[0])})
            if isinstance(f, ast.Attribute) and f.attr == "_has" and len(strs) == 2:
                return frozenset({(strs[0], strs[1]), (MODULE, strs[0])})
        return frozenset()

    def neg(self, node: ast.expr, scope: _Scope) -> frozenset[Fact]:
        """What holds where `node` is false."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self.pos(node.operand, scope)
        if isinstance(node, ast.BoolOp):
            parts = [self.neg(v, scope) for v in node.values]
            if isinstance(node.op, ast.Or):
                return frozenset().union(*parts)
            return frozenset.intersection(*parts)
        return frozenset()

    # -- scopes
    def function_scope(
        self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, parent: _Scope
    ) -> _Scope:
        name = getattr(fn, "name", "<lambda>")
        scope = _Scope({}, name if parent.function == "<module>" else f"{parent.function}.{name}", parent)
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]:
            found = _annotation(arg.annotation)
            if found is None:  # unannotated or Any: known by its name, if at all (shadows outer names)
                found = _Resolved("instance", RECEIVERS[arg.arg]) if arg.arg in RECEIVERS else _NONE
            scope.names[arg.arg] = found
        if isinstance(fn, ast.Lambda):  # key=lambda t: ...: callbacks over plain data
            scope.names.update(dict.fromkeys(scope.names, _NONE))
            return scope
        assigned: dict[str, list[_Resolved | None]] = defaultdict(list)
        loops: set[str] = set()
        for node in self._own_nodes(fn.body):
            if isinstance(node, ast.For | ast.AsyncFor):
                loops |= {t.id for t in ast.walk(node.target) if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                assigned[node.target.id].append(_annotation(node.annotation))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    assigned[target.id].append(self._assigned(node.value, scope))
        for var, found in assigned.items():
            if found[0] is not None and all(f == found[0] for f in found):  # every assignment agrees
                scope.names[var] = found[0]
        scope.names.update(dict.fromkeys(loops, _NONE))
        for key in NOT_TRT:
            file, function, var = key.split(":")
            if file == self.name and function == scope.function:
                scope.names[var] = _NONE
                self.not_trt_seen.add(key)
        return scope

    def _assigned(self, value: ast.expr, scope: _Scope) -> _Resolved | None:
        """What `x = value` makes x: a TensorRT instance or class (flags = self.mod.BuilderFlag), not
        TensorRT (x = CalibrationCache(...): a constructor of the agent's own), or unknown (None)."""
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id[:1].isupper():
            return _NONE
        return self.resolve(value, scope)

    @staticmethod
    def _own_nodes(body: list[ast.stmt]) -> list[ast.AST]:
        """Nodes of a function body, not those of functions or classes nested in it."""
        out: list[ast.AST] = []
        stack: list[ast.AST] = list(body)
        while stack:
            node = stack.pop()
            out.append(node)
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                stack.extend(ast.iter_child_nodes(node))
        return out

    # -- statements
    def block(self, body: list[ast.stmt], facts: frozenset[Fact], scope: _Scope) -> None:
        for s in body:
            self.stmt(s, facts, scope)
            if isinstance(s, ast.If) and not s.orelse and _exits(s.body):
                facts = facts | self.neg(s.test, scope)  # `if not probe: return` guards what follows
            elif (
                isinstance(s, ast.Expr)
                and isinstance(s.value, ast.Call)
                and isinstance(s.value.func, ast.Attribute)
                and s.value.func.attr in self.ensures
            ):
                facts = facts | self.ensures[s.value.func.attr]  # api.require_execution()

    def stmt(self, s: ast.stmt, facts: frozenset[Fact], scope: _Scope) -> None:
        if isinstance(s, ast.If | ast.While):
            self.expr(s.test, facts, scope)
            self.block(s.body, facts | self.pos(s.test, scope), scope)
            self.block(s.orelse, facts | self.neg(s.test, scope), scope)
        elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in s.decorator_list:
                self.expr(d, facts, scope)
            self.block(s.body, facts, self.function_scope(s, scope))
        elif isinstance(s, ast.ClassDef):
            for b in s.bases:
                self.expr(b, facts, scope)
            self.block(s.body, facts, scope)
        else:  # for, with, try, assignments ...: statement lists as blocks (early exits carry on)
            self.fields(s, facts, scope)

    def fields(self, node: ast.AST, facts: frozenset[Fact], scope: _Scope) -> None:
        for _, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            if items and all(isinstance(v, ast.stmt) for v in items):
                self.block(items, facts, scope)
                continue
            for v in items:
                if isinstance(v, ast.expr):
                    self.expr(v, facts, scope)
                elif isinstance(v, ast.excepthandler | ast.withitem | ast.match_case):
                    self.fields(v, facts, scope)

    # -- expressions
    def expr(self, node: ast.expr, facts: frozenset[Fact], scope: _Scope, called: bool = False) -> None:
        if isinstance(node, ast.IfExp):
            self.expr(node.test, facts, scope)
            self.expr(node.body, facts | self.pos(node.test, scope), scope)
            self.expr(node.orelse, facts | self.neg(node.test, scope), scope)
        elif isinstance(node, ast.BoolOp):
            known = facts
            for v in node.values:
                self.expr(v, known, scope)
                known = known | (self.pos(v, scope) if isinstance(node.op, ast.And) else self.neg(v, scope))
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = _Scope({}, scope.function, scope)
            for gen in node.generators:
                self.expr(gen.iter, facts, inner)
                for t in ast.walk(gen.target):
                    if isinstance(t, ast.Name):
                        inner.names[t.id] = _NONE
                for cond in gen.ifs:
                    self.expr(cond, facts, inner)
            for part in [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]:
                self.expr(part, facts, inner)
        elif isinstance(node, ast.Lambda):
            self.expr(node.body, facts, self.function_scope(node, scope))
        elif isinstance(node, ast.Call):
            self.expr(node.func, facts, scope, called=True)
            for a in [*node.args, *(k.value for k in node.keywords)]:
                self.expr(a, facts, scope)
        elif isinstance(node, ast.Attribute):
            owner = self.resolve(node.value, scope)
            if owner is not None and not node.attr.startswith("__"):
                kind = "call" if called else "attr"
                exempt = ("*", node.attr) in facts
                if not exempt:
                    place = f"{self.name}:{node.lineno}"
                    self.uses.append(Use(owner.cls, node.attr, kind, place, facts))
            self.expr(node.value, facts, scope)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, facts, scope)


def trt_api_probes(text: str) -> tuple[dict[str, frozenset[Fact]], dict[str, frozenset[Fact]]]:
    """TrtApi's probe properties -> the facts they establish when true; its `require_*` methods (a lone
    `if not ...: raise`) -> the facts that hold after a call returns."""
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrtModule")
    probes: dict[str, frozenset[Fact]] = {}
    ensures: dict[str, frozenset[Fact]] = {}
    ex = _Extractor("engines/trt/module.py", probes, ensures)  # probes fill in as they are read, in order
    scope = _Scope({}, "TrtModule")
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        is_prop = any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        if is_prop and len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
            probes[fn.name] = ex.pos(body[0].value, scope)
        elif len(body) == 1 and isinstance(body[0], ast.If) and not body[0].orelse and _exits(body[0].body):
            ensures[fn.name] = ex.neg(body[0].test, scope)
    return probes, ensures


def extract_source(
    text: str,
    name: str,
    probes: dict[str, frozenset[Fact]] | None = None,
    ensures: dict[str, frozenset[Fact]] | None = None,
) -> list[Use]:
    """The TensorRT attribute uses in one source text."""
    if probes is None or ensures is None:
        probes, ensures = trt_api_probes((TRT_MODULE).read_text())
    ex = _Extractor(name, probes, ensures)
    ex.block(ast.parse(text, name).body, frozenset(), _Scope({}, "<module>"))
    return ex.uses


def extract(rel: str | None = None) -> list[Use]:
    """Uses in SOURCES (or one of them)."""
    probes, ensures = trt_api_probes((TRT_MODULE).read_text())
    out: list[Use] = []
    for path in [rel] if rel else SOURCES:
        out += extract_source((ROOT / path).read_text(), path, probes, ensures)
    return out


def by_key(uses: list[Use]) -> dict[tuple[str, str, str], list[str]]:
    out: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for u in uses:
        out[u.key].append(u.place)
    return dict(out)


def _listing(uses: list[Use]) -> str:
    return "\n".join(f"  {c}.{a} ({k}) at {', '.join(p)}" for (c, a, k), p in sorted(by_key(uses).items()))


# --- checking against one version ----------------------------------------------------------------------
def _exists(index: Index, cls: str, attr: str) -> bool:
    return attr in index.get(cls, {})


def problem(use: Use, index: Index) -> str | None:
    """Why `use` fails on the version `index` describes; None when it is fine or unreachable there."""
    if any(c != "*" and not _exists(index, c, a) for c, a in use.facts):
        return None  # a guard fails on this version: the code does not run there
    members = index.get(use.cls)
    if members is None:
        return f"no class {use.cls}"
    kind = members.get(use.attr)
    if kind is None:
        return "missing"
    if use.kind == "call" and kind not in ("method", "class") and f"{use.cls}.{use.attr}" not in index:
        return f"called, but a {kind}"
    if use.kind == "attr" and kind == "method" and use.cls != MODULE:
        return "read or set as an attribute, but a method"
    return None


def problems(uses: list[Use], versions: dict[str, Index]) -> dict[str, list[str]]:
    """{"Class.attr": ["(call) at file:line: 8.6.1 missing", ...]} over every version."""
    out: dict[str, list[str]] = defaultdict(list)
    for u in uses:
        for label, index in versions.items():
            why = problem(u, index)
            if why is not None:
                out[f"{u.cls}.{u.attr}"].append(f"({u.kind}) at {u.place}: {label} {why}")
    return dict(out)


def _gap_report(name: str, found: dict[str, list[str]], known: dict[str, str]) -> tuple[list[str], str]:
    """(new gap lines, the printed report of known ones)."""
    new = [f"{k}: {'; '.join(v)}" for k, v in sorted(found.items()) if k not in known]
    lines = [f"  {k} -- {known[k]}\n    {'; '.join(found[k])}" for k in sorted(known) if k in found]
    stale = [k for k in sorted(known) if k not in found]
    text = f"{name} (known unguarded uses some supported TensorRT lacks):\n" + "\n".join(lines)
    if stale:
        text += f"\n  no longer gaps (remove from {name}): " + ", ".join(stale)
    return new, text


# --- tests -------------------------------------------------------------------------------------------
def test_sources_cover_every_tensorrt_facing_file():
    """A new file that imports TensorRT or reaches for a TrtApi's `.mod` must join SOURCES."""
    facing = set()
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                imports = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(m.split(".")[0] in ("tensorrt", "tensorrt_rtx") for m in imports) or (
                    isinstance(node, ast.Attribute) and _is_module(node)
                ):
                    facing.add(str(path.relative_to(ROOT)))
                    break
    assert facing - set(SOURCES) == set(), (
        f"TensorRT-facing files missing from SOURCES: {facing - set(SOURCES)}"
    )
    assert set(REQUIRED) == set(SOURCES)


@pytest.mark.parametrize("rel", SOURCES)
def test_extraction_finds_the_main_calls(rel: str):
    uses = extract(rel)
    missing = REQUIRED[rel] - set(by_key(uses))
    assert not missing, (
        f"the ast extraction no longer finds {sorted(missing)} in {rel}; it found:\n{_listing(uses)}\n"
        "(renamed variables? update RECEIVERS, or REQUIRED if the code stopped using them)"
    )


def test_not_trt_entries_are_used():
    ex = _Extractor("", {}, {})
    for rel in SOURCES:
        ex.name = rel
        ex.block(ast.parse((ROOT / rel).read_text()).body, frozenset(), _Scope({}, "<module>"))
    assert set(NOT_TRT) <= ex.not_trt_seen, f"stale NOT_TRT entries: {set(NOT_TRT) - ex.not_trt_seen}"


def test_probe_properties_are_read_from_trt_api():
    probes, ensures = trt_api_probes((TRT_MODULE).read_text())
    dla = {
        ("DeviceType", "DLA"),
        ("IBuilderConfig", "DLA_core"),
        (MODULE, "DeviceType"),
        (MODULE, "IBuilderConfig"),
    }
    assert probes["has_dla"] == dla
    assert ("BuilderFlag", "FP16") in probes["has_int8_calibration"]  # through self.weakly_typed
    assert (MODULE, "IInt8EntropyCalibrator2") in probes["has_int8_calibration"]
    assert probes["strongly_typed"] == frozenset()  # a negation establishes nothing
    assert ("IExecutionContext", "execute_async_v3") in ensures["require_execution"]


def test_extraction_sees_calls_attributes_and_guards():
    """The extraction itself, on a snippet: receivers by name, self attribute, annotation and module
    chain; kinds; loop variables, probes and guarded uses."""
    src = (
        "def f(self, engine, context, runtime, other, t: IoTensor, cfg: trt.IBuilderConfig, config):\n"
        "    self.context.execute_async_v3(0); engine.num_io_tensors\n"
        "    self._runtime.deserialize_cuda_engine(b'')\n"
        "    other.get_tensor_name(0); hasattr(engine, 'probe'); context.set_input_shape('x', (1,))\n"
        "    t.name; cfg.set_flag(self.mod.BuilderFlag.FP16)\n"
        "    [layer.index for layer in layers]\n"
        "    config.set_memroy_pool_limit(0, 1)\n"  # misspelt, unguarded: a use
        "    if hasattr(config, 'max_workspace_size'):\n"
        "        config.max_workspace_size = 1\n"
        "    if not self._has('ComputeCapability', 'NONE'):\n"
        "        return\n"
        "    self.mod.ComputeCapability.CURRENT\n"
    )
    uses = extract_source(src, "snippet")
    assert set(by_key(uses)) == {
        ("IExecutionContext", "execute_async_v3", "call"),
        ("ICudaEngine", "num_io_tensors", "attr"),
        ("Runtime", "deserialize_cuda_engine", "call"),
        ("IExecutionContext", "set_input_shape", "call"),
        ("IBuilderConfig", "set_flag", "call"),
        (MODULE, "BuilderFlag", "attr"),
        ("BuilderFlag", "FP16", "attr"),
        ("IBuilderConfig", "set_memroy_pool_limit", "call"),
        ("IBuilderConfig", "max_workspace_size", "attr"),
        (MODULE, "ComputeCapability", "attr"),
        ("ComputeCapability", "CURRENT", "attr"),
    }
    guarded = {u.attr: u.facts for u in uses}
    assert guarded["max_workspace_size"] == {("IBuilderConfig", "max_workspace_size")}
    assert ("ComputeCapability", "NONE") in guarded["CURRENT"]
    assert guarded["set_memroy_pool_limit"] == frozenset()


def test_extraction_knows_plain_data_by_scope():
    """Loop, comprehension and lambda variables, constructor results of the agent's own classes and
    non-TensorRT annotations hold no TensorRT object; method results chain (RETURNS); an early exit inside
    a `try` guards the rest of it; a nested function keeps the guards around its definition."""
    src = (
        "def f(self, network, cache: CalibrationCache, engine: trt.ICudaEngine | None):\n"
        "    for layer in layers: layer.index\n"
        "    sorted(io, key=lambda t: t.is_input); {t.name for t in io}\n"
        "    cache.path; profile = Profile(); profile.items()\n"
        "    network.get_layer(0).get_output(0).dtype; engine.num_layers\n"
        "    try:\n"
        "        if not hasattr(network, 'new_thing'):\n"
        "            return\n"
        "        network.new_thing\n"
        "        def inner(config):\n"
        "            config.set_flag(1)\n"
        "    finally:\n"
        "        pass\n"
    )
    uses = extract_source(src, "snippet", {}, {})
    assert {u.key for u in uses} == {
        ("INetworkDefinition", "get_layer", "call"),
        ("ILayer", "get_output", "call"),
        ("ITensor", "dtype", "attr"),
        ("ICudaEngine", "num_layers", "attr"),
        ("INetworkDefinition", "new_thing", "attr"),
        ("IBuilderConfig", "set_flag", "call"),
    }
    facts = {u.attr: u.facts for u in uses}
    assert facts["new_thing"] == facts["set_flag"] == {("INetworkDefinition", "new_thing")}


def test_checking_flags_unguarded_misspellings_and_spares_guarded_uses():
    """Against a two-version toy index: the misspelt call fails everywhere, the guarded 8.6-only property
    is checked where it exists and skipped where it does not, a wrong kind is named."""
    src = (
        "def f(self, config):\n"
        "    config.set_memroy_pool_limit(0, 1)\n"
        "    if hasattr(config, 'max_workspace_size'):\n"
        "        config.max_workspace_size = 1\n"
        "    if hasattr(config, 'set_memory_pool_limit'):\n"
        "        config.set_memory_pool_limit(0, 1)\n"
        "    config.set_flag(1); config.flags()\n"
        "    if hasattr(thing, 'mystery'):\n"
        "        config.mystery()\n"  # a hasattr on an unknown object exempts the name
    )
    old = {"IBuilderConfig": {"max_workspace_size": "property", "set_flag": "method", "flags": "property"}}
    new = {"IBuilderConfig": {"set_memory_pool_limit": "method", "set_flag": "method", "flags": "property"}}
    found = problems(extract_source(src, "snippet", {}, {}), {"old": old, "new": new})
    misspelt = ["(call) at snippet:2: old missing", "(call) at snippet:2: new missing"]
    wrong_kind = [f"(call) at snippet:7: {v} called, but a property" for v in ("old", "new")]
    assert found == {"IBuilderConfig.set_memroy_pool_limit": misspelt, "IBuilderConfig.flags": wrong_kind}
    new_gaps, report = _gap_report("toy", found, {"IBuilderConfig.flags": "a test entry", "X.y": "fixed"})
    assert new_gaps == [f"IBuilderConfig.set_memroy_pool_limit: {'; '.join(misspelt)}"]
    assert "a test entry" in report and "remove from toy): X.y" in report


def test_every_used_attribute_exists_in_tensorrt_rtx():
    """Where the guards hold on TensorRT-RTX, every use is there with the right kind."""
    trt = pytest.importorskip("tensorrt_rtx")
    uses = extract()
    found = problems(uses, {f"tensorrt_rtx {trt.__version__}": live_index(trt)})
    new, report = _gap_report("KNOWN_RTX_GAPS", found, KNOWN_RTX_GAPS)
    print(report)
    assert not new, (
        "TensorRT attributes the agent uses unguarded that tensorrt_rtx lacks (as used):\n  "
        + "\n  ".join(new)
        + f"\nall uses extracted:\n{_listing(uses)}"
    )


def test_every_unguarded_use_exists_in_tensorrt_8_6_1_and_10_13():
    """The versions the agent supports beside RTX: 8.6.1 (the oldest the `tensorrt` extra allows on a
    server; Jetsons start at JetPack 6's 10.3; table from NVIDIA's bindings) and 10.13 (tensorrt-stubs).
    Version-specific code must sit behind a probe."""
    if stub_path() is None:
        pytest.skip(SKIP_REASON)
    uses = extract()
    found = problems(uses, {"TensorRT 8.6.1": table_8_6_1(), "TensorRT 10.13": stub_index()})
    new, report = _gap_report("KNOWN_GAPS", found, KNOWN_GAPS)
    print(f"8.6.1 table: {table_source()}\n{report}")
    assert not new, (
        "TensorRT attributes the agent uses unguarded that TensorRT 8.6.1 or 10.13 lacks (as used):\n  "
        + "\n  ".join(new)
        + "\n(guard them with a probe, fix the use, or list them in KNOWN_GAPS with the reason)"
        + f"\nall uses extracted:\n{_listing(uses)}"
    )


def test_module_level_names_of_the_runtime_path_exist():
    """trt_api reaches these through the module: Runtime(logger), TensorIOMode.INPUT, nptype()."""
    trt = pytest.importorskip("tensorrt_rtx")
    assert callable(trt.Runtime) and hasattr(trt.TensorIOMode, "INPUT") and callable(trt.nptype)


def test_module_level_names_of_the_layer_view_exist():
    """trt_api / trt_layers reach these through the module: the DETAILED verbosity set on the builder
    config, the inspector's JSON format, and the IProfiler base class with its callback."""
    import inspect

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
    from engines.build.builder import build
    from engines.fingerprint import probe_fingerprint
    from engines.runtimes.base import BackendError
    from engines.runtimes.tensorrt import TensorRTBackend
    from engines.settings import BuildSettings
    from engines.store import EngineStore
    from engines.trt import import_trt

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
