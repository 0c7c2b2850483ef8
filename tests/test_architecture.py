"""The tree keeps its structure: layers agent -> pipelines -> engines, no import circle, in every layer no
module over 400 lines and no function over 60 (but for the few exempt with a reason); every package and .py
file is seen by git and ruff (tools/arch_check.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("arch_check", ROOT / "tools" / "arch_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["arch_check"] = module
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for layer in ("agent", "pipelines", "engines"):
        (root / layer).mkdir(parents=True, exist_ok=True)
        (root / layer / "__init__.py").write_text("")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_each_kind_of_breach(tmp_path: Path) -> None:
    check = _checker()
    long_function = "def f():\n" + "    x = 1\n" * 60
    root = _tree(
        tmp_path,
        {
            "engines/low.py": "from pipelines import mid\n",  # upward
            "pipelines/mid.py": "import engines.low\n",
            "agent/a.py": "def g():\n    from agent.b import y\n",  # a circle through a lazy import
            "agent/b.py": "from agent import a\ny = 1\n",
            "agent/pkg/__init__.py": "from agent.pkg.one import z\n",  # a package re-export: not a circle
            "agent/pkg/one.py": "from .two import w\nz = w\n",
            "agent/pkg/two.py": "w = 1\n",
            "agent/big.py": "x = 1\n" * 401,
            "pipelines/big.py": "x = 1\n" * 401,  # pipelines/ is held to the sizes too
            "engines/fn.py": long_function,
            "engines/ok.py": "def f():\n" + "    x = 1\n" * 59,
        },
    )
    graph = check.import_graph(root)
    assert graph["agent.pkg.one"] == {"agent.pkg.two"}
    found = check.breaches(root, exempt={})
    assert found == [
        "engines.low imports pipelines.mid (layer pipelines is above engines)",
        "import circle: agent.a -> agent.b",
        "import circle: engines.low -> pipelines.mid",
        "agent/big.py: 401 lines (at most 400)",
        "pipelines/big.py: 401 lines (at most 400)",
        "engines/fn.py:1 f: 61 lines (at most 60)",
    ], found
    exempt = {"agent/big.py": "one thing", "engines/fn.py:f": "one walk", "engines/ok.py": "no longer"}
    assert check.oversized(root, exempt) == [
        "pipelines/big.py: 401 lines (at most 400)",
        "engines/ok.py: exempt from the size rules but within them: drop it from EXEMPT",
    ]


def test_the_tree_holds_its_structure() -> None:
    found = _checker().breaches()
    assert not found, "\n".join(found)


def test_an_unanchored_ignore_rule_that_hides_a_package_is_found(tmp_path: Path) -> None:
    check = _checker()
    root = _tree(
        tmp_path,
        {
            ".gitignore": "build/\n/dist/\n__pycache__/\n",  # build/ meant the root's, hides engines/build/
            "engines/build/__init__.py": "",
            "engines/build/plan.py": "x = 1\n",
            "agent/cli/__pycache__/skip.py": "",  # bytecode folders are not sources
            "dist/agent/copy.py": "",  # the package build's output at the root is not a source
        },
    )
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    assert check.sources(root) == [
        "agent/",
        "agent/__init__.py",
        "engines/",
        "engines/__init__.py",
        "engines/build/",
        "engines/build/__init__.py",
        "engines/build/plan.py",
        "pipelines/",
        "pipelines/__init__.py",
    ]
    assert check.hidden(root) == [
        "engines/build/: ignored by git (.gitignore:1:build/)",
        "engines/build/__init__.py: ignored by git (.gitignore:1:build/)",
        "engines/build/plan.py: ignored by git (.gitignore:1:build/)",
        "engines/build/__init__.py: not linted by ruff",
        "engines/build/plan.py: not linted by ruff",
    ]
    (root / ".gitignore").write_text("/build/\n/dist/\n__pycache__/\n")
    assert check.hidden(root) == []


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout"
)
def test_every_package_and_source_is_seen_by_git_and_ruff() -> None:
    found = _checker().hidden()
    assert not found, "\n".join(found)
