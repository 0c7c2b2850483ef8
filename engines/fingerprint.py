"""Device fingerprint: which TensorRT, which GPU, which JetPack. Engines are built for one.

    fp = probe_fingerprint()                       # live device, TensorRT imported by import_trt()
    fp = probe_fingerprint(api, target_compute_capability="8.9", tegra_release=Path(...))

A CPU-only machine gets a fingerprint too: gpu_name None, compute_capability = the target used for
TensorRT-RTX ahead-of-time builds (DEFAULT_TARGET_CC unless configured). `manifest_dict()` gives the
manifest's `fingerprint` object; `key_fields()` the part that decides whether a plan still fits
(driver and CUDA runtime are recorded but don't invalidate a plan).

Every Orin module reports the GPU name "Orin" and compute capability 8.7, yet an AGX (16 SMs, 2 DLA cores),
an NX (8 SMs, 2 or 0 DLA) and a Nano (8 or 4 SMs, no DLA) tune differently: the SM count, the total memory
(GiB, rounded: Jetsons share it with the CPU) and the DLA core count are part of the key and of the
timing cache's name. Manifests written before them lack these fields and still load (engines.manifest);
their engines are rebuilt once, with the reason named (engines.build.compat).
"""

from __future__ import annotations

import platform as _platform
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engines.cuda.gpu_probe import GpuInfo, probe_gpu
from engines.trt import TrtApi, flavor_label, import_trt

# Ampere consumer GPUs (RTX 30xx) are the oldest TensorRT-RTX runs on Linux without extra options;
# an engine built for 8.6 is a concrete, reproducible target (the RTX default "portable" set is not).
DEFAULT_TARGET_CC = "8.6"
TEGRA_RELEASE = Path("/etc/nv_tegra_release")

FINGERPRINT_FIELDS = (
    "trt_flavor",
    "trt_version",
    "gpu_name",
    "compute_capability",
    "cuda_driver",
    "cuda_runtime",
    "l4t",
    "dla_core",
    "platform",
    "sm_count",
    "memory_gib",
    "dla_cores",
)
# Written since issue 35: absent from older manifests (engines.manifest checks them where present).
DEVICE_FIELDS = ("sm_count", "memory_gib", "dla_cores")
# Fields whose change means "rebuild" (see engines.build.compat).
KEY_FIELDS = (
    "trt_flavor",
    "trt_version",
    "gpu_name",
    "compute_capability",
    "l4t",
    "dla_core",
    "platform",
    *DEVICE_FIELDS,
)


@dataclass(frozen=True)
class Fingerprint:
    trt_flavor: str
    trt_version: str
    gpu_name: str | None
    compute_capability: str | None
    cuda_driver: str | None
    cuda_runtime: str | None
    l4t: str | None
    dla_core: int | None
    platform: str
    dla_cores: int = 0  # how many DLA cores TensorRT reports on this device
    sm_count: int | None = None  # streaming multiprocessors (None: no GPU, or the probe could not tell)
    memory_gib: int | None = None  # total device memory, rounded to GiB

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    def manifest_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in FINGERPRINT_FIELDS}

    def key_fields(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in KEY_FIELDS}

    def for_build(self, dla_core: int | None, target_compute_capability: str | None) -> Fingerprint:
        """The fingerprint a build with these settings records: its DLA core, and on a machine
        without GPU the configured AOT target instead of the default."""
        fp = replace(self, dla_core=dla_core)
        if not self.has_gpu and target_compute_capability:
            fp = replace(fp, compute_capability=target_compute_capability)
        return fp

    def timing_cache_name(self) -> str:
        """The file name of the timing cache builds on this device share: one per TensorRT and device
        (flavour, version, GPU, CC, SM count, memory, DLA cores); a CPU-only AOT build keys on its target
        CC. Timings measured on one Orin module must never steer another's tactic choice."""
        gpu = self.gpu_name or "nogpu"
        raw = f"{self.trt_flavor}-{self.trt_version}-{gpu}-sm{self.compute_capability}"
        if self.has_gpu:
            raw += f"-{self.sm_count or 0}sms-{self.memory_gib or 0}gib-{self.dla_cores}dla"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", raw) + ".cache"

    def describe(self) -> str:
        gpu = (
            f"{self.gpu_name} ({self.compute_capability})"
            if self.has_gpu
            else (f"no GPU (target {self.compute_capability})")
        )
        l4t = f", L4T {self.l4t}" if self.l4t else ""
        return f"{flavor_label(self.trt_flavor)} {self.trt_version}, {gpu}{l4t}, {self.platform}"


def parse_nv_tegra_release(text: str) -> str | None:
    """'# R35 (release), REVISION: 4.1, ...' -> 'R35.4.1'."""
    m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"R{m.group(1)}.{m.group(2).rstrip('.')}" if m else None


def _dpkg_l4t_version() -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "nvidia-l4t-core"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def probe_l4t(
    tegra_release: Path = TEGRA_RELEASE, dpkg_version: Callable[[], str | None] = _dpkg_l4t_version
) -> str | None:
    """JetPack's L4T release from /etc/nv_tegra_release, else the nvidia-l4t-core package version."""
    try:
        found = parse_nv_tegra_release(tegra_release.read_text(errors="replace"))
    except OSError:
        found = None
    if found:
        return found
    version = dpkg_version()  # "36.3.0-20240506102626"
    m = re.match(r"(\d+)\.([\d.]+?)(?:-|$)", version or "")
    return f"R{m.group(1)}.{m.group(2)}" if m else None


def probe_fingerprint(
    api: TrtApi | None = None,
    *,
    target_compute_capability: str | None = None,
    gpu_index: int = 0,
    tegra_release: Path = TEGRA_RELEASE,
    dpkg_version: Callable[[], str | None] = _dpkg_l4t_version,
    gpu: GpuInfo | None = None,
) -> Fingerprint:
    """Fingerprint of this machine. Raises UnavailableError when no TensorRT is importable."""
    api = api or import_trt()
    gpu = gpu if gpu is not None else probe_gpu(gpu_index)
    cc = gpu.compute_capability or target_compute_capability or DEFAULT_TARGET_CC
    # DLA exists only on Jetson/Drive; asked of a Runtime, so the daemon never loads the builder library.
    dla_cores = api.num_dla_cores() if gpu.name is not None else 0
    return Fingerprint(
        trt_flavor=api.flavor,
        trt_version=api.version,
        gpu_name=gpu.name,
        compute_capability=cc,
        cuda_driver=gpu.cuda_driver,
        cuda_runtime=gpu.cuda_runtime,
        l4t=probe_l4t(tegra_release, dpkg_version),
        dla_core=None,  # set per build from BuildSettings (Fingerprint.for_build)
        platform=f"{_platform.system().lower()}-{_platform.machine()}",
        dla_cores=dla_cores,
        sm_count=gpu.sm_count,
        memory_gib=None if gpu.memory_mib is None else round(gpu.memory_mib / 1024),
    )
