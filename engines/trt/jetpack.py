"""Is this a Jetson, and does `import tensorrt` give JetPack's TensorRT there?

    problem = tensorrt_wheel_problem()    # None, or one line naming the shadowing wheel and the fix

JetPack installs TensorRT's Python bindings as a Debian package (python3-libnvinfer) into
/usr/lib/python3.X/dist-packages, built for the Jetson's integrated GPU. PyPI's `tensorrt` wheels (what the
`[tensorrt]` extra installs) are built for x86_64 and SBSA servers; in a venv made with
--system-site-packages they come first on sys.path and shadow JetPack's, and then fail to load or run on
the Jetson. The agent's Jetson install (README) creates the venv with --system-site-packages and leaves the
extra out; this check names the problem at start-up (agent.preflight) when a wheel got in anyway.
Paths and the module finder are parameters (module attributes by default) so tests can stand in for a
Jetson.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from pathlib import Path

TEGRA_RELEASE = Path("/etc/nv_tegra_release")
DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
# Where JetPack's Debian packages put Python modules (pip as root writes /usr/local/lib/..., not here).
JETPACK_PYTHON = Path("/usr/lib")
# PyPI's wheels: the metapackage and the packages it pulls in (TensorRT 10: -cu12/-cu13 variants).
WHEELS = "tensorrt tensorrt-cu12 tensorrt-cu12-bindings tensorrt-cu12-libs"

Finder = Callable[[str], ModuleSpec | None]
FIND_SPEC: Finder = importlib.util.find_spec  # where `import tensorrt` would look (tests replace it)


def is_jetson(tegra_release: Path | None = None, device_model: Path | None = None) -> bool:
    """An L4T root file system (/etc/nv_tegra_release) or a Jetson/Tegra device-tree model."""
    release = tegra_release or TEGRA_RELEASE
    model = device_model or DEVICE_TREE_MODEL
    if release.is_file():
        return True
    try:
        text = model.read_bytes().decode(errors="replace")
    except OSError:
        return False
    return re.search(r"jetson|tegra|\borin\b|xavier", text, re.IGNORECASE) is not None


def tensorrt_wheel_problem(
    tegra_release: Path | None = None,
    device_model: Path | None = None,
    find_spec: Finder | None = None,
    jetpack_python: Path | None = None,
) -> str | None:
    """On a Jetson, why `import tensorrt` would not give JetPack's TensorRT (a pip wheel shadows it), or
    None (not a Jetson, no tensorrt at all - other checks say that - or JetPack's own)."""
    if not is_jetson(tegra_release, device_model):
        return None
    finder = find_spec or FIND_SPEC
    try:
        spec = finder("tensorrt")
    except (ImportError, ValueError):  # a broken package on sys.path: the import itself will say
        return None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).parent
    system = jetpack_python or JETPACK_PYTHON
    if origin.is_relative_to(system) and "dist-packages" in origin.parts:
        return None
    return (
        f"this Jetson imports tensorrt from {origin}, a pip wheel, not JetPack's "
        f"({system}/python3.X/dist-packages/tensorrt): PyPI's TensorRT wheels are built for servers and "
        f"do not run on a Jetson. Remove it (pip uninstall {WHEELS}) and install the agent without the "
        "[tensorrt] extra in a venv made with `python3 -m venv --system-site-packages` (README, Jetson)"
    )
