"""engines.cuda.gpu_probe without a GPU: fake cuda-python driver/runtime and pynvml modules (tests/test_gpu.py
runs the real ones on the device box)."""

from __future__ import annotations

import sys
import types

import pytest

from engines.cuda import gpu_probe
from engines.cuda.buffers import CudaError, cuda_call
from engines.cuda.gpu_probe import GpuInfo, Nvml, probe_cuda_bindings, probe_gpu

_NAMES = {0: b"CUDA_SUCCESS", 100: b"CUDA_ERROR_NO_DEVICE"}


def fake_driver(init_error: int = 0, init_raises: Exception | None = None) -> types.SimpleNamespace:
    """The slice of cuda.bindings.driver that probe_cuda_bindings calls: (err, *values) tuples."""

    def cu_init(flags: int) -> tuple[int]:
        if init_raises is not None:
            raise init_raises
        return (init_error,)

    attr = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
    )
    return types.SimpleNamespace(
        CUdevice_attribute=attr,
        cuInit=cu_init,
        cuDeviceGet=lambda i: (0, i),
        cuDeviceGetName=lambda n, dev: (0, b"NVIDIA Fake GPU\0\0\0"),
        cuDeviceGetAttribute=lambda a, dev: (0, {"major": 8, "minor": 9}[a]),
        cuDriverGetVersion=lambda: (0, 12040),
        cuGetErrorName=lambda err: (0, _NAMES[int(err)]),
    )


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch):
    def install(driver: types.SimpleNamespace) -> None:
        runtime = types.SimpleNamespace(cudaRuntimeGetVersion=lambda: (0, 12030))
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)

    return install


def test_cuda_call_names_driver_api_errors() -> None:
    driver = fake_driver()
    assert cuda_call(driver, "cuDriverGetVersion", driver.cuDriverGetVersion()) == 12040
    assert cuda_call(driver, "cuInit", (0,)) is None
    with pytest.raises(CudaError, match=r"^cuInit failed: CUDA_ERROR_NO_DEVICE \(100\)$"):
        cuda_call(driver, "cuInit", (100,))


def test_probe_cuda_bindings_reads_the_device(cuda) -> None:
    cuda(fake_driver())
    assert probe_cuda_bindings(0) == GpuInfo("NVIDIA Fake GPU", "8.9", "12.4", "12.3", "cuda.bindings")


@pytest.mark.parametrize(
    "driver",
    [fake_driver(init_error=100), fake_driver(init_raises=RuntimeError("Failed to dlopen libcuda.so.1"))],
    ids=["no-device", "no-libcuda"],
)
def test_probe_cuda_bindings_degrades_to_none(cuda, driver: types.SimpleNamespace) -> None:
    cuda(driver)
    assert probe_cuda_bindings(0) is None


def test_probe_gpu_merges_the_nvml_driver_string(cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda(fake_driver())
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA Fake GPU",
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 9),
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
    )
    monkeypatch.setattr(gpu_probe, "NVML", Nvml(lambda: nvml))
    assert probe_gpu(0) == GpuInfo("NVIDIA Fake GPU", "8.9", "550.54.15", "12.3", "cuda.bindings+pynvml")
    monkeypatch.setattr(gpu_probe, "NVML", Nvml(lambda: (_ for _ in ()).throw(ImportError("no pynvml"))))
    assert probe_gpu(0).source == "cuda.bindings"
