"""CUDA through cuda-python (optional, imported lazily): device and pinned buffers, streams and events
(buffers), kernels compiled at run time (kernels), and what GPU is here (gpu_probe, with NVML).
"""
