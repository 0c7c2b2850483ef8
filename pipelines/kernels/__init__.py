"""Compiled per-frame kernels of the analytics (Cython, built when the package is installed).

``load(name, layout)`` gives the compiled module, or None where it was not built (no C compiler at install
time), was built for another table layout (a stale build: the numpy code is right, the kernel would not
be), or ``EDGE_AGENT_KERNELS=numpy`` is set; callers then run their numpy code, which is the reference the
kernels are tested against (tests/test_kernels.py). Each reason is logged once per process.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)
_said: set[str] = set()


def load(name: str, layout: dict[str, int]) -> ModuleType | None:
    """The compiled ``pipelines.kernels.<name>`` if usable; ``layout``: the table rows it must agree on."""
    if os.environ.get("EDGE_AGENT_KERNELS", "").strip().lower() == "numpy":
        _once(name, logging.INFO, "EDGE_AGENT_KERNELS=numpy: %s runs its numpy code", name)
        return None
    try:
        mod = importlib.import_module(f"pipelines.kernels.{name}")
    except ImportError as exc:
        _once(
            name,
            logging.WARNING,
            "the compiled %s kernel is not built (%s): its numpy code runs, several times the CPU per frame;"
            " reinstall the package with a C compiler and the Python headers (gcc, python3-dev)",
            name,
            exc,
        )
        return None
    if getattr(mod, "LAYOUT", None) != layout:
        _once(
            name,
            logging.WARNING,
            "the compiled %s kernel was built for another table layout (%s, here %s): a stale build, its"
            " numpy code runs; reinstall the package",
            name,
            getattr(mod, "LAYOUT", None),
            layout,
        )
        return None
    return mod


def _once(name: str, level: int, msg: str, *args: object) -> None:
    if name not in _said:
        _said.add(name)
        log.log(level, msg, *args)
