"""What GPU is here: name, compute capability, driver and CUDA runtime versions; and NVML's live stats.

Tries cuda-python's driver API (`cuda.bindings.driver`, or `cuda.cuda` of cuda-python 12.0-12.6.0 as on
JetPack 6: engines.cuda.bindings; works on Jetson and desktops) and then NVML (`pynvml`, desktops and
servers; Jetson has no NVML). Both are optional: without either, or without a GPU, the answer is
`GpuInfo()` (all None), which is what a CPU-only build machine gets. Besides name and compute capability
it reads what tells modules of one name apart (an Orin NX 8 GB from a 16 GB one, an AGX from an NX): the
SM count and the total memory.

`NVML` is the process's one NVML reader (initialised once, on first use): `probe_nvml` reads the
static facts from it, the agent's telemetry (`agent.telemetry.gpu_stats`) the per-device
utilisation, memory and temperature.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engines.cuda.bindings import import_cuda, import_cuda_layout
from engines.cuda.buffers import CudaError, cuda_call
from engines.errors import UnavailableError

log = logging.getLogger("engines.gpu")


@dataclass(frozen=True)
class GpuInfo:
    name: str | None = None
    compute_capability: str | None = None  # "8.7"
    cuda_driver: str | None = None  # NVML driver version "580.65.06", else CUDA driver API "13.0"
    cuda_runtime: str | None = None  # "12.9"
    source: str | None = None  # "cuda.bindings" | "cuda.cuda" (older cuda-python) | "pynvml"
    sm_count: int | None = None  # streaming multiprocessors (Orin AGX 16, Orin NX 8, Orin Nano 8 or 4...)
    memory_mib: int | None = None  # total device memory (a Jetson's: the shared system memory)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _text(value: Any) -> str:
    """pynvml returns str or bytes, depending on its version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def probe_cuda_bindings(index: int = 0, import_module: Callable[[str], Any] | None = None) -> GpuInfo | None:
    try:
        driver, layout = import_cuda_layout("driver", "the GPU probe", import_module)
    except UnavailableError:
        return None
    try:
        cuda_call(driver, "cuInit", driver.cuInit(0))
        dev = cuda_call(driver, f"cuDeviceGet({index})", driver.cuDeviceGet(index))
        raw = cuda_call(driver, "cuDeviceGetName", driver.cuDeviceGetName(256, dev))
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        attr = driver.CUdevice_attribute
        major = cuda_call(
            driver,
            "cuDeviceGetAttribute(CC major)",
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
        )
        minor = cuda_call(
            driver,
            "cuDeviceGetAttribute(CC minor)",
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
        )
        drv = _cuda_version(cuda_call(driver, "cuDriverGetVersion", driver.cuDriverGetVersion()))
    except CudaError as e:  # no device, no driver, driver too old: a CPU-only machine
        log.debug("%s: no GPU %d: %s", layout, index, e)
        return None
    except Exception as e:  # the bindings' own errors when libcuda cannot be loaded at all
        log.debug("%s: no CUDA driver: %s", layout, e)
        return None
    sm_count = memory_mib = None
    try:
        sm_count = int(
            cuda_call(
                driver,
                "cuDeviceGetAttribute(SM count)",
                driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
            )
        )
        memory_mib = int(cuda_call(driver, "cuDeviceTotalMem", driver.cuDeviceTotalMem(dev))) // 2**20
    except Exception as e:  # CudaError, or bindings without these: the fingerprint records None
        log.debug("%s: SM count / memory of GPU %d: %s", layout, index, e)
    runtime_v = None
    try:
        runtime = import_cuda("runtime", "the GPU probe", import_module)
        runtime_v = _cuda_version(
            cuda_call(runtime, "cudaRuntimeGetVersion", runtime.cudaRuntimeGetVersion())
        )
    except Exception as e:  # UnavailableError, CudaError, the runtime library absent: keep the driver facts
        log.debug("cuda-python runtime: %s", e)
    return GpuInfo(name, f"{major}.{minor}", drv, runtime_v, layout, sm_count, memory_mib)


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")  # optional: nvidia-ml-py


