"""CPU and memory of this process, and of the GPUs (NVML), as the telemetry payload reports them."""

from __future__ import annotations

import threading
from typing import Any

import psutil

from engines.cuda.gpu_probe import NVML, Nvml


class ProcessStats:
    """CPU and RSS of this process. cpu_percent is since the previous call (may exceed 100 on >1 core)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # prime: the first call always returns 0.0

    def sample(self) -> dict[str, float]:
        with self._proc.oneshot():
            cpu = self._proc.cpu_percent(None)
            rss = self._proc.memory_info().rss
        return {"cpu_percent": round(cpu, 1), "rss_mb": round(rss / 2**20, 1)}


_process: ProcessStats | None = None
_process_lock = threading.Lock()


def process_stats() -> dict[str, float]:
    """{cpu_percent, rss_mb} of this process, CPU since the previous call (module-wide sampler)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = ProcessStats()
        return _process.sample()


def gpu_stats(nvml: Nvml = NVML) -> dict[str, dict[str, Any]]:
    """{index: {name, util_percent, mem_used_mb, mem_total_mb, temp_c}} via NVML; {} when unreadable.

    NVML is optional (absent on Jetson, where tegrastats is the source): any failure gives {}. The
    reader is engines.cuda.gpu_probe's, initialised once per process.
    """
    return nvml.stats()
