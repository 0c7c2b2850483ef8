"""How a Jetson was set to run while an engine was built: its nvpmodel power mode and whether its clocks
were locked (jetson_clocks). TensorRT picks tactics by timing them, so an engine built at a 15 W mode with
floating clocks may differ from one built at MAXN with locked clocks; the manifest's build.jetson says
which it was (None off a Jetson: no L4T release in the fingerprint).

    jetson_power(fp)                         # {"nvpmodel": {"name": "MAXN", "id": 0}, "clocks_locked": True,
                                             #  "clocks": {...}} or None
    jetson_power(fp, query=lambda: text, sysfs=tmp)   # tests: nvpmodel -q's output, a fake /sys

`nvpmodel -q` prints "NV Power Mode: <name>" and the mode id on the next line (some releases print fan
lines first). jetson_clocks pins every clock's minimum to its maximum, which sysfs shows: the GPU's devfreq
node (min_freq == max_freq) and each CPU's cpufreq policy (scaling_min_freq == scaling_max_freq).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engines.fingerprint import Fingerprint

NvpmodelQuery = Callable[[], "str | None"]
# devfreq node names of Jetson GPUs: Orin (ga10b; "gpu" on some L4T 36 kernels), Xavier (gv11b).
_GPU_DEVFREQ = ("ga10b", "gv11b", "gp10b", "gpu")
_MODE = re.compile(r"^NV Power Mode:\s*(.+?)\s*$")


def nvpmodel_query(timeout_s: float = 5.0) -> str | None:
    """`nvpmodel -q`'s output, None where there is no nvpmodel or it fails (never raises)."""
    exe = shutil.which("nvpmodel")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_nvpmodel(text: str) -> dict[str, Any] | None:
    """{"name": "MAXN", "id": 0} from `nvpmodel -q` (id None where no number follows); None if absent."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        found = _MODE.match(line)
        if found:
            after = lines[i + 1] if i + 1 < len(lines) else ""
            return {"name": found.group(1), "id": int(after) if after.isdigit() else None}
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def clock_state(sysfs: Path = Path("/sys")) -> dict[str, Any] | None:
    """{"locked", "gpu_min_hz", "gpu_max_hz", "cpus_locked"}: locked when the GPU's minimum frequency is
    its maximum and so is every CPU's (what jetson_clocks sets); None where no GPU devfreq node is found."""
    gpu: tuple[int, int] | None = None
    devfreq = sysfs / "class" / "devfreq"
    nodes = sorted(devfreq.iterdir()) if devfreq.is_dir() else []
    for node in nodes:
        if any(key in node.name for key in _GPU_DEVFREQ):
            lo, hi = _read_int(node / "min_freq"), _read_int(node / "max_freq")
            if lo is not None and hi is not None:
                gpu = (lo, hi)
                break
    if gpu is None:
        return None
    cpus = []
    for policy in sorted((sysfs / "devices" / "system" / "cpu").glob("cpu[0-9]*/cpufreq")):
        lo, hi = _read_int(policy / "scaling_min_freq"), _read_int(policy / "scaling_max_freq")
        if lo is not None and hi is not None:
            cpus.append(lo == hi)
    cpus_locked = all(cpus) if cpus else None
    return {
        "locked": gpu[0] == gpu[1] and cpus_locked is not False,
        "gpu_min_hz": gpu[0],
        "gpu_max_hz": gpu[1],
        "cpus_locked": cpus_locked,
    }


def jetson_power(
    fp: Fingerprint, query: NvpmodelQuery = nvpmodel_query, sysfs: Path = Path("/sys")
) -> dict[str, Any] | None:
    """The manifest's build.jetson for a build on `fp`: None off a Jetson (no L4T release)."""
    if fp.l4t is None:
        return None
    text = query()
    clocks = clock_state(sysfs)
    return {
        "nvpmodel": parse_nvpmodel(text) if text else None,
        "clocks_locked": None if clocks is None else clocks["locked"],
        "clocks": clocks,
    }