class Nvml:
    """NVML through pynvml, initialised once (on first use, then kept for the life of the process).

    Every read degrades instead of raising: None / {} when pynvml is missing, when there is no driver or
    no permission (NVMLError), or when the device does not answer. A failed initialisation is retried
    on the next read (the driver may come up after the agent). Thread-safe: NVML calls are, and the
    initialisation is under a lock.
    """

    def __init__(self, load: Callable[[], Any] = _import_pynvml) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._lib: Any = None
        # pynvml not installed: remembered, not imported again at every telemetry tick (each failed import
        # scans sys.path and allocates anew).
        self._missing = False

    def lib(self) -> Any | None:
        """The initialised pynvml module, or None where NVML cannot be used."""
        with self._lock:
            if self._lib is None:
                if self._missing:
                    return None
                try:
                    lib = self._load()
                except ImportError:
                    self._missing = True
                    return None
                try:
                    lib.nvmlInit()
                except Exception as e:  # NVMLError: no driver, no GPU, no permission
                    log.debug("NVML init failed: %s", e)
                    return None
                self._lib = lib
            return self._lib

    def info(self, index: int = 0) -> GpuInfo | None:
        """Name, compute capability and driver version of GPU `index`; None when NVML cannot tell."""
        nvml = self.lib()
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            drv = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as e:
            log.debug("NVML: no GPU %d: %s", index, e)
            return None
        memory_mib = None
        with contextlib.suppress(Exception):  # NVML has no SM count; the memory it does say
            memory_mib = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20
        return GpuInfo(name, f"{major}.{minor}", drv, None, "pynvml", None, memory_mib)

    def stats(self) -> dict[str, dict[str, Any]]:
        """{index: {name, util_percent, mem_used_mb, mem_total_mb, temp_c}} of every GPU; {} if unreadable."""
        nvml = self.lib()
        if nvml is None:
            return {}
        try:
            out: dict[str, dict[str, Any]] = {}
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                out[str(i)] = {
                    "name": _text(nvml.nvmlDeviceGetName(h)),
                    "util_percent": float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                    "mem_used_mb": round(mem.used / 2**20, 1),
                    "mem_total_mb": round(mem.total / 2**20, 1),
                    "temp_c": float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                }
                with contextlib.suppress(Exception):  # NVDEC's load (not every board or driver reports it)
                    out[str(i)]["decoder_util_percent"] = float(nvml.nvmlDeviceGetDecoderUtilization(h)[0])
            return out
        except Exception as e:  # NVMLError and friends: a device gone, no permission
            log.debug("NVML stats: %s", e)
            return {}

    def count(self) -> int:
        """GPUs the driver sees (0 where NVML cannot be used)."""
        nvml = self.lib()
        if nvml is None:
            return 0
        try:
            return int(nvml.nvmlDeviceGetCount())
        except Exception:
            return 0

    def process_memory(self) -> dict[int, float]:
        """Device memory (MB) per process id over every GPU (engines, NVDEC surfaces, CUDA contexts); {}
        where unreadable (containers often hide other processes)."""
        nvml = self.lib()
        if nvml is None:
            return {}
        out: dict[int, float] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    used = proc.usedGpuMemory or 0  # None where the driver does not say
                    out[int(proc.pid)] = out.get(int(proc.pid), 0.0) + round(used / 2**20, 1)
        except Exception as e:
            log.debug("NVML process memory: %s", e)
        return out


NVML = Nvml()


def probe_nvml(index: int = 0) -> GpuInfo | None:
    return NVML.info(index)


def probe_gpu(index: int = 0) -> GpuInfo:
    """First answer of cuda.bindings, then NVML (its driver string is more precise: merged in)."""
    cb = probe_cuda_bindings(index)
    nv = probe_nvml(index)
    if cb and nv:
        return replace(cb, cuda_driver=nv.cuda_driver, source=f"{cb.source}+pynvml")
    return cb or nv or GpuInfo()
