"""Which cuda-python layout is installed: one import for every part of it.

    driver = import_cuda("driver")     # cuda.bindings.driver, else cuda.cuda
    runtime = import_cuda("runtime")   # cuda.bindings.runtime, else cuda.cudart
    nvrtc = import_cuda("nvrtc")       # cuda.bindings.nvrtc, else cuda.nvrtc

cuda-python 12.6.1 and later put the bindings in `cuda.bindings.*`; 12.0-12.6.0 (and the cuda-python that
JetPack 6 images carry) have only the older `cuda.cuda` / `cuda.cudart` / `cuda.nvrtc` modules, with the
same functions. A probe that tried only the new names would call such a Jetson GPU-less.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from engines.errors import UnavailableError

# part -> (module since cuda-python 12.6.1, module before it)
LAYOUTS: dict[str, tuple[str, str]] = {
    "driver": ("cuda.bindings.driver", "cuda.cuda"),
    "runtime": ("cuda.bindings.runtime", "cuda.cudart"),
    "nvrtc": ("cuda.bindings.nvrtc", "cuda.nvrtc"),
}


def import_cuda(
    part: str,
    what: str = "this",
    import_module: Callable[[str], ModuleType] | None = None,
) -> ModuleType:
    """The cuda-python module of `part` (driver | runtime | nvrtc), new layout first. UnavailableError
    naming `what` needed it and both modules tried, when neither imports."""
    return import_cuda_layout(part, what, import_module)[0]


def import_cuda_layout(
    part: str,
    what: str = "this",
    import_module: Callable[[str], ModuleType] | None = None,
) -> tuple[ModuleType, str]:
    """(import_cuda's module, its layout: "cuda.bindings" or "cuda.cuda" for cuda-python before 12.6.1).
    `import_module`: importlib.import_module, looked up at the call (tests patch it)."""
    load = import_module or importlib.import_module
    if part not in LAYOUTS:
        raise ValueError(f"unknown cuda-python part {part!r} (known: {', '.join(LAYOUTS)})")
    problems = []
    for name, layout in zip(LAYOUTS[part], ("cuda.bindings", "cuda.cuda"), strict=True):
        try:
            return load(name), layout
        except ImportError as e:
            problems.append(f"{name}: {e}")
    raise UnavailableError(
        f"{what}: cuda-python is not importable (pip install cuda-python): " + "; ".join(problems)
    )
