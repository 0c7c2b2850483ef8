"""What tells one device from another (issue 35, items 5 and 8): the GPU probe on the older cuda-python
layout (cuda.cuda, cuda-python 12.0-12.6.0 as on JetPack 6), and the SM count, memory and DLA cores in the
fingerprint key and the timing cache's name, with manifests written before them still readable."""

from __future__ import annotations

import json
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
from test_gpu_probe import fake_driver

from engines.build.builder import timing_cache_path
from engines.build.compat import BuildSpec, differences
from engines.cuda.bindings import import_cuda
from engines.cuda.gpu_probe import GpuInfo, probe_cuda_bindings
from engines.errors import UnavailableError
from engines.fingerprint import Fingerprint, probe_fingerprint
from engines.manifest import load_manifest
from engines.store import EngineStore
from engines.trt import TrtApi

DATA = Path(__file__).resolve().parent / "data"


def orin_driver(sms: int, total_bytes: int) -> types.SimpleNamespace:
    driver = fake_driver()
    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = "sms"
    driver.cuDeviceGetAttribute = lambda a, dev: (0, {"major": 8, "minor": 7, "sms": sms}[a])
    driver.cuDeviceGetName = lambda n, dev: (0, b"Orin\0")
    driver.cuDeviceTotalMem = lambda dev: (0, total_bytes)
    return driver


# --- 5. cuda-python before 12.6.1: cuda.cuda / cuda.cudart -------------------------------------------
def test_probe_reads_the_gpu_through_the_older_cuda_python_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)
    monkeypatch.setitem(sys.modules, "cuda.cuda", orin_driver(8, 7_620 * 2**20))
    monkeypatch.setitem(
        sys.modules, "cuda.cudart", types.SimpleNamespace(cudaRuntimeGetVersion=lambda: (0, 12020))
    )
    # Before: only cuda.bindings was tried, and this Jetson looked GPU-less (None).
    assert probe_cuda_bindings(0) == GpuInfo("Orin", "8.7", "12.4", "12.2", "cuda.cuda", 8, 7_620)


def test_import_cuda_names_both_layouts_when_neither_imports() -> None:
    def absent(name: str) -> types.ModuleType:
        raise ImportError(f"No module named {name!r}")

    with pytest.raises(
        UnavailableError,
        match=r"^the GPU probe: cuda-python is not importable \(pip install cuda-python\): "
        r"cuda.bindings.driver: .*; cuda.cuda: ",
    ):
        import_cuda("driver", "the GPU probe", absent)
    with pytest.raises(ValueError, match="unknown cuda-python part 'nvjpeg'"):
        import_cuda("nvjpeg")


# --- 8. Orin modules told apart ----------------------------------------------------------------------
def orin(sms: int, gib: int, dla: int) -> Fingerprint:
    return Fingerprint(
        "tensorrt", "10.3.0", "Orin", "8.7", "540.4", "12.6", "R36.4.3", None, "linux-aarch64", dla, sms, gib
    )


def spec(fp: Fingerprint) -> BuildSpec:
    profiles = [{"images": {"min": [1, 3, 8, 8], "opt": [1, 3, 8, 8], "max": [1, 3, 8, 8]}}]
    return BuildSpec(fp, "3fad96b4304f953fc2228462e9736cbc25c3ac9519d854ffac6fcee64e16e809", "fp16",
                     profiles, 1 << 30, 3)  # fmt: skip


def test_orin_modules_get_their_own_engine_keys_and_timing_caches(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    agx, nx16, nx8, nano = orin(16, 61, 2), orin(8, 15, 2), orin(8, 7, 0), orin(4, 7, 0)
    keys = {spec(fp).key for fp in (agx, nx16, nx8, nano)}
    caches = {timing_cache_path(store, fp) for fp in (agx, nx16, nx8, nano)}
    assert len(keys) == len(caches) == 4  # before: one key and one timing cache for every "Orin"
    assert timing_cache_path(store, agx).name == "tensorrt-10.3.0-Orin-sm8.7-16sms-61gib-2dla.cache"
    assert set(agx.manifest_dict()) >= {"sm_count", "memory_gib", "dla_cores"}


def test_probe_fingerprint_records_sm_count_memory_and_dla_cores(tmp_path: Path) -> None:
    import fake_tensorrt

    api = TrtApi(fake_tensorrt.make("10.3.0", dla_cores=2))
    gpu = GpuInfo("Orin", "8.7", "12.6", "12.6", "cuda.cuda", 16, 62_841)
    fp = probe_fingerprint(api, tegra_release=tmp_path / "absent", dpkg_version=lambda: None, gpu=gpu)
    assert (fp.sm_count, fp.memory_gib) == (16, 61)
    assert fp.dla_cores == api.num_dla_cores()


def test_a_manifest_written_before_the_device_fields_loads_and_names_the_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "0123456789abcdef.json"
    shutil.copy(DATA / "manifest_before_device_fields.json", path)
    old = load_manifest(path)  # before the fields existed: still a valid manifest
    assert "sm_count" not in old.fingerprint
    fp = replace(orin(16, 61, 2), l4t=None, cuda_driver="540.3")
    assert differences(old, spec(fp)) == [
        "device details (SM count, memory, DLA cores) not recorded: the manifest predates them"
    ]
    # Written again with today's fingerprint: the same build, no difference.
    raw = json.loads(path.read_text())
    raw["fingerprint"] = fp.manifest_dict()
    path.write_text(json.dumps(raw))
    assert differences(load_manifest(path), spec(fp)) == []
    assert differences(load_manifest(path), spec(replace(fp, sm_count=8))) == ["sm_count 16 -> 8"]
    raw["fingerprint"]["sm_count"] = "16"
    path.write_text(json.dumps(raw))
    with pytest.raises(Exception, match=r"field 'fingerprint.sm_count' must be int"):
        load_manifest(path)
