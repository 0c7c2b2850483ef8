"""The compatibility key is the engine cache's tag: it must change with everything that makes a plan fit a
device (TensorRT flavour, version and build; GPU name, compute capability, SM count, memory, DLA core and
cores; L4T; platform; ONNX sha256; precision; profiles; workspace; optimisation level; INT8 calibration),
and stay the same for everything else, on every machine (a pure function of what it names)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engines.build.compat import KEY_LEN, BuildSpec
from engines.fingerprint import Fingerprint

ORIN_AGX = Fingerprint(
    trt_flavor="tensorrt", trt_version="10.3.0.30", gpu_name="Orin", compute_capability="8.7",
    cuda_driver="12.6", cuda_runtime="12.6", l4t="R36.4.0", dla_core=None, platform="linux-aarch64",
    dla_cores=2, sm_count=16, memory_gib=64,
)
SHAPE = [1, 3, 416, 416]
PROFILES = [{"images": {"min": SHAPE, "opt": SHAPE, "max": SHAPE}}]
BATCHED = [{"images": {"min": SHAPE, "opt": [4, 3, 416, 416], "max": [8, 3, 416, 416]}}]


def spec(fp: Fingerprint = ORIN_AGX, **over: Any) -> BuildSpec:
    fields: dict[str, Any] = {
        "fingerprint": fp, "onnx_sha256": "a" * 64, "precision": "fp16", "profiles": PROFILES,
        "workspace_bytes": 1 << 30, "optimization_level": 3, "calibration": None, **over,
    }
    return BuildSpec(**fields)


def test_the_key_is_a_pure_function_of_what_it_names() -> None:
    first = spec()
    assert first.key == spec().key == BuildSpec(**dataclasses.asdict(first) | {"fingerprint": ORIN_AGX}).key
    assert len(first.key) == KEY_LEN and all(c in "0123456789abcdef" for c in first.key)
    # A literal: a change of the key scheme shows here (and means every store rebuilds once).
    assert first.key == "2def2f05759f0efc"


@pytest.mark.parametrize(
    "change",
    [
        {"trt_flavor": "tensorrt_rtx"},
        {"trt_version": "10.3.0.31"},  # the same release, another build
        {"gpu_name": "NVIDIA GeForce RTX 4090"},
        {"compute_capability": "8.9"},
        {"sm_count": 8},  # Orin NX against AGX: same name and compute capability
        {"memory_gib": 32},
        {"dla_core": 0},
        {"dla_cores": 0},
        {"l4t": "R36.3.0"},
        {"platform": "linux-x86_64"},
    ],
)
def test_every_device_fact_of_a_plan_changes_the_key(change: dict[str, Any]) -> None:
    assert spec(dataclasses.replace(ORIN_AGX, **change)).key != spec().key


@pytest.mark.parametrize(
    "change",
    [
        {"onnx_sha256": "b" * 64},
        {"precision": "fp32"},
        {"profiles": BATCHED},
        {"profiles": PROFILES * 2},  # two execution contexts
        {"workspace_bytes": 2 << 30},
        {"optimization_level": 5},
        {"calibration": {"method": "entropy", "samples": 500}},
        {"int8_layers": {"keep": ["/head/.*"], "as": "fp16", "constraints": "prefer"}},
    ],
)
def test_every_build_setting_of_a_plan_changes_the_key(change: dict[str, Any]) -> None:
    assert spec(**change).key != spec().key


def test_driver_and_cuda_runtime_are_recorded_but_do_not_change_the_key() -> None:
    """A plan stays loadable across a driver update; TensorRT refusing one at load triggers a local
    rebuild (build.refused_at_load), which then is never pushed over the cached one."""
    newer = dataclasses.replace(ORIN_AGX, cuda_driver="12.8", cuda_runtime="12.8")
    assert spec(newer).key == spec().key
