"""A missing pynvml is looked for once per process, not at every telemetry tick (issue 36.19, residual drift:
the failed import ran every tick and kept allocating)."""

from __future__ import annotations

from agent.telemetry.process import gpu_stats
from engines.cuda.gpu_probe import Nvml


def test_missing_pynvml_is_imported_once() -> None:
    tries: list[int] = []

    def missing() -> None:
        tries.append(1)
        raise ImportError("No module named 'pynvml'")

    nvml = Nvml(missing)
    for _ in range(50):  # 50 telemetry ticks
        assert gpu_stats(nvml) == {}
        assert nvml.info(0) is None
    assert len(tries) == 1
