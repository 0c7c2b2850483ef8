"""Several optimisation profiles from the config, built for real with TensorRT-RTX (CPU, ahead of time)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.config import parse_config
from agent.lifecycle.model import ModelContext
from engines.build.builder import build
from engines.build.compat import check
from engines.fingerprint import probe_fingerprint
from engines.store import EngineStore
from engines.trt import import_trt

pytest.importorskip("tensorrt_rtx", reason="CI installs tensorrt-rtx (test extra)")


def dynamic_conv_onnx(path: Path) -> None:
    """A 3->4 channel 3x3 conv with a dynamic batch and spatial size."""
    import numpy as np

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype("float32"), "w")
    node = helper.make_node("Conv", ["images", "w"], ["out"], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [node],
        "dyn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, "H", "W"])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_two_profiles_from_config_are_built_and_recorded(tmp_path: Path) -> None:
    dynamic_conv_onnx(tmp_path / "dyn.onnx")
    small = {"min": [1, 3, 160, 160], "opt": [2, 3, 320, 320], "max": [4, 3, 320, 320]}
    large = {"min": [1, 3, 320, 320], "opt": [4, 3, 640, 640], "max": [8, 3, 640, 640]}
    cfg = parse_config(
        {
            "engine_dir": str(tmp_path / "engines"),
            "models": {
                "dyn": {
                    "onnx": str(tmp_path / "dyn.onnx"),
                    "backend": "tensorrt_rtx",
                    "precision": "fp32",
                    "profiles": [{"images": small}, {"images": large}],
                }
            },
            "cameras": {},
        }
    )
    ctx = ModelContext.from_config(cfg, "dyn")
    settings = ctx.build_settings()
    api = import_trt("tensorrt_rtx")
    fp = probe_fingerprint(api)
    store = EngineStore(cfg.engine_dir)
    result = build(store, "dyn", settings, fingerprint=fp, api=api)
    assert result.built
    manifest = json.loads(store.manifest_path("dyn", result.key).read_text())
    # The profile set once per execution context (models.M.streams, default 2).
    assert manifest["build"]["profiles"] == [{"images": small}, {"images": large}] * 2
    assert check(store, "dyn", settings, fp).ok
    # Another profile set is another engine: the check says why.
    one_profile = ctx.cfg.model_copy(update={"profiles": ctx.cfg.profiles[:1]})
    changed = ModelContext("dyn", one_profile, ctx.engine_dir, ctx.score_threshold).build_settings()
    verdict = check(store, "dyn", changed, fp)
    assert verdict.status == "rebuild" and any("profile" in r for r in verdict.reasons), verdict.reasons
