"""Write the TensorRT 8.6.1 Python API names (tests/data/trt_api_8_6_1.json) from NVIDIA's pybind11 sources.

    python tools/trt_api_table.py --git-dir <mirror of github.com/NVIDIA/TensorRT> [--ref v8.6.1] [-o FILE]

TensorRT 8.6 has no published stubs and no GPU here to import it on, so tests/test_trt_attributes.py
checks the agent's unguarded TensorRT uses against this table (and the 10.13 stubs). It is read from the
binding sources at a tag of NVIDIA/TensorRT (python/src/**/*.cpp): py::class_ / py::enum_ declarations
(m, "Name") and their chained .def / .def_static ("method"), .def_property / _readonly / .def_readwrite /
.def_readonly ("property") and .value ("value"; .export_values() copies them into the enclosing scope);
m.def (module functions), m.attr (module values; an alias of a class is that class). Bases named in a
class_'s template arguments are flattened in, as Python attribute lookup sees them. The wheel's
tensorrt/__init__.py adds a few more (nptype, volume, Logger.Severity, DataType.itemsize), read with ast.
Preprocessor blocks are taken as the full `tensorrt` wheel builds them (EXPORT_ALL_BINDINGS on,
ENABLE_INETWORK_SERIALIZE off). Anything the scanner cannot read is an error, not a silent gap.

Checked against tensorrt-stubs: run on release/10.13 it gives the stubs' 201 classes and their members,
but for what the stub generator leaves out (write-only properties: Builder/Runtime.gpu_allocator,
IExecutionContext.device_memory; ISymExpr's properties) and count/remove of two bound vectors.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "data" / "trt_api_8_6_1.json"
REPO = "NVIDIA/TensorRT"
SOURCES_DIR = "python/src"
INIT_PY = "python/packaging/bindings_wheel/tensorrt/__init__.py"
# How the full `tensorrt` wheel is compiled (ForwardDeclarations.h; CMake leaves serialisation off).
DEFINES = {"EXPORT_ALL_BINDINGS": True, "ENABLE_INETWORK_SERIALIZE": False}
# pybind11's enum_ gives every enum these read-only properties.
ENUM_PROPERTIES = ("name", "value")

METHOD_CALLS = ("def", "def_static")
# Instance properties; the *_static ones are class-level values (the stubs call them ClassVar too).
PROPERTY_CALLS = {
    "def_property": "property",
    "def_property_readonly": "property",
    "def_readwrite": "property",
    "def_readonly": "property",
    "def_property_static": "value",
    "def_property_readonly_static": "value",
    "def_readwrite_static": "value",
    "def_readonly_static": "value",
}
# py::bind_vector's list methods (count/remove too where elements compare; not assumed).
VECTOR_METHODS = ("append", "clear", "extend", "insert", "pop")
# Chain links that add no attribute (constructors are .def(py::init...), caught by their first argument).
NO_ATTRIBUTE_CALLS = ("export_values", "def_buffer")  # def_buffer: the buffer protocol


class ScanError(ValueError):
    """The binding source has a construct this scanner does not understand."""


@dataclass
class Binding:
    """One bound class or enum, as declared."""

    name: str  # Python name, "ILogger.Severity" for nested ones
    cpp: str  # C++ type (first template argument)
    template_args: list[str]
    is_enum: bool
    members: dict[str, str] = field(default_factory=dict)
    exported_to: str | None = None  # scope receiving .export_values() ("" = the module)


@dataclass
class Table:
    classes: dict[str, Binding] = field(default_factory=dict)
    functions: set[str] = field(default_factory=set)
    values: dict[str, str] = field(default_factory=dict)  # module value -> "value" or aliased class


# --- C++ text ------------------------------------------------------------------------------------
def _condition(expr: str) -> bool:
    """Value of an #if condition; only the macros in DEFINES matter for which bindings exist."""
    expr = expr.strip()
    m = re.fullmatch(r"(!)?\s*(?:defined\s*\(?\s*)?(\w+)\s*\)?", expr)
    if m and m.group(2) in DEFINES:
        return DEFINES[m.group(2)] != bool(m.group(1))
    return True  # version checks of pybind11 and the like: either branch binds the same names


