"""Config of tracking, zones, lines, events and publish (agent.config): strict, every error naming the file
and the key path; zone and line labels against the model's labels (agent.preflight)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import ConfigError, load_config, parse_config
from agent.preflight import preflight

ASSETS = Path(__file__).resolve().parents[1] / "agent" / "assets"
BASE: dict[str, Any] = {
    "models": {"d": {"onnx": "/m.onnx"}},
    "cameras": {"gate": {"url": "rtsp://viewer:secret@10.0.0.2/s", "model": "d"}},
}
SQUARE = [[0.1, 0.1], [0.9, 0.1], [0.9, 0.9], [0.1, 0.9]]


def cfg(**camera: Any) -> Any:
    data = copy.deepcopy(BASE)
    data["cameras"]["gate"].update(camera)
    return parse_config(data, "agent.yaml")


def test_defaults() -> None:
    cam = cfg().cameras["gate"]
    assert cam.tracking.enabled and cam.tracking.low_score == 0.15 and cam.tracking.new_track_score is None
    assert cam.tracking.min_hits == 2 and cam.tracking.max_lost_s == 1.5 and cam.tracking.reset_gap_s == 2.0
    assert cam.zones == {} and cam.lines == {} and cam.frame_size is None
    assert cam.events.enabled and cam.events.objects == "all" and not cam.events.snapshot.enabled
    assert cam.publish.detections == "every_frame"


def test_a_full_camera() -> None:
    cam = cfg(
        zones={
            "drive": {"polygon": [*SQUARE, SQUARE[0]], "labels": ["car"], "anchor": "center", "inertia": 3},
            "door": {"polygon": [[0, 0], [640, 0], [640, 100]], "units": "pixels"},
        },
        lines={"gate": {"points": [[0.2, 0.5], [0.8, 0.5]], "labels": ["person"]}},
        frame_size={"w": 640, "h": 480},
        classes=["person", "car"],
        events={"objects": "in_zones", "snapshot": {"enabled": True}},
        publish={"detections": "on_change"},
    ).cameras["gate"]
    assert len(cam.zones["drive"].polygon) == 4  # the closing repeat of the first point is dropped
    assert (cam.zones["drive"].inertia, cam.zones["drive"].inertia_s) == (3, 0.1)  # tools/track_eval.py
    assert (cam.zones["door"].inertia, cam.zones["door"].inertia_s) == (1, 0.1)
    assert cam.zones["door"].units == "pixels" and cam.lines["gate"].labels == ["person"]


@pytest.mark.parametrize(
    ("camera", "error"),
    [
        (
            {"zones": {"z": {"polygon": [[0, 0], [1, 1], [1, 0], [0, 1]]}}},
            r"agent\.yaml: cameras\.gate\.zones\.z\.polygon: edges 1 \(\[0, 0\]-\[1, 1\]\) and 3 .* cross",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [1, 0]]}}},
            r"cameras\.gate\.zones\.z\.polygon: a zone needs at least 3",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [0.5, 0], [1, 0]]}}},
            r"zones\.z\.polygon: the polygon has no area",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [100, 0], [100, 100]]}}},
            r"gate\.zones\.z\.polygon: point 2 \[100, 0\] is outside the picture \(normalized .* pixels",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [100, 0], [100, 100]], "units": "pixels"}}},
            r"cameras\.gate\.zones\.z\.units: pixels needs cameras\.gate\.frame_size",
        ),
        (
            {
                "zones": {"z": {"polygon": [[0, 0], [700, 0], [100, 100]], "units": "pixels"}},
                "frame_size": {"w": 640, "h": 480},
            },
            r"cameras\.gate\.zones\.z\.polygon: point 2 \[700, 0\] is outside the 640x480 picture",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [1, 0], [0.5, "top"]]}}},
            r"zones\.z\.polygon\.2\.1: must be a number",
        ),
        (
            {"zones": {"z": {"polygon": [[0, 0], [1, 0], [0.5, float("nan")]]}}},
            r"polygon\.2\.1: must be a finite number",
        ),
        (
            {"zones": {"z": {"polygon": SQUARE, "labels": ["dog"]}}, "classes": ["person"]},
            r"zones\.z\.labels: 'dog' is not in cameras\.gate\.classes",
        ),
        (
            {"zones": {"z": {"polygon": SQUARE, "labels": []}}},
            r"zones\.z\.labels: labels must be a non-empty list",
        ),
        (
            {"zones": {"z": {"polygon": SQUARE, "labels": ["car", "car"]}}},
            r"zones\.z\.labels: labels must be unique",
        ),
        (
            {"zones": {"z": {"polygon": SQUARE, "anchor": "feet"}}},
            r"zones\.z\.anchor: must be one of 'bottom_center'",
        ),
        ({"zones": {"z": {"polygon": SQUARE, "inertia": 0}}}, r"zones\.z\.inertia: must be >= 1"),
        ({"zones": {"z": {"polygon": SQUARE, "colour": "red"}}}, r"zones\.z\.colour: unknown key"),
        ({"zones": {"a/b": {"polygon": SQUARE}}}, r"cameras\.gate\.zones\.a/b: name may only hold"),
        (
            {"lines": {"l": {"points": [[0.5, 0.5], [0.5, 0.5]]}}},
            r"cameras\.gate\.lines\.l\.points: degenerate",
        ),
        (
            {"lines": {"l": {"points": [[0, 0], [1, 1], [0, 1]]}}},
            r"lines\.l\.points: a line is exactly 2 points",
        ),
        (
            {"lines": {"l": {"points": [[0, 0], [1.5, 1]]}}},
            r"cameras\.gate\.lines\.l\.points: point 2 \[1\.5, 1\] is outside",
        ),
        (
            {"lines": {"l": {"points": [[0, 0], [1, 1]]}}, "tracking": {"enabled": False}},
            r"cameras\.gate\.lines: need tracking",
        ),
        (
            {"tracking": {"low_score": 0.5}},
            r"cameras\.gate\.tracking\.low_score: 0\.5 is above min_score 0\.4",
        ),
        (
            {"tracking": {"new_track_score": 0.3}},
            r"cameras\.gate\.tracking\.new_track_score: 0\.3 is below min_score",
        ),
        ({"tracking": {"max_lost_s": 0}}, r"cameras\.gate\.tracking\.max_lost_s: must be > 0"),
        ({"events": {"objects": "in_zones"}}, r"cameras\.gate\.events\.objects: in_zones needs zones"),
        ({"events": {"update_interval_s": 0}}, r"cameras\.gate\.events\.update_interval_s: must be >= 0\.1"),
        ({"publish": {"detections": "sometimes"}}, r"cameras\.gate\.publish\.detections: must be one of"),
        ({"frame_size": {"w": 0, "h": 10}}, r"cameras\.gate\.frame_size\.w: must be >= 1"),
    ],
)
def test_errors_name_the_file_and_the_key(camera: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error) as info:
        cfg(**camera)
    assert "secret" not in str(info.value)


def test_a_low_min_score_takes_the_default_low_score_down() -> None:
    from agent.events import analytics_settings, track_floor

    cam = cfg(min_score=0.1).cameras["gate"]  # below the default low_score (0.15): no error
    assert track_floor(cam) == 0.1
    params = analytics_settings("gate", cam, ["person"], "labels").tracker
    assert params.low_score == params.high_score == 0.1


def test_a_slow_camera_keeps_its_tracks_between_frames() -> None:
    from agent.events import analytics_settings

    slow = analytics_settings("gate", cfg(fps=0.5).cameras["gate"], ["person"], "labels")
    assert slow.reset_gap_s == 7.0 and slow.tracker.max_lost_s == 5.0  # 3.5 and 2.5 frame periods
    fast = analytics_settings("gate", cfg(fps=25).cameras["gate"], ["person"], "labels")
    assert fast.reset_gap_s == 2.0 and fast.tracker.max_lost_s == 1.5  # the configured ones


def test_yaml_off_is_off(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "models: {d: {onnx: /m.onnx}}\ncameras:\n  gate:\n    url: /v.mp4\n    model: d\n"
        "    publish: {detections: off}\n"
    )
    assert load_config(path).cameras["gate"].publish.detections == "off"
    with pytest.raises(ConfigError, match=r"publish\.detections: must be one of"):
        cfg(publish={"detections": True})


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["cameras"]["gate"]["zones"] = {"z": {"polygon": [[0, 0], [1, 1], [1, 0], [0, 1]]}}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"^{path}: cameras\.gate\.zones\.z\.polygon: edges 1"):
        load_config(path)


def test_preflight_checks_zone_and_line_labels_against_the_model() -> None:
    data = {
        "models": {
            "d": {
                "onnx": str(ASSETS / "nanodet-m-416.onnx"),
                "format": "nanodet",
                "labels": str(ASSETS / "coco.names"),
            }
        },
        "cameras": {
            "gate": {
                "url": str(ASSETS / "bikes.mp4"),
                "model": "d",
                "zones": {"z": {"polygon": SQUARE, "labels": ["person", "unicorn"]}},
                "lines": {"l": {"points": [[0, 0], [1, 1]], "labels": ["dragon"]}},
            }
        },
    }
    problems = preflight(parse_config(data, "agent.yaml"), "agent.yaml")
    assert problems == [
        f"agent.yaml: cameras.gate.zones.z.labels: unknown label 'unicorn' (labels: {ASSETS / 'coco.names'})",
        f"agent.yaml: cameras.gate.lines.l.labels: unknown label 'dragon' (labels: {ASSETS / 'coco.names'})",
    ]


def test_reload_plan_changes_analytics_in_place() -> None:
    from agent.config.reload import plan_reload

    old = cfg(zones={"z": {"polygon": SQUARE}})
    for change in (
        {"zones": {}},
        {"zones": {"z": {"polygon": SQUARE, "inertia": 3}}},
        {"lines": {"l": {"points": [[0, 0], [1, 1]]}}, "zones": {"z": {"polygon": SQUARE}}},
        {"tracking": {"max_lost_s": 3}, "zones": {"z": {"polygon": SQUARE}}},
        {"publish": {"detections": "off"}, "zones": {"z": {"polygon": SQUARE}}},
        {"events": {"objects": "none"}, "zones": {"z": {"polygon": SQUARE}}},
    ):
        plan = plan_reload(old, cfg(**change))
        assert plan.cameras_analytics == ["gate"] and not plan.cameras_restarted, change
        assert "camera analytics: gate" in plan.summary()
    both = plan_reload(old, cfg(min_score=0.5, zones={}))
    assert both.cameras_rerouted == ["gate"] and both.cameras_analytics == ["gate"]
    assert plan_reload(old, cfg(zones={"z": {"polygon": SQUARE}})).empty
