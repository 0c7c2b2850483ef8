"""What a reload does, as the schema declares it (agent.config.impact): every key has a class, the planner
sorts each class where the daemon applies it, and README's table is the schema's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import pytest

from agent.config import AgentConfig, CameraConfig, parse_config
from agent.config.impact import Impact, changes, impact_table, keys, undeclared
from agent.config.reader import camera_reader, source_spec
from agent.config.reload import APPLIED, ReloadPlan, keep_until_restart, plan_reload
from agent.config.strict import StrictModel
from pipelines.sources import FrameSlot
from pipelines.sources.nvdec import NvdecStage

README = Path(__file__).resolve().parents[1] / "README.md"
SQUARE = [[0.1, 0.1], [0.9, 0.1], [0.9, 0.9], [0.1, 0.9]]


def test_every_config_key_has_a_reload_class() -> None:
    assert undeclared(AgentConfig, members=("cameras",)) == []


def test_a_key_without_a_class_is_found() -> None:
    class Inner(StrictModel):
        a: int = 1

    class Section(StrictModel):
        declared: Annotated[int, Impact.LIVE] = 0
        forgotten: int = 0
        nested: Inner = Inner()  # its keys are checked instead
        several: dict[str, Inner] = {}  # noqa: RUF012  (entries come and go: needs a class of its own)
        inherited: Annotated[dict[str, Inner], Impact.ANALYTICS] = {}  # noqa: RUF012

    assert undeclared(Section) == ["forgotten", "nested.a", "several", "several.*.a"]


def test_nested_keys_inherit_the_class_of_the_key_that_holds_them_unless_they_declare_their_own() -> None:
    found = {k.path: k.impact for k in keys(AgentConfig)}
    assert found["cameras.*.zones.*.inertia"] is Impact.ANALYTICS  # a new zone key needs no declaration
    assert found["models.*.engine.workspace_mb"] is Impact.MODEL
    assert found["pipeline.restart.min_s"] is Impact.AGENT
    assert found["telemetry.interval_s"] is Impact.LIVE and found["telemetry.prometheus_port"] is Impact.AGENT
    assert found["cameras.*.snapshot.quality"] is Impact.LIVE
    assert found["cameras"] is None  # the planner adds and removes cameras; each key of one declares


def test_every_declared_class_is_one_the_planner_applies_where_the_key_is() -> None:
    for key in keys(AgentConfig):
        if key.impact is None:
            continue
        top = key.path.split(".")[0]
        top = "cameras" if top == "camera_defaults" else top  # merged into the cameras, planned there
        assert key.impact in APPLIED[top if top in ("models", "cameras") else "agent"], key


def cfg(cam: dict | None = None, **top: object) -> AgentConfig:
    data = {
        "models": {"m": {"onnx": "m.onnx"}, "n": {"onnx": "n.onnx"}},
        "cameras": {"c": {"url": "rtsp://h/x", "model": "m", **(cam or {})}},
        **top,
    }
    return parse_config(data)


OLD = cfg()


def plan(cam: dict | None = None, **top: object) -> ReloadPlan:
    return plan_reload(OLD, cfg(cam, **top))


@pytest.mark.parametrize(
    "cam",
    [
        {"decoder": "cpu"},
        {"decoder_latency": "native"},
        {"url": "rtsp://h/y"},
        {"fps": 5},
        {"loop": False},
        {"read_timeout_s": 9},
        {"model": "n"},
    ],
)
def test_camera_keys_restart_the_camera(cam: dict) -> None:
    p = plan(cam)
    assert p.cameras_restarted == ["c"], p
    assert not (p.cameras_rerouted or p.cameras_analytics or p.cameras_live)
    assert p.summary() == "cameras restarted: c"
    assert {c.impact for c in p.changes} == {Impact.CAMERA}


def test_route_analytics_live_and_placement_keys_leave_the_reader_alone() -> None:
    p = plan({"classes": ["car"]})
    assert p.cameras_rerouted == ["c"] and not p.cameras_restarted and p.summary() == "camera settings: c"
    p = plan({"tracking": {"min_hits": 3}, "zones": {"z": {"polygon": SQUARE}}})
    assert p.cameras_analytics == ["c"] and not p.cameras_restarted and p.summary() == "camera analytics: c"
    p = plan({"snapshot": {"on_detection": True, "quality": 50}})
    assert p.cameras_live == ["c"] and not p.cameras_restarted and not p.cameras_rerouted
    assert p.summary() == "camera live settings: c" and not p.empty
    # A shard pin: the supervisor's placement moves the camera; nothing changes inside a process.
    p = plan({"shard": 0})
    assert p.empty and [c.impact for c in p.changes] == [Impact.PLACEMENT]
    # A change with a camera restart needs nothing else for that camera.
    p = plan({"decoder": "cpu", "snapshot": {"quality": 50}, "min_score": 0.6})
    assert p.cameras_restarted == ["c"] and not (p.cameras_live or p.cameras_rerouted)


def test_a_zone_key_change_is_declared_by_zones() -> None:
    old = cfg({"zones": {"z": {"polygon": SQUARE}}})
    new = cfg({"zones": {"z": {"polygon": SQUARE, "inertia": 5}}})
    [change] = changes(old.cameras["c"], new.cameras["c"], ("cameras", "c"))
    assert change.key == ("cameras", "c", "zones", "z", "inertia")
    assert change.name == "cameras.c.zones" and change.impact is Impact.ANALYTICS


def test_model_changes_reopen_the_model_and_restart_its_cameras() -> None:
    p = plan(models={"m": {"onnx": "m.onnx", "engine": {"workspace_mb": 64}}, "n": {"onnx": "n.onnx"}})
    assert p.models_changed == ["m"] and p.cameras_restarted == ["c"]
    assert [c.name for c in p.changes] == ["models.m"]


def test_connection_and_live_keys_of_the_agent() -> None:
    assert plan(mqtt={"port": 1884}).mqtt and plan(device_id="other").mqtt
    p = plan(log_level="debug", console=True, telemetry={"interval_s": 3}, homeassistant={"enabled": True})
    assert p.log_level and p.console and p.telemetry and not p.mqtt
    assert p.live == ["telemetry.interval_s", "homeassistant", "console", "log_level"]
    assert p.summary() == "log level changed; telemetry changed; homeassistant changed; console changed"


def test_agent_keys_need_a_restart_and_keep_their_old_values() -> None:
    telemetry = {"prometheus_port": 9999, "interval_s": 3}
    new = cfg(engine_dir="/elsewhere", telemetry=telemetry, pipeline={"shards": 2})
    p = plan_reload(OLD, new)
    assert p.needs_restart == ["engine_dir", "telemetry.prometheus_port", "pipeline"]
    kept_keys = "engine_dir, telemetry.prometheus_port, pipeline"
    assert p.summary() == f"telemetry changed; needs a restart (kept): {kept_keys}"
    kept = keep_until_restart(OLD, new, p)
    assert kept.engine_dir == OLD.engine_dir and kept.pipeline == OLD.pipeline
    assert kept.telemetry.prometheus_port is None and kept.telemetry.interval_s == 3  # the live key is new
    assert plan_reload(OLD, kept).needs_restart == []
    assert keep_until_restart(OLD, new, plan_reload(OLD, OLD)) is new


def test_the_readme_table_is_the_schemas() -> None:
    text = README.read_text()
    found = re.search(r"<!-- reload-impact -->\n(.*?)\n<!-- /reload-impact -->", text, re.S)
    assert found is not None, "README lost its reload table markers"
    assert found.group(1) == impact_table(AgentConfig), (
        "README's reload table differs from the schema; write in the output of "
        "python -c 'from agent.config import AgentConfig; from agent.config.impact import impact_table; "
        "print(impact_table(AgentConfig))'"
    )


def test_source_spec_and_reader_keep_every_camera_key() -> None:
    cam = CameraConfig.model_validate(
        {
            "url": "rtsp://h/x",
            "model": "m",
            "fps": 7,
            "loop": False,
            "open_timeout_s": 3,
            "read_timeout_s": 4,
            "decoder": "nvdec",
            "decoder_latency": "native",
        }
    )
    spec = source_spec("gate", cam)
    assert (spec.camera, spec.url, spec.fps, spec.loop) == ("gate", "rtsp://h/x", 7, False)
    assert (spec.open_timeout_s, spec.read_timeout_s) == (3, 4)
    reader = camera_reader(spec, cam, FrameSlot(), None)  # not started: nothing opens
    assert reader.mode == "nvdec" and isinstance(reader.stage, NvdecStage)
    assert reader.stage.latency == "native"
    assert reader.spec is spec
