"""Issue 27: a model is resolved once when the agent opens it: its labels are read once, whether its outputs
are decoded on the host or grafted into the graph (the engine manager reuses the daemon's resolution)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

import agent.lifecycle.model as model_module
from agent.cli import demo_config
from agent.cli.daemon import local_device


@pytest.mark.parametrize("postprocess", ["host", "graph"])
def test_an_agent_reads_each_model_s_labels_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, postprocess: str
) -> None:
    reads: Counter[str] = Counter()
    real = model_module.model_labels

    def counted(name: str, mcfg: object) -> tuple[str, ...]:
        reads[name] += 1
        return real(name, mcfg)  # type: ignore[arg-type]

    monkeypatch.setattr(model_module, "model_labels", counted)
    cfg = demo_config()
    model = cfg.models["nanodet"].model_copy(update={"postprocess": postprocess})
    cfg = cfg.model_copy(
        update={
            "engine_dir": tmp_path / "engines",
            "models": {"nanodet": model},
            "mqtt": cfg.mqtt.model_copy(update={"enabled": False}),
            "console": False,
        }
    )
    agent = local_device(cfg, console=False)
    try:
        agent.start()
        deadline = time.monotonic() + 60
        while agent.runtime.results_out.get("nanodet", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.runtime.results_out.get("nanodet", 0) >= 2, "no results"
    finally:
        agent.stop()
    assert reads == {"nanodet": 1}, reads
