"""CUDA kernels from source at run time: NVRTC compiles for the GPU present, the driver API launches.

    module = CudaModule.compile(SOURCE, "letterbox.cu")      # once; CudaError naming the problem
    kernel = module.function("letterbox_nchw")
    kernel.launch(grid, block, stream, [(ptr, ctypes.c_void_p), (h, ctypes.c_int), ...])

cuda-python only (the `cuda` extra), through engines.cuda.bindings: `cuda.bindings.{nvrtc,driver,runtime}`
(cuda-python >= 12.6.1) or the older `cuda.{nvrtc,cuda,cudart}`. The code is compiled to a cubin for the
device's own compute capability, so no PTX JIT is involved and a driver older than NVRTC still loads it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from engines.cuda.bindings import import_cuda
from engines.cuda.buffers import CudaError, Stream, cuda_call, import_cudart

KernelArg = tuple[Any, type]  # (value, ctypes type): c_void_p for device pointers, c_int, c_float, ...


def _nvrtc_call(nvrtc: ModuleType, what: str, result: Any, program: Any = None) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        detail = ""
        if program is not None:  # the compiler log says which line and why
            size = nvrtc.nvrtcGetProgramLogSize(program)[1]
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            detail = ": " + log.decode(errors="replace").strip()
        name = nvrtc.nvrtcGetErrorString(err)[1]
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}{detail}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


@dataclass(frozen=True)
class Kernel:
    name: str
    _function: Any
    _module: CudaModule

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: Stream,
        args: Sequence[KernelArg],
    ) -> None:
        """Queue the kernel on `stream` (returns at once)."""
        self._module.make_current()
        values = tuple(v for v, _ in args)
        types = tuple(t for _, t in args)
        cuda_call(
            self._module.driver,
            f"cuLaunchKernel({self.name})",
            self._module.driver.cuLaunchKernel(
                self._function, *grid, *block, 0, stream.handle, (values, types), 0
            ),
        )


class CudaModule:
    """Compiled kernels loaded into the device's primary context (the one the runtime API uses)."""

    def __init__(self, driver: ModuleType, cudart: ModuleType, module: Any, device: int) -> None:
        self.driver, self._rt, self._module, self._device = driver, cudart, module, device
        self._current = threading.local()

    @classmethod
    def compile(cls, source: str, name: str, options: Sequence[str] = (), device: int = 0) -> CudaModule:
        nvrtc = import_cuda("nvrtc", "CUDA kernels")
        driver = import_cuda("driver", "CUDA kernels")
        cudart = import_cudart()
        cuda_call(cudart, "cudaSetDevice", cudart.cudaSetDevice(device))  # the primary context, current
        attr = cudart.cudaDeviceAttr
        major, minor = (
            cuda_call(cudart, "cudaDeviceGetAttribute", cudart.cudaDeviceGetAttribute(a, device))
            for a in (attr.cudaDevAttrComputeCapabilityMajor, attr.cudaDevAttrComputeCapabilityMinor)
        )
        program = _nvrtc_call(
            nvrtc, "nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
        )
        try:
            opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), *(o.encode() for o in options)]
            compiled = nvrtc.nvrtcCompileProgram(program, len(opts), opts)
            _nvrtc_call(nvrtc, f"compiling {name} for sm_{major}{minor}", compiled, program)
            size = _nvrtc_call(nvrtc, "nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(program))
            cubin = b" " * size
            _nvrtc_call(nvrtc, "nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(program, cubin))
        finally:
            nvrtc.nvrtcDestroyProgram(program)
        module = cuda_call(driver, f"cuModuleLoadData({name})", driver.cuModuleLoadData(cubin))
        return cls(driver, cudart, module, device)

    def function(self, name: str) -> Kernel:
        found = self.driver.cuModuleGetFunction(self._module, name.encode())
        function = cuda_call(self.driver, f"cuModuleGetFunction({name})", found)
        return Kernel(name, function, self)

    def make_current(self) -> None:
        """Driver-API launches need the primary context current on the calling thread; the runtime API
        makes it so (once per thread)."""
        if not getattr(self._current, "done", False):
            cuda_call(self._rt, "cudaSetDevice", self._rt.cudaSetDevice(self._device))
            self._current.done = True

    def unload(self) -> None:
        if self._module is not None:
            module, self._module = self._module, None
            cuda_call(self.driver, "cuModuleUnload", self.driver.cuModuleUnload(module))
