"""Device fingerprint, engine store, build, precision and runtimes.

    trt/        TensorRT and TensorRT-RTX: every version difference (TrtApi, import_trt)
    build/      ONNX -> a stored plan: builder, trt_plan, compat check, INT8 (calibrator, quantize), islands
    store/      the engine store: plans, manifests, previous plans, the build lock, crash-safe writes
    runtimes/   backends that run a model (ONNX Runtime, TensorRT slots, replay) and per-layer profiles
    cuda/       cuda-python buffers, streams, kernels, and the GPU probe
    cache/      the fleet's shared engine cache: signed OCI artifacts in a registry (push, verified pull)
    fingerprint, manifest, precision, plan, settings, buildproc, keys, errors: shared by the packages above

Imports nothing of agent/ or pipelines/ (imports flow agent -> pipelines -> engines).
"""