def preprocess(text: str) -> str:
    """Drop inactive #if/#else branches and every preprocessor line (keeps line count)."""
    out, stack = [], []  # stack of (this branch active, some branch taken)
    for line in text.split("\n"):
        s = line.strip()
        m = re.match(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", s)
        if m:
            kw, rest = m.groups()
            if kw in ("if", "ifdef", "ifndef"):
                val = _condition(rest) if kw != "ifndef" else not _condition(rest)
                stack.append((val, val))
            elif kw == "elif":
                _, taken = stack.pop()
                val = not taken and _condition(rest)
                stack.append((val, taken or val))
            elif kw == "else":
                _, taken = stack.pop()
                stack.append((not taken, True))
            else:
                stack.pop()
            out.append("")
        elif s.startswith("#") or not all(active for active, _ in stack):
            out.append("")
        else:
            out.append(line)
    if stack:
        raise ScanError("unbalanced #if")
    return "\n".join(out)


def strip_comments(text: str) -> str:
    """Blank // and /* */ comments (strings and char literals kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = _string_end(text, i)
            out.append(text[i:j])
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ScanError("unterminated /* comment")
            out.append(" ")
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _string_end(text: str, i: int) -> int:
    """Index after the string or char literal starting at i (raw strings are not used by the bindings)."""
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    raise ScanError(f"unterminated literal at offset {i}")


def _balanced(text: str, i: int) -> int:
    """Index after the bracketed group opening at text[i] ( ( [ { ), skipping literals."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack, j = [pairs[text[i]]], i + 1
    while stack:
        if j >= len(text):
            raise ScanError(f"unbalanced {text[i]} at offset {i}")
        c = text[j]
        if c in "\"'":
            j = _string_end(text, j)
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")]}" and c != stack.pop():
            raise ScanError(f"mismatched {c} at offset {j}")
        j += 1
    return j


def _template_end(text: str, i: int) -> int:
    """Index after the <...> opening at text[i] (template arguments hold no comparisons)."""
    depth, j = 0, i
    while True:
        c = text[j]
        depth += (c == "<") - (c == ">")
        j += 1
        if depth == 0:
            return j


def _split_top(s: str) -> list[str]:
    """Split at commas outside (), <>, {} and literals."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(s):
        c = s[i]
        if c in "\"'":
            j = _string_end(s, i)
            cur += s[i:j]
            i = j
            continue
        depth += (c in "(<{[") - (c in ")>}]")
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    return [*out, cur.strip()] if cur.strip() else out


def _first_string(args: str) -> str | None:
    m = re.match(r'\s*"((?:[^"\\]|\\.)*)"', args)
    return m.group(1) if m else None


def _chain(text: str, i: int) -> Iterator[tuple[str, str, int]]:
    """(link name, its argument text, end) for each `.name(...)` chained from text[i]."""
    while True:
        m = re.compile(r"\s*\.\s*(\w+)\s*\(").match(text, i)
        if not m:
            return
        start = m.end() - 1
        end = _balanced(text, start)
        yield m.group(1), text[start + 1 : end - 1], end
        i = end


def _add_links(binding: Binding, text: str, i: int, where: str) -> None:
    for link, args, _end in _chain(text, i):
        name = _first_string(args)
        if link in METHOD_CALLS:
            if name is not None:  # else a constructor: .def(py::init<...>(), ...)
                binding.members[name] = "method"
            elif "py::init" not in args:
                raise ScanError(f"{where}: {binding.name}.{link}({args[:60]}...) has no name")
        elif link in PROPERTY_CALLS:
            if name is None:
                raise ScanError(f"{where}: {binding.name}.{link} without a name")
            binding.members[name] = PROPERTY_CALLS[link]
        elif link == "value":
            if name is None:
                raise ScanError(f"{where}: {binding.name}.value without a name")
            binding.members[name] = "value"
        elif link == "export_values":
            binding.exported_to = ""
        elif link not in NO_ATTRIBUTE_CALLS:
            raise ScanError(f"{where}: unknown chain link .{link}( on {binding.name}")


_DECL = re.compile(r"py::(class_|enum_)\s*<")


def scan(text: str, table: Table, where: str) -> None:
    """Add the bindings of one .cpp file (raw text) to `table`."""
    text = strip_comments(preprocess(text))
    variables: dict[str, Binding] = {}  # `py::class_<ILogger> baseLoggerBinding{m, "ILogger"}`
    for m in _DECL.finditer(text):
        tend = _template_end(text, m.end() - 1)
        targs = _split_top(text[m.end() : tend - 1])
        v = re.compile(r"\s*(\w+)?\s*([({])").match(text, tend)
        if not v:
            raise ScanError(f"{where}: cannot read the {m.group(0)} at offset {m.start()}")
        aend = _balanced(text, v.end() - 1)
        args = _split_top(text[v.end() : aend - 1])
        if len(args) < 2 or _first_string(args[1]) is None:
            raise ScanError(f'{where}: {m.group(0)} at offset {m.start()} has no (scope, "Name")')
        scope, name = args[0], _first_string(args[1])
        assert name is not None
        if scope == "m":
            full, parent = name, None
        elif scope in variables:
            parent = variables[scope]
            full = f"{parent.name}.{name}"
            parent.members[name] = "value"  # a nested class is read as an attribute of its parent
        else:
            raise ScanError(f"{where}: {name} bound into unknown scope {scope!r}")
        binding = Binding(full, targs[0], targs[1:], m.group(1) == "enum_")
        if binding.is_enum:
            binding.members.update(dict.fromkeys(ENUM_PROPERTIES, "property"))
        if v.group(1):
            variables[v.group(1)] = binding
        _add_links(binding, text, aend, where)
        if binding.exported_to == "" and parent is not None:
            binding.exported_to = parent.name
        if full in table.classes:
            raise ScanError(f"{where}: {full} bound twice")
        table.classes[full] = binding
    for var, binding in variables.items():  # later statements on the variable: `var.def(...)...;`
        for vm in re.finditer(rf"(?<![\w.]){re.escape(var)}(?=\s*\.)", text):
            _add_links(binding, text, vm.end(), where)
    for fm in re.finditer(r"(?<![\w.])m\s*\.\s*def\s*\(", text):
        name = _first_string(text[fm.end() :])
        if name is None:
            raise ScanError(f"{where}: m.def without a name at offset {fm.start()}")
        table.functions.add(name)
    for am in re.finditer(r'(?<![\w.])m\s*\.\s*attr\s*\(\s*"(\w+)"\s*\)\s*=\s*([^;]+);', text):
        alias = re.fullmatch(r'm\s*\.\s*attr\s*\(\s*"(\w+)"\s*\)', am.group(2).strip())
        table.values[am.group(1)] = alias.group(1) if alias else "value"
    for bm in re.finditer(r"py::bind_(?:vector|map)\s*<", text):  # opaque STL containers as classes
        tend = _template_end(text, bm.end() - 1)
        name = _first_string(_split_top(text[tend + 1 : _balanced(text, tend) - 1])[1])
        if name is None:
            raise ScanError(f"{where}: py::bind_* without a name at offset {bm.start()}")
        table.classes[name] = Binding(name, name, [], False, dict.fromkeys(VECTOR_METHODS, "method"))


# --- the wheel's __init__.py -------------------------------------------------------------------------
def apply_init_py(text: str, table: Table) -> None:
    """Module functions and class attributes the wheel's tensorrt/__init__.py adds (ast, not executed)."""
    # Build-time placeholders: the module name, and others (versions, switches) that name nothing.
    tree = ast.parse(re.sub(r"##\w+##", "0", text.replace("##TENSORRT_MODULE##", "tensorrt")))
    funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    table.functions |= funcs

    def statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for node in body:
            # `if "tensorrt" == "tensorrt":` (the full wheel's block); other ifs are platform-specific.
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
                parts = [node.test.left, *node.test.comparators]
                if all(isinstance(p, ast.Constant) for p in parts):
                    if len({p.value for p in parts if isinstance(p, ast.Constant)}) == 1:
                        yield from statements(node.body)
                    continue
            yield node

    for node in statements(tree.body):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    cls = table.classes.get(target.value.id)
                    if cls is None:
                        raise ScanError(f"__init__.py sets {target.value.id}.{target.attr}: no such class")
                    v = node.value
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "property":
                        cls.members[target.attr] = "property"
                    elif isinstance(v, ast.Lambda) or (isinstance(v, ast.Name) and v.id in funcs):
                        cls.members[target.attr] = "method"
                    else:
                        cls.members[target.attr] = "value"
                elif isinstance(target, ast.Name) and not target.id.startswith("_"):
                    table.values[target.id] = "value"
        elif isinstance(node, ast.For):
            # for attr, value in ILogger.Severity.__members__.items(): setattr(Logger, attr, value)
            src = ast.unparse(node.iter)
            m = re.fullmatch(r"([\w.]+)\.__members__\.items\(\)", src)
            call = node.body[0] if len(node.body) == 1 else None
            if not (m and isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)):
                raise ScanError(f"__init__.py: unknown loop over {src}")
            target = ast.unparse(call.value.args[0])
            for member, kind in table.classes[m.group(1)].members.items():
                if kind == "value":
                    table.classes[target].members.setdefault(member, "value")


# --- assembling ------------------------------------------------------------------------------------
def flatten(table: Table) -> dict[str, dict[str, str]]:
    """{class: {attr: kind}} with base-class members and exported enum values included."""
    by_cpp = {b.cpp: b for b in table.classes.values()}
    for b in table.classes.values():
        if b.exported_to is not None:
            scope = table.classes[b.exported_to] if b.exported_to else None
            values = {k: "value" for k, v in b.members.items() if v == "value"}
            if scope is not None:
                for k in values:
                    scope.members.setdefault(k, "value")
            else:
                table.values.update(values)
    done: dict[str, dict[str, str]] = {}

    def resolve(b: Binding) -> dict[str, str]:
        if b.name not in done:
            merged: dict[str, str] = {}
            for arg in b.template_args:  # holder types and trampolines are not bound classes
                base = by_cpp.get(arg)
                if base is not None:
                    merged.update(resolve(base))
            merged.update(b.members)
            done[b.name] = merged
        return done[b.name]

    out = {name: dict(sorted(resolve(b).items())) for name, b in sorted(table.classes.items())}
    for b in table.classes.values():  # nested classes of bases: Logger.Severity is ILogger.Severity
        for arg in b.template_args:
            base = by_cpp.get(arg)
            for nested in [n for n in out if base is not None and n.startswith(base.name + ".")]:
                out.setdefault(b.name + nested[len(base.name) :], out[nested])
    for name, target in table.values.items():
        if target in out:
            out[name] = out[target]  # ResizeMode = InterpolationMode
    return dict(sorted(out.items()))


def build(files: dict[str, str], init_py: str, source: str) -> dict[str, object]:
    """The JSON document from {path: .cpp text} and the wheel's __init__.py text."""
    table = Table()
    for path in sorted(files):
        scan(files[path], table, path)
    apply_init_py(init_py, table)
    classes = flatten(table)
    return {
        "source": source,
        "classes": classes,
        "functions": sorted(table.functions),
        "values": sorted(k for k, v in table.values.items() if k not in classes),
    }


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True, text=True
    ).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--git-dir", type=Path, required=True, help="a git mirror of github.com/NVIDIA/TensorRT")
    ap.add_argument("--ref", default="v8.6.1", help="tag, branch or commit (default v8.6.1)")
    ap.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    commit = _git(a.git_dir, "rev-parse", f"{a.ref}^{{commit}}").strip()
    paths = [
        p
        for p in _git(a.git_dir, "ls-tree", "-r", "--name-only", commit, SOURCES_DIR).split()
        if p.endswith(".cpp")
    ]
    files = {p: _git(a.git_dir, "show", f"{commit}:{p}") for p in paths}
    init_py = _git(a.git_dir, "show", f"{commit}:{INIT_PY}")
    source = f"{REPO} {a.ref} (commit {commit}): {', '.join(paths)}, {INIT_PY}"
    doc = build(files, init_py, source)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    n = sum(len(v) for v in doc["classes"].values())  # type: ignore[attr-defined]
    print(f"{a.out}: {len(doc['classes'])} classes, {n} attributes, {len(doc['functions'])} functions")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
