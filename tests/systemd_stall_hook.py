"""Test-only: a hung backend on demand, for the agent that the booted systemd runs (test_service_systemd.py).

Copied into that test's service venv as `edge_agent_test_stall` and imported by a .pth there, never part
of an install. It does nothing unless EDGE_AGENT_TEST_STALL names a file (the test's unit drop-in sets
it); then, while that file exists, ONNX Runtime inference on the model worker threads ("model-...") waits,
as a backend hung in its driver would: frames keep arriving, no result comes out, the process lives.
The real backend runs otherwise (tests/test_service.py gates it the same way in-process).
"""

from __future__ import annotations

import os

FLAG = os.environ.get("EDGE_AGENT_TEST_STALL")

if FLAG:
    import threading
    import time

    from engines.runtimes.ort import OrtBackend

    _real = OrtBackend._infer_impl

    def _stalling(backend: OrtBackend, batch):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("model-"):
            while os.path.exists(FLAG):
                time.sleep(0.1)
        return _real(backend, batch)

    OrtBackend._infer_impl = _stalling  # type: ignore[method-assign]
