"""What GPU is here: name, compute capability, driver and CUDA runtime versions.

Tries cuda-python (`cuda.bindings`, works on Jetson and desktops) and then NVML (`pynvml`, desktops
and servers; Jetson has no NVML). Both are optional: without either, or without a GPU, the answer
is `GpuInfo()` (all None), which is what a CPU-only build machine gets.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("engines.gpu")


@dataclass(frozen=True)
class GpuInfo:
    name: str | None = None
    compute_capability: str | None = None  # "8.7"
    cuda_driver: str | None = None  # NVML driver version "580.65.06", else CUDA driver API "13.0"
    cuda_runtime: str | None = None  # "12.9"
    source: str | None = None  # "cuda.bindings" | "pynvml"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _ok(result: Any) -> Any:
    """cuda-python returns (err, *values); raise unless err is success, else return the value(s)."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else tuple(values)


def probe_cuda_bindings(index: int = 0) -> GpuInfo | None:
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return None
    try:
        _ok(driver.cuInit(0))
        dev = _ok(driver.cuDeviceGet(index))
        raw = _ok(driver.cuDeviceGetName(256, dev))
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        attr = driver.CUdevice_attribute
        major = _ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = _ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        drv = _cuda_version(_ok(driver.cuDriverGetVersion()))
    except Exception as e:  # no driver / no device: a CPU-only machine
        log.debug("cuda.bindings: no GPU %d: %s", index, e)
        return None
    runtime_v = None
    try:
        runtime = importlib.import_module("cuda.bindings.runtime")
        runtime_v = _cuda_version(_ok(runtime.cudaRuntimeGetVersion()))
    except Exception as e:  # runtime library absent: keep the driver-side facts
        log.debug("cuda.bindings.runtime: %s", e)
    return GpuInfo(name, f"{major}.{minor}", drv, runtime_v, "cuda.bindings")


def probe_nvml(index: int = 0) -> GpuInfo | None:
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except Exception as e:
        log.debug("NVML init failed: %s", e)
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        drv = nvml.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else str(drv)
        return GpuInfo(name, f"{major}.{minor}", drv, None, "pynvml")
    except Exception as e:
        log.debug("NVML: no GPU %d: %s", index, e)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # shutting down is best effort
            log.debug("NVML shutdown: %s", e)


def probe_gpu(index: int = 0) -> GpuInfo:
    """First answer of cuda.bindings, then NVML (its driver string is more precise: merged in)."""
    cb = probe_cuda_bindings(index)
    nv = probe_nvml(index)
    if cb and nv:
        return GpuInfo(
            cb.name, cb.compute_capability, nv.cuda_driver, cb.cuda_runtime, "cuda.bindings+pynvml"
        )
    return cb or nv or GpuInfo()
