"""Compiled per-frame kernels of the analytics (Cython, built when the package is installed).

``load(name)`` gives the compiled module, or None where it was not built (no C compiler at install time)
or ``EDGE_AGENT_KERNELS=numpy`` is set; callers then run their numpy code, which is the reference the
kernels are tested against (tests/test_kernels.py).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    if os.environ.get("EDGE_AGENT_KERNELS", "").strip().lower() == "numpy":
        return None
    try:
        return importlib.import_module(f"pipelines.kernels.{name}")
    except ImportError:
        return None
