"""TrtApi: one TensorRT module with every call the agent makes on it, by job (engines.trt.module has the
probes and the facts behind them).

    api = import_trt()            # tensorrt if importable, else tensorrt_rtx; or import_trt("tensorrt_rtx")
    api = TrtApi(module)          # wrap an already imported module (tests pass `fake_tensorrt`)
"""

from __future__ import annotations

import importlib

from engines.errors import UnavailableError
from engines.trt.config import BuilderConfigCalls
from engines.trt.module import FLAVORS
from engines.trt.network import NetworkCalls
from engines.trt.runtime import RuntimeCalls
from engines.trt.timing_cache import TimingCacheCalls


class TrtApi(NetworkCalls, BuilderConfigCalls, TimingCacheCalls, RuntimeCalls):
    """A TensorRT module plus probes of what it can do (TrtModule), and the network, builder-config,
    timing-cache and runtime calls written once for every version."""


def import_trt(flavor: str | None = None) -> TrtApi:
    """Import TensorRT: the given flavour, or `tensorrt` then `tensorrt_rtx` when None."""
    names = [flavor] if flavor else list(FLAVORS)
    problems = []
    for name in names:
        if name not in FLAVORS:
            raise UnavailableError(f"unknown TensorRT flavour {name!r} (expected one of {list(FLAVORS)})")
        try:
            return TrtApi(importlib.import_module(name), name)
        except ImportError as e:
            problems.append(f"{name}: {e}")
    raise UnavailableError(
        "no TensorRT module is importable (" + "; ".join(problems) + "); " + install_hint(names)
    )


def install_hint(flavors: list[str]) -> str:
    """How to get the flavours (the package's extras; JetPack's system TensorRT on a Jetson)."""
    extras = " or ".join(f"pip install 'edge-agent[{f.replace('_', '-')}]'" for f in flavors)
    jetson = " (a Jetson: JetPack's python3-libnvinfer, venv --system-site-packages; README, Jetson)"
    return f"install it: {extras}" + (jetson if "tensorrt" in flavors else "")
