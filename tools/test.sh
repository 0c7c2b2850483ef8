#!/usr/bin/env bash
# The project's test command (README, .ci/run): lint, then the whole suite on real components.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m pytest -q -ra "$@"
