"""Issue 35's TensorRT build-side defects that fake_tensorrt models (see its docstring), one test or more
each; each failed before its fix:

- 1. the plugin library was handed a build's own logger, which it keeps as a raw pointer and logs through
  long after that build is gone (use-after-free);
- 2. a timing cache of another device was merged into ours (combine(..., ignore_mismatch=True)).
Written to the TensorRT docs (TensorRT <= 10 cannot run here).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import fake_tensorrt
import pytest
from test_trt_review import fake_build, tiny_onnx

from engines.trt import TrtApi


# --- 1. one process-lifetime logger for the plugins -------------------------------------------------
def test_plugins_log_to_a_logger_that_outlives_every_build(tmp_path: Path) -> None:
    mod = fake_tensorrt.make("10.3.0")
    path = tiny_onnx(tmp_path / "p.onnx", plugin=True)
    fake_build(tmp_path, mod, path, precision="fp16")
    gc.collect()  # the first build's own logger is gone now
    assert mod._plugin_logger is not None and mod._plugin_logger() is not None
    # A second build parses the plugin op again: the plugin logs through the registered logger (before:
    # the first build's destroyed logger, a RuntimeError in the fake, a crash in TensorRT).
    fake_build(tmp_path / "again", mod, path, precision="fp16")
    api = TrtApi(mod)
    assert mod._plugin_logger() is api.plugin_logger()  # one per module, for the process


def test_the_plugin_logger_keeps_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    mod = fake_tensorrt.make("10.3.0")
    logger = TrtApi(mod).plugin_logger()
    with caplog.at_level(logging.ERROR, logger="engines.trt"):
        logger.log(mod.ILogger.Severity.ERROR, "plugin failed")
    assert logger.errors == [] and "plugin failed" in caplog.text  # logged, not accumulated for ever


# --- 2. never merge foreign timings ------------------------------------------------------------------
def test_timing_cache_of_another_device_is_overwritten_not_merged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mod = fake_tensorrt.make("10.3.0")
    onnx_path = tiny_onnx(tmp_path / "m.onnx")
    _, _, res, _ = fake_build(tmp_path, mod, onnx_path)
    cache = Path(res.manifest.build.timing_cache["path"])
    # Same TensorRT, another device's header and timings, under this cache's name.
    cache.write_bytes(b"trt10.3.0@other-gpu;foreign1,foreign2")
    with caplog.at_level(logging.WARNING, logger="engines.trt"):
        _, _, again, _ = fake_build(tmp_path, mod, onnx_path)
    assert again.manifest.build.timing_cache["status"] == "mismatch"
    saved = cache.read_bytes()
    assert saved == b"trt10.3.0@gpu0;conv1,conv2", saved  # ours only (before: foreign1,foreign2 merged in)
    assert "belongs to another device or version; overwriting" in caplog.text


def test_a_cache_saved_meanwhile_on_this_device_is_merged(tmp_path: Path) -> None:
    mod = fake_tensorrt.make("10.3.0")
    api = TrtApi(mod)
    config = mod.IBuilderConfig()
    cache, _, status = api.attach_timing_cache(config, b"")
    cache.keys = ["ours"]
    assert status == "empty"
    merged = api.merged_timing_cache(config, cache, b"trt10.3.0@gpu0;theirs")
    assert merged == b"trt10.3.0@gpu0;ours,theirs"
    # Unreadable, another version, another device: ours alone.
    for on_disk in (b"\x00junk", b"trt10.0.0@gpu0;old", b"trt10.3.0@orin-nx;nx"):
        assert api.merged_timing_cache(config, cache, on_disk) == b"trt10.3.0@gpu0;ours,theirs"


def test_fake_combine_models_ignore_mismatch() -> None:
    """ITimingCache::combine as NvInfer.h documents it: another version is skipped whatever the flag;
    another device only without ignore_mismatch (the flag the fix stopped passing)."""
    mod = fake_tensorrt.make("10.3.0")
    config = mod.IBuilderConfig()
    ours = config.create_timing_cache(b"trt10.3.0@gpu0;a")
    assert ours.combine(config.create_timing_cache(b"trt10.3.0@nx;b"), False) is False
    assert ours.combine(config.create_timing_cache(b"trt10.2.0@gpu0;c"), True) is False
    assert ours.combine(config.create_timing_cache(b"trt10.3.0@nx;b"), True) is True and "b" in ours.keys
