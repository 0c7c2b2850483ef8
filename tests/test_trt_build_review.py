"""Issue 35, item 15: builds on Jetson record the nvpmodel power mode and whether the clocks were locked
(engines.build.power, the manifest's build.jetson; older manifests load without it), and the INT8 pre-pass
(calibration without the FP32 island, its engine thrown away) builds at optimisation level 0 with the
timing cache, which the full build then shares. On fake_tensorrt (weakly typed TensorRT cannot run here).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import fake_tensorrt
import numpy as np
import pytest
from test_islands_parsed import RECORDED, grafted  # noqa: F401 - the grafted-model fixture
from test_trt_review import fp_for

from engines.build.builder import build
from engines.build.power import clock_state, jetson_power, parse_nvpmodel
from engines.errors import ManifestError
from engines.manifest import load_manifest
from engines.settings import BuildSettings
from engines.store import EngineStore
from engines.trt import TrtApi

NANODET = Path(__file__).resolve().parents[1] / "agent" / "assets" / "nanodet-m-416.onnx"


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



# --- the Jetson's power mode and clocks in the manifest --------------------------------------------------
NVPMODEL_Q = "NV Fan Mode:quiet\nNV Power Mode: MAXN\n0\n"


def _sysfs(root: Path, gpu: tuple[int, int], cpus: list[tuple[int, int]]) -> Path:
    node = root / "class" / "devfreq" / "17000000.ga10b"
    node.mkdir(parents=True)
    (node / "min_freq").write_text(f"{gpu[0]}\n")
    (node / "max_freq").write_text(f"{gpu[1]}\n")
    for i, (lo, hi) in enumerate(cpus):
        policy = root / "devices" / "system" / "cpu" / f"cpu{i}" / "cpufreq"
        policy.mkdir(parents=True)
        (policy / "scaling_min_freq").write_text(f"{lo}\n")
        (policy / "scaling_max_freq").write_text(f"{hi}\n")
    return root


def test_parse_nvpmodel() -> None:
    assert parse_nvpmodel(NVPMODEL_Q) == {"name": "MAXN", "id": 0}
    assert parse_nvpmodel("NV Power Mode: 15W\n1\n") == {"name": "15W", "id": 1}
    assert parse_nvpmodel("NV Power Mode: MODE_30W") == {"name": "MODE_30W", "id": None}
    assert parse_nvpmodel("nvpmodel: command not found") is None


def test_clock_state_from_sysfs(tmp_path: Path) -> None:
    locked = _sysfs(tmp_path / "a", (1_300_500_000, 1_300_500_000), [(2_201_600, 2_201_600)] * 2)
    assert clock_state(locked) == {
        "locked": True,
        "gpu_min_hz": 1_300_500_000,
        "gpu_max_hz": 1_300_500_000,
        "cpus_locked": True,
    }
    floating = _sysfs(tmp_path / "b", (306_000_000, 1_300_500_000), [(115_200, 2_201_600)])
    assert clock_state(floating)["locked"] is False  # type: ignore[index]
    cpus_only = _sysfs(tmp_path / "c", (1_300_500_000, 1_300_500_000), [(115_200, 2_201_600)])
    assert clock_state(cpus_only)["locked"] is False  # type: ignore[index]
    assert clock_state(tmp_path / "none") is None


def test_a_jetson_build_records_power_mode_and_clocks(tmp_path: Path) -> None:
    mod = fake_tensorrt.make("10.3.0")
    api = TrtApi(mod)
    fp = replace(fp_for(api), l4t="R36.4.3")  # a Jetson
    sysfs = _sysfs(tmp_path / "sys", (1_300_500_000, 1_300_500_000), [(2_201_600, 2_201_600)])
    store = EngineStore(tmp_path / "e")
    settings = BuildSettings(onnx=NANODET, precision="fp16")
    result = build(
        store,
        "det",
        settings,
        api=api,
        fingerprint=fp,
        force=True,
        power_probe=lambda f: jetson_power(f, query=lambda: NVPMODEL_Q, sysfs=sysfs),
    )
    jetson = result.manifest.build.jetson
    assert jetson["nvpmodel"] == {"name": "MAXN", "id": 0} and jetson["clocks_locked"] is True
    # Stored and read back.
    assert store.manifest("det", result.key).build.jetson == jetson


def test_no_jetson_record_off_a_jetson_and_old_manifests_load(tmp_path: Path) -> None:
    mod = fake_tensorrt.make("10.3.0")
    api = TrtApi(mod)
    fp = replace(fp_for(api), l4t=None)
    assert jetson_power(fp, query=lambda: NVPMODEL_Q) is None
    store = EngineStore(tmp_path / "e")
    result = build(store, "det", BuildSettings(onnx=NANODET, precision="fp16"), api=api, fingerprint=fp)
    assert result.manifest.build.jetson is None
    path = store.manifest_path("det", result.key)
    data = json.loads(path.read_text())
    assert "jetson" not in data["build"]  # as a manifest written before the field existed
    assert load_manifest(path).build.jetson is None
    data["build"]["jetson"] = "MAXN"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"build\.jetson"):
        load_manifest(path)
