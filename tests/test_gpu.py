"""GPU-side checks, run on the device box (`pytest -m gpu`); CI has no GPU and skips them."""

from __future__ import annotations

import re

import pytest

from engines.cuda.gpu_probe import probe_gpu

pytestmark = pytest.mark.gpu


def test_gpu_probe_reads_name_compute_capability_driver_and_runtime() -> None:
    info = probe_gpu(0)
    assert info.name, "no GPU found by cuda-python or NVML"
    assert re.fullmatch(r"\d+\.\d+", info.compute_capability or "")
    assert info.cuda_driver and info.cuda_runtime


def test_fingerprint_fields_from_gpu_without_tensorrt() -> None:
    # The GPU box has no TensorRT: the fingerprint needs a TensorRT module, so probe the GPU half only,
    # and check that both probes (cuda.bindings, NVML) agree where both are installed.
    from engines.cuda.gpu_probe import probe_cuda_bindings, probe_nvml

    cb, nv = probe_cuda_bindings(0), probe_nvml(0)
    if cb is None or nv is None:
        pytest.skip("needs both cuda-python and pynvml")
    assert cb.name == nv.name
    assert cb.compute_capability == nv.compute_capability


def test_gpu_telemetry_reads_nvml() -> None:
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the `cuda` extra)")
    from agent.telemetry import gpu_stats

    stats = gpu_stats()
    assert stats, "NVML gave nothing on a GPU machine"
    first = stats["0"]
    assert first["name"] and first["mem_total_mb"] > 1000
    assert 0.0 <= first["util_percent"] <= 100.0 and 0.0 < first["temp_c"] < 110.0


def test_device_buffer_round_trip_and_clear_errors() -> None:
    import numpy as np

    from engines.cuda.buffers import CudaError, DeviceBuffer

    batch = np.random.default_rng(1).standard_normal((2, 3, 416, 416)).astype(np.float32)
    with DeviceBuffer(batch.nbytes) as buf:
        buf.copy_from_host(batch)
        back = buf.copy_to_host(np.empty_like(batch))
        assert np.array_equal(back, batch)
        with pytest.raises(CudaError, match="does not fit"):
            buf.copy_from_host(np.zeros(batch.size + 1, np.float32))
    with pytest.raises(CudaError, match="cudaMalloc"):
        DeviceBuffer(1 << 50)  # 1 PiB
