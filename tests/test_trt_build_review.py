"""Issue 35, item 15: builds on Jetson record the nvpmodel power mode and whether the clocks were locked
(engines.build.power, the manifest's build.jetson; older manifests load without it), and the INT8 pre-pass
(calibration without the FP32 island, its engine thrown away) builds at optimisation level 0 with the
timing cache, which the full build then shares. On fake_tensorrt (weakly typed TensorRT cannot run here).
"""

from __future__ import annotations

from pathlib import Path

import fake_tensorrt
import numpy as np
import pytest
from test_islands_parsed import RECORDED, grafted  # noqa: F401 - the grafted-model fixture
from test_trt_review import fp_for

from engines.build.builder import build
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi


def _int8_build(onnx: Path, tmp_path: Path) -> tuple[object, list[object]]:
    mod = fake_tensorrt.make("10.3.0", int8=True, parsed=RECORDED)
    api = TrtApi(mod)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, 3, 416, 416)).astype(np.float32) for _ in range(2)]
    settings = BuildSettings(onnx=onnx, precision="int8", calibration={"method": "entropy", "samples": 2})
    result = build(
        EngineStore(tmp_path / "e"),
        "det",
        settings,
        api=api,
        fingerprint=fp_for(api),
        force=True,
        calibration_batches=data,
        device_allocator=fake_tensorrt.FakeAllocator(),
    )
    configs = [c[1] for c in mod.calls if c[0] == "build"]
    return result, configs


def test_int8_prepass_builds_at_level_0_with_the_timing_cache(
    grafted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    result, (prepass, full) = _int8_build(grafted, tmp_path)
    assert result.manifest.build.int8["calibrated_graph"] == "without_fp32_island"
    assert prepass.builder_optimization_level == 0
    assert full.builder_optimization_level == result.manifest.build.optimization_level == 3
    # One cache for both: what the pre-pass timed is there for the full build, and is saved after it.
    assert prepass.timing_cache is not None and full.timing_cache is prepass.timing_cache
    assert result.manifest.build.timing_cache["status"] == "empty"
    saved = Path(result.manifest.build.timing_cache["path"]).read_bytes()
    assert b"conv1" in saved


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
