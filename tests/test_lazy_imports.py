"""An agent without an engine cache does not load the registry client (oras, jsonschema: ~0.4 s and a few
MB at every start, which a Jetson pays for nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_daemon_imports_without_the_registry_client() -> None:
    code = "import sys, agent.cli.daemon; print([m for m in ('oras', 'jsonschema') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
