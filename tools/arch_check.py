"""The structure rules of the tree, checked from the code (tests/test_architecture.py runs them in CI).

    python tools/arch_check.py            # prints every breach, exit 1 if any

- Layers: agent -> pipelines -> engines; a module never imports a layer above its own.
- No import circle between modules (every import counts: top level, inside functions, TYPE_CHECKING).
- In every layer: no module over 400 lines, no function over 60 (def line to last line), but for the few
  listed in EXEMPT, each with its reason; an entry that is no longer needed is a breach too.
- Every package and every .py file is seen by git and by ruff: no ignore rule hides one (`hidden`).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("agent", "pipelines", "engines")  # top to bottom
SIZED = LAYERS
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# "path" (the module's size) or "path:function" -> why it may be larger. Split by meaning, not by count: an
# entry is for a module or function that is one thing, where a cut would separate what must be read together.
EXEMPT: dict[str, str] = {
    "pipelines/tracking.py": "one state table walked by one update (predict, the three association stages, "
    "Kalman correction, track lifecycle) that the compiled kernel pipelines/kernels/tracking.pyx mirrors "
    "step by step and tests/test_kernels.py compares bit for bit: the numpy reference reads as the "
    "kernel's twin only in one piece; its docstring is the algorithm (43 lines)",
    "pipelines/analytics.py:process": "one frame's walk (gap reset, tracker, zones, lines, what the camera "
    "reports) in the order the events contract needs; its module is being restructured under issue 34 "
    "item 6 (analytics by rules), which owns the cut",
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three layers (a package is its __init__)."""
    found: dict[str, Path] = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The project modules a module's imports name: `from a.b import c` is a.b.c where that is a module,
    else a.b; relative imports are resolved against the module's package."""
    is_pkg = known[name].name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _nearest(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield from _nearest(full if full in known else base, known)


def _nearest(dotted: str, known: dict[str, Path]) -> Iterator[str]:
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            yield candidate
            return
        parts.pop()


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        # A package's parent __init__ runs first on any import; that arrow is Python's, not the code's.
        graph[name] = {m for m in _imported(tree, name, known) if m != name and not name.startswith(m + ".")}
    return graph


def upward(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return [
        f"{a} imports {b} (layer {b.split('.')[0]} is above {a.split('.')[0]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if rank[b.split(".")[0]] < rank[a.split(".")[0]]
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def oversized(root: Path = ROOT, exempt: dict[str, str] | None = None) -> list[str]:
    exempt = EXEMPT if exempt is None else exempt
    found = []
    used: set[str] = set()
    for layer in SIZED:
        for path in sorted((root / layer).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(root).as_posix()
            lines = text.count("\n")
            if lines > MAX_MODULE_LINES:
                if rel in exempt:
                    used.add(rel)
                else:
                    found.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    span = (node.end_lineno or node.lineno) - node.lineno + 1
                    if span <= MAX_FUNCTION_LINES:
                        continue
                    if rel in exempt or f"{rel}:{node.name}" in exempt:
                        used.add(rel if rel in exempt else f"{rel}:{node.name}")
                    else:
                        found.append(
                            f"{rel}:{node.lineno} {node.name}: {span} lines (at most {MAX_FUNCTION_LINES})"
                        )
    found += [
        f"{entry}: exempt from the size rules but within them: drop it from EXEMPT"
        for entry in exempt
        if entry not in used
    ]
    return found


def breaches(root: Path = ROOT, exempt: dict[str, str] | None = None) -> list[str]:
    """Every breach of the rules in the tree at root (EXEMPT: the size exemptions, unless given)."""
    graph = import_graph(root)
    return [
        *upward(graph),
        *(f"import circle: {' -> '.join(c)}" for c in circles(graph)),
        *oversized(root, exempt),
    ]


# Not walked for sources: VCS, virtual environments and tool caches (dot-folders), bytecode, and the
# package build's outputs at the root (copies of the sources, rightly ignored).
_OUTPUTS = ("build", "dist")


def sources(root: Path = ROOT) -> list[str]:
    """Every .py file and every package folder (one with an __init__.py) of the tree, tracked or not,
    relative to root ("agent/cli/__init__.py", "agent/cli/")."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder).relative_to(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and d != "__pycache__"
            and not (here == Path(".") and (d in _OUTPUTS or d.endswith(".egg-info")))
        )
        if "__init__.py" in files and here != Path("."):
            found.append(f"{here.as_posix()}/")
        found += [(here / f).as_posix() for f in sorted(files) if f.endswith(".py")]
    return found


def hidden(root: Path = ROOT) -> list[str]:
    """The sources git ignores (`git check-ignore`, tracked or not) or `ruff check` does not list: a file
    there would never be committed, or never linted."""
    paths = sources(root)
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--stdin"],
        cwd=root,
        input="\n".join(paths),
        capture_output=True,
        text=True,
    )
    if ignored.returncode not in (0, 1):  # 1: nothing ignored
        raise RuntimeError(f"git check-ignore failed: {ignored.stderr.strip()}")
    found = [f"{path}: ignored by git ({rule})" for rule, _, path in _split(ignored.stdout)]
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        raise RuntimeError(f"ruff check --show-files failed: {listed.stderr.strip()}")
    linted = {Path(line).resolve() for line in listed.stdout.splitlines() if line.strip()}
    found += [
        f"{path}: not linted by ruff"
        for path in paths
        if path.endswith(".py") and (root / path).resolve() not in linted
    ]
    return found


def _split(verbose: str) -> Iterator[tuple[str, str, str]]:
    """`git check-ignore --verbose` lines ("SOURCE:LINE:PATTERN<TAB>PATH") as (rule, tab, path)."""
    for line in verbose.splitlines():
        if line.strip():
            yield line.partition("\t")


def main() -> int:
    found = [*breaches(), *hidden()]
    for line in found:
        print(line)
    print(f"{len(found)} breach(es)" if found else "structure holds: layers, no circles, sizes, sources seen")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
