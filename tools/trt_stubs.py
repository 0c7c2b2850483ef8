"""Install tensorrt-stubs (the TensorRT 10.13 Python API) for mypy, once, and print where they are.

    MYPYPATH="$(python tools/trt_stubs.py)" python -m mypy

Not a dependency in pyproject.toml, because that package
- requires tensorrt==10.13 itself (from NVIDIA's index), which CI must not have, and
- installs a bare `tensorrt/` folder (.pyi only) that would import as an empty namespace package and win
  over tensorrt_rtx in engines.trt.api.import_trt().
So it goes, without dependencies, into `{sys.prefix}/typestubs/`, off sys.path. Every published version
is generated with a few lines that are not Python (parameters named `in`, a required parameter after
defaults) and annotates with `bool`, which the module rebinds to DataType.BOOL; both are repaired once
(the classes the agent uses are not touched by the first two).
"""

from __future__ import annotations

import ast
import keyword
import re
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "10.13.0.35.1"
MAX_REPAIRS = 50


def _split_params(s: str) -> list[str]:
    """Split a parameter list at its top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def _repair_line(line: str) -> str:
    kw = "|".join(keyword.kwlist)
    fixed = re.sub(rf"([(,] *)({kw})(?=: )", r"\1\2_", line)  # `in: int` -> `in_: int`
    m = re.match(r"^(\s*def \w+\()(.*)(\) -> .*:)$", line)
    if fixed == line and m:  # a required parameter after defaults: give it one
        params = _split_params(m.group(2))
        first = next(i for i, p in enumerate(params) if "=" in p)
        params[first:] = [
            p if "=" in p or p.strip().startswith("*") else p + " = ..." for p in params[first:]
        ]
        fixed = m.group(1) + ",".join(params) + m.group(3)
    return fixed


def repair(path: Path) -> None:
    text = path.read_text()
    text = text.replace(
        "from __future__ import annotations\n", "from __future__ import annotations\nimport builtins\n", 1
    )
    # Annotations (indented or in a def); the module-level `bool: DataType` and __all__ keep the name.
    lines = [
        re.sub(r"\bbool\b", "builtins.bool", s) if s.startswith((" ", "def ")) else s
        for s in text.split("\n")
    ]
    for _ in range(MAX_REPAIRS):
        try:
            ast.parse("\n".join(lines), feature_version=(3, 10))
            break
        except SyntaxError as e:
            assert e.lineno is not None
            fixed = _repair_line(lines[e.lineno - 1])
            if fixed == lines[e.lineno - 1]:
                raise
            lines[e.lineno - 1] = fixed
    else:
        sys.exit(f"{path}: still not Python after {MAX_REPAIRS} repairs")
    path.write_text("\n".join(lines))


def target() -> Path:
    """Where the stubs go (and tests/trt_stub_index.py looks); `.repaired` in it marks them usable."""
    return Path(sys.prefix) / "typestubs" / f"tensorrt-stubs-{VERSION}"


def main() -> int:
    target_dir = target()
    if not (target_dir / ".repaired").is_file():
        shutil.rmtree(target_dir, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(target_dir),
                f"tensorrt-stubs=={VERSION}",
            ],
            check=True,
            stdout=sys.stderr,
        )
        repair(target_dir / "tensorrt_bindings" / "tensorrt.pyi")
        (target_dir / ".repaired").touch()
    print(target_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
