#!/usr/bin/env bash
# The project's test command (README, .ci/run): lint, type-check, then the whole suite on real components.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .

# mypy ([tool.mypy] in pyproject.toml) checks the TensorRT execution and build paths against tensorrt-stubs
# (the TensorRT 10.13 Python API); tools/trt_stubs.py installs them once, off sys.path, and prints where.
STUBS="$("$PY" tools/trt_stubs.py)"
MYPYPATH="$STUBS" "$PY" -m mypy

"$PY" -m pytest -q -ra "$@"
