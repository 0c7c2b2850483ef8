"""pyproject.toml's [tool.mypy] names modules that exist, and every checked file is checked strictly
(issue 35: seven override entries named modules that had moved, so strictness silently stopped reaching
engines/build). warn_unused_configs makes mypy itself report a stale entry; these tests fail on one."""

from __future__ import annotations

import os
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
PROJECT = ("agent", "engines", "pipelines")


def project_modules() -> set[str]:
    out = set()
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def project_patterns() -> list[str]:
    """Every module pattern of every [[tool.mypy.overrides]] that names a module of this project."""
    return [
        pattern
        for section in CONFIG.get("overrides", [])
        for pattern in ([section["module"]] if isinstance(section["module"], str) else section["module"])
        if pattern.split(".")[0] in PROJECT
    ]


def checked_modules() -> set[str]:
    out = set()
    for entry in CONFIG["files"]:
        path = ROOT / entry
        assert path.exists(), f"[tool.mypy] files: {entry} does not exist"
        for f in path.rglob("*.py") if path.is_dir() else [path]:
            parts = f.relative_to(ROOT).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_warn_unused_configs_is_on() -> None:
    assert CONFIG.get("warn_unused_configs") is True


def test_every_override_names_an_existing_module() -> None:
    modules = project_modules()
    stale = [p for p in project_patterns() if not any(fnmatchcase(m, p) for m in modules)]
    assert not stale, f"[[tool.mypy.overrides]] names modules that do not exist: {stale}"


def test_every_checked_module_is_checked_strictly() -> None:
    strict = [
        section
        for section in CONFIG["overrides"]
        if section.get("disallow_untyped_defs") and section.get("disallow_any_unimported")
    ]
    patterns = [p for section in strict for p in section["module"]]
    loose = sorted(m for m in checked_modules() if not any(fnmatchcase(m, p) for p in patterns))
    assert not loose, f"checked by mypy but not strictly (no override names them): {loose}"
    assert "engines.build.trt_plan" in checked_modules()


def test_mypy_reports_no_unused_section() -> None:
    """As tools/test.sh runs it; skipped where the TensorRT stubs are not installed."""
    sys.path.insert(0, str(ROOT))
    try:
        from tools import trt_stubs
    finally:
        sys.path.remove(str(ROOT))
    stubs = trt_stubs.target()
    if not stubs.exists():
        pytest.skip("tensorrt-stubs not installed (python tools/trt_stubs.py)")
    out = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(stubs)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "unused section" not in out.stdout + out.stderr, out.stdout
