"""Pipeline shards without processes: placement (by load, kept across reloads, pins, `auto`), the config keys
and their errors, the reload plan, `bench --shards` (split, merge, options), the stage window a shard hands
to the supervisor, and the engine manager of a shard handing rebuilds to the supervisor."""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

import numpy as np
import pytest

from agent.bench.args import add_arguments, options_from_args
from agent.bench.load import RunSpec
from agent.bench.shards import merge, split
from agent.config import AgentConfig, ConfigError, parse_config
from agent.config.reload import plan_reload
from agent.lifecycle.manager import EngineManager
from agent.lifecycle.roles import ShardRole
from agent.shards.placement import DEFAULT_FPS, LOAD_PER_SHARD, camera_load, place, shard_count
from agent.telemetry import StageWindow


def cfg_of(cameras: dict[str, dict[str, Any]], **pipeline: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "models": {"m": {"onnx": "m.onnx"}},
        "cameras": {name: {"url": f"rtsp://h/{name}", "model": "m", **c} for name, c in cameras.items()},
    }
    if pipeline:
        data["pipeline"] = pipeline
    return parse_config(data)


def shards_of(plan_cameras: dict[str, int], count: int) -> list[list[str]]:
    return [sorted(c for c, k in plan_cameras.items() if k == s) for s in range(count)]


# ---- placement ----------------------------------------------------------------------------------------
def test_camera_load_is_fps_scaled_by_frame_size() -> None:
    cfg = cfg_of(
        {
            "plain": {},
            "limited": {"fps": 10},
            "uhd": {"fps": 10, "frame_size": {"w": 3840, "h": 2160}},
            "small": {"frame_size": {"w": 960, "h": 540}},
        }
    )
    assert camera_load(cfg.cameras["plain"]) == DEFAULT_FPS
    assert camera_load(cfg.cameras["limited"]) == 10
    assert camera_load(cfg.cameras["uhd"]) == pytest.approx(40)
    assert camera_load(cfg.cameras["small"]) == pytest.approx(DEFAULT_FPS / 4)


def test_place_balances_by_load_heaviest_first() -> None:
    cfg = cfg_of({"a": {"fps": 10}, "b": {"fps": 20}, "c": {"fps": 30}, "d": {"fps": 5}}, shards=2)
    plan = place(cfg)
    assert plan.count == 2
    # c (30) -> 0; b (20) -> 1; a (10) -> 1 (20 < 30); d (5) -> 0 on the tie (40 each: the lower shard).
    assert dict(plan.cameras) == {"a": 1, "b": 1, "c": 0, "d": 0}
    assert plan.of(0) == ["c", "d"] and plan.of(1) == ["a", "b"]
    assert plan.gpus == (None, None)
    assert plan.why == "pipeline.shards: 2"


def test_place_weighs_picture_size() -> None:
    # One 4K camera at 25 fps weighs as much as four 1080p ones: it gets a shard to itself.
    cams: dict[str, dict[str, Any]] = {f"hd{i}": {"fps": 25} for i in range(4)}
    cams["uhd"] = {"fps": 25, "frame_size": {"w": 3840, "h": 2160}}
    plan = place(cfg_of(cams, shards=2))
    assert shards_of(dict(plan.cameras), 2) == [["uhd"], ["hd0", "hd1", "hd2", "hd3"]]


def test_place_is_stable_for_equal_cameras() -> None:
    cfg = cfg_of({n: {"fps": 5} for n in ("c", "a", "b", "e", "d")}, shards=2)
    first = place(cfg)
    assert dict(first.cameras) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert place(cfg) == first


def test_reload_adding_cameras_does_not_move_running_ones() -> None:
    old = cfg_of({"a": {"fps": 10}, "b": {"fps": 10}, "c": {"fps": 10}}, shards=2)
    before = place(old)
    assert dict(before.cameras) == {"a": 0, "b": 1, "c": 0}
    # Heavy newcomers: a fresh placement would spread everything differently; the running ones stay put.
    new = cfg_of(
        {"a": {"fps": 10}, "b": {"fps": 10}, "c": {"fps": 10}, "big": {"fps": 50}, "x": {"fps": 1}},
        shards=2,
    )
    fresh = place(new)
    assert dict(fresh.cameras) != {**before.cameras, **{k: fresh.cameras[k] for k in ("big", "x")}}
    after = place(new, previous=before.cameras, count=before.count)
    assert {c: after.cameras[c] for c in before.cameras} == dict(before.cameras)
    # New ones on the least loaded shard, heaviest first: big -> 1 (10 < 20); x -> 0 (20 < 60).
    assert after.cameras["big"] == 1 and after.cameras["x"] == 0
    assert after.why == "2 shards (kept while running)"


def test_place_previous_out_of_range_or_removed_is_placed_afresh() -> None:
    cfg = cfg_of({"a": {"fps": 10}, "b": {"fps": 10}}, shards=2)
    plan = place(cfg, previous={"a": 7, "gone": 0, "b": 0}, count=2)
    assert dict(plan.cameras) == {"a": 1, "b": 0}


def test_pin_wins_over_previous_and_load() -> None:
    cfg = cfg_of({"a": {"fps": 10, "shard": 1}, "b": {"fps": 10, "shard": 1}, "c": {"fps": 10}}, shards=2)
    plan = place(cfg, previous={"a": 0, "b": 0, "c": 0})
    assert dict(plan.cameras) == {"a": 1, "b": 1, "c": 0}
    # Pinned cameras count for the load of their shard: a newcomer goes to the other one.
    plan = place(cfg_of({"a": {"fps": 10, "shard": 0}, "b": {"fps": 10}}, shards=2))
    assert dict(plan.cameras) == {"a": 0, "b": 1}


def test_place_refuses_a_pin_beyond_the_kept_count() -> None:
    cfg = cfg_of({"a": {"shard": 3}}, shards="auto")
    with pytest.raises(ValueError, match=r"cameras\.a\.shard: 3: not a shard \(0\.\.1\)"):
        place(cfg, count=2)


def test_count_is_kept_over_the_setting() -> None:
    cfg = cfg_of({n: {"fps": 5} for n in "abcdef"}, shards="auto")
    plan = place(cfg, count=3, cores=64)
    assert plan.count == 3 and len(plan.gpus) == 3
    assert shards_of(dict(plan.cameras), 3) == [["a", "d"], ["b", "e"], ["c", "f"]]
    assert plan.why == "3 shards (kept while running)"
    assert place(cfg_of({"a": {}}, shards=4), count=2).count == 2


def test_disabled_cameras_are_not_placed() -> None:
    cfg = cfg_of({"a": {"fps": 10}, "off": {"fps": 500, "enabled": False}, "b": {"fps": 10}}, shards=2)
    plan = place(cfg)
    assert dict(plan.cameras) == {"a": 0, "b": 1}
    # ... nor counted by `auto` (load or the cap by cameras).
    auto = cfg_of({"a": {"fps": 300}, "off": {"fps": 900, "enabled": False}}, shards="auto")
    assert shard_count(auto, cores=64)[0] == 1


def test_per_shard_gpu_cycles_over_the_list() -> None:
    cfg = cfg_of({n: {} for n in "abcde"}, shards=5, gpus=[3, 5])
    plan = place(cfg)
    assert plan.gpus == (3, 5, 3, 5, 3)
    assert place(cfg_of({"a": {}, "b": {}}, shards=2, gpus=[1])).gpus == (1, 1)


def test_shard_count_fixed() -> None:
    assert shard_count(cfg_of({"a": {}}, shards=3)) == (3, "pipeline.shards: 3")
    assert shard_count(cfg_of({"a": {}})) == (1, "pipeline.shards: 1")


def test_auto_by_load() -> None:
    # 10 cameras of 25 fps: 250 frames/s -> 1 shard; 40 of them: 1000 -> 3 (400 per shard).
    assert shard_count(cfg_of({f"c{i}": {} for i in range(10)}, shards="auto"), cores=64)[0] == 1
    n, why = shard_count(cfg_of({f"c{i}": {} for i in range(40)}, shards="auto"), cores=64)
    assert n == math.ceil(40 * DEFAULT_FPS / LOAD_PER_SHARD) == 3
    assert why == "pipeline.shards: auto -> 3 (40 cameras, 1000 frames/s expected, 400 per shard, 64 cores)"
    # Exactly 400 frames/s: one shard; a little more: two.
    assert shard_count(cfg_of({"a": {"fps": 200}, "b": {"fps": 200}}, shards="auto"), cores=64)[0] == 1
    assert shard_count(cfg_of({"a": {"fps": 200}, "b": {"fps": 201}}, shards="auto"), cores=64)[0] == 2
    # 4K pictures weigh four times.
    uhd = {"fps": 25, "frame_size": {"w": 3840, "h": 2160}}
    assert shard_count(cfg_of({f"c{i}": uhd for i in range(8)}, shards="auto"), cores=64)[0] == 2


def test_auto_capped_by_cores_and_cameras() -> None:
    heavy = cfg_of({f"c{i}": {"fps": 400} for i in range(8)}, shards="auto")  # 3200 frames/s: 8 by load
    assert shard_count(heavy, cores=64)[0] == 8
    assert shard_count(heavy, cores=16)[0] == 4  # cores / 4
    assert shard_count(heavy, cores=7)[0] == 1
    assert shard_count(heavy, cores=2)[0] == 1  # never 0
    few = cfg_of({"a": {"fps": 1000}, "b": {"fps": 1000}}, shards="auto")  # 5 by load, 2 cameras
    assert shard_count(few, cores=64)[0] == 2
    assert shard_count(cfg_of({}, shards="auto"), cores=64)[0] == 1  # no camera: one shard


def test_auto_at_least_the_pinned_shard() -> None:
    cfg = cfg_of({"a": {"shard": 3}, "b": {}}, shards="auto")
    assert shard_count(cfg, cores=4)[0] == 4  # cores and load say 1; the pin says shard 3 exists
    plan = place(cfg, cores=4)
    assert plan.count == 4 and plan.cameras["a"] == 3 and plan.cameras["b"] == 0


def test_auto_rounds_to_a_multiple_of_the_gpus() -> None:
    cams = {f"c{i}": {"fps": 100} for i in range(9)}  # 900 frames/s: 3 by load
    assert shard_count(cfg_of(cams, shards="auto"), cores=64)[0] == 3
    n, why = shard_count(cfg_of(cams, shards="auto", gpus=[0, 1]), cores=64)
    assert n == 4 and why.endswith("64 cores, 2 GPUs)")
    # At least one per GPU, even when the load says one.
    light = {f"c{i}": {"fps": 5} for i in range(4)}
    assert shard_count(cfg_of(light, shards="auto", gpus=[0, 1, 2]), cores=64)[0] == 3
    plan = place(cfg_of(light, shards="auto", gpus=[0, 1, 2]), cores=64)
    assert plan.gpus == (0, 1, 2)
    # ... but never more shards than cameras: one camera, two GPUs -> one shard.
    assert shard_count(cfg_of({"a": {}}, shards="auto", gpus=[0, 1]), cores=64)[0] == 1
    # One GPU listed: no rounding.
    assert shard_count(cfg_of(cams, shards="auto", gpus=[1]), cores=64)[0] == 3


def test_auto_rounding_stays_within_the_cameras_and_over_the_pins() -> None:
    # 3 heavy cameras, 2 GPUs: 3 by load; rounding up would make a fourth shard without a camera.
    heavy = {f"c{i}": {"fps": 400} for i in range(3)}
    n, _ = shard_count(cfg_of(heavy, shards="auto", gpus=[0, 1]), cores=64)
    assert n == 3
    plan = place(cfg_of(heavy, shards="auto", gpus=[0, 1]), cores=64)
    assert all(plan.of(k) for k in range(plan.count))
    # A pin on shard 2 with 2 GPUs: at least 3 shards, rounded to 4 (the same number on each GPU).
    pinned = {**{f"c{i}": {"fps": 5} for i in range(5)}, "p": {"fps": 5, "shard": 2}}
    assert shard_count(cfg_of(pinned, shards="auto", gpus=[0, 1]), cores=64)[0] == 4


# ---- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 65, -1, "3", True, False, "many", 2.0, None])
def test_pipeline_shards_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.shards: must be 'auto' or an integer 1\.\.64"):
        cfg_of({"a": {}}, shards=value)


@pytest.mark.parametrize("value", [1, 2, 64, "auto"])
def test_pipeline_shards_accepted(value: Any) -> None:
    assert cfg_of({"a": {}}, shards=value).pipeline.shards == value


def test_pipeline_defaults() -> None:
    cfg = cfg_of({"a": {}})
    assert cfg.pipeline.shards == 1 and cfg.pipeline.gpus is None
    assert (cfg.pipeline.restart.min_s, cfg.pipeline.restart.max_s) == (1.0, 30.0)
    assert place(cfg).count == 1


@pytest.mark.parametrize(
    ("gpus", "error"),
    [
        ([], "must list at least one GPU index"),
        ([-1], "GPU indices must be >= 0 and distinct, got \\[-1\\]"),
        ([0, 0], "GPU indices must be >= 0 and distinct, got \\[0, 0\\]"),
        ([0, "x"], "must be an integer"),
    ],
)
def test_pipeline_gpus_refused(gpus: list[Any], error: str) -> None:
    with pytest.raises(ConfigError, match=rf"pipeline\.gpus(\.1)?: {error}"):
        cfg_of({"a": {}}, shards=2, gpus=gpus)


def test_camera_shard_beyond_the_shards_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"cameras\.b\.shard: 2 is not a shard \(pipeline\.shards is 2: 0\.\.1\)"
    ):
        cfg_of({"a": {"shard": 1}, "b": {"shard": 2}}, shards=2)
    with pytest.raises(ConfigError, match=r"cameras\.a\.shard: 1 is not a shard"):
        cfg_of({"a": {"shard": 1}})  # the default: one shard
    with pytest.raises(ConfigError, match=r"cameras\.a\.shard: must be <= 63"):
        cfg_of({"a": {"shard": 64}}, shards="auto")
    with pytest.raises(ConfigError, match=r"cameras\.a\.shard: must be >= 0"):
        cfg_of({"a": {"shard": -1}}, shards=2)
    assert cfg_of({"a": {"shard": 5}}, shards="auto").cameras["a"].shard == 5  # auto: at least 6


def test_restart_backoff_order() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.restart: min_s 5 is above max_s 2"):
        cfg_of({"a": {}}, shards=2, restart={"min_s": 5, "max_s": 2})
    with pytest.raises(ConfigError, match=r"pipeline\.restart\.min_s: must be > 0"):
        cfg_of({"a": {}}, shards=2, restart={"min_s": 0})
    ok = cfg_of({"a": {}}, shards=2, restart={"min_s": 2, "max_s": 2})
    assert ok.pipeline.restart.min_s == ok.pipeline.restart.max_s == 2


def test_unknown_pipeline_key_refused() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.shard"):
        cfg_of({"a": {}}, shard=2)


# ---- reload ------------------------------------------------------------------------------------------
def test_pipeline_change_needs_a_restart() -> None:
    old = cfg_of({"a": {}, "b": {}}, shards=2)
    for new in (
        cfg_of({"a": {}, "b": {}}, shards=3),
        cfg_of({"a": {}, "b": {}}, shards="auto"),
        cfg_of({"a": {}, "b": {}}, shards=2, gpus=[0]),
        cfg_of({"a": {}, "b": {}}, shards=2, restart={"min_s": 2}),
    ):
        plan = plan_reload(old, new)
        assert plan.needs_restart == ["pipeline"], new.pipeline
        assert plan.empty  # nothing else changes in place
        assert "needs a restart (kept): pipeline" in plan.summary()
    same = plan_reload(old, cfg_of({"a": {}, "b": {}, "c": {}}, shards=2))
    assert same.needs_restart == [] and same.cameras_added == ["c"]


# ---- bench --shards ---------------------------------------------------------------------------------
def test_split() -> None:
    assert split(10, 3) == [4, 3, 3]
    assert split(9, 3) == [3, 3, 3]
    assert split(5, 1) == [5]
    assert split(2, 5) == [1, 1]  # no empty shard
    assert split(64, 4) == [16] * 4
    assert split(3, 0) == [3]
    for streams in range(1, 20):
        for shards in range(1, 8):
            parts = split(streams, shards)
            assert sum(parts) == streams and max(parts) - min(parts) <= 1 and min(parts) >= 1


def fake_run(
    streams: int, processed: float, offered: float, cpu: float, samples: list[float], **more: Any
) -> dict:
    return {
        "streams": streams,
        "seconds": 10.0,
        "offered_fps": offered,
        "processed_fps": processed,
        "processed_ratio": round(processed / offered, 4) if offered else None,
        "dropped_in_slot": 3,
        "dropped_stale": 1,
        "batches": 100,
        "latency_ms": {"p95": max(samples, default=None)},
        "cpu_ms_per_frame": 1.0,
        "cpu_percent": cpu,
        "samples_ms": samples,
        **more,
    }


def test_merge_sums_rates_and_takes_percentiles_over_every_frame() -> None:
    spec = RunSpec(streams=6, batch=4, fps=25.0, warmup_s=1.0, duration_s=10.0)
    a = fake_run(
        4,
        90.0,
        100.0,
        50.0,
        [10.0, 20.0],
        camera_fps={"min": 4.0, "max": 6.0},
        startup={"cameras": 4, "all_streaming_s": 1.5},
        engine_busy=0.4,
    )
    b = fake_run(
        2,
        45.0,
        50.0,
        25.0,
        [30.0, 40.0, 50.0],
        camera_fps={"min": 3.0, "max": 5.0},
        startup={"cameras": 2, "all_streaming_s": 2.5},
    )
    m = merge([a, b], spec, parent_cpu_s=0.5, gpus=[0, 1])
    assert m["streams"] == 6 and m["batch"] == 4 and m["seconds"] == 10.0
    assert m["processed_fps"] == 135.0 and m["offered_fps"] == 150.0
    assert m["nominal_fps"] == 150.0
    assert m["processed_ratio"] == pytest.approx(1350 / 1500)  # over all frames, not a mean of ratios
    assert m["dropped_in_slot"] == 6 and m["dropped_stale"] == 2
    assert m["batches"] == 200 and m["mean_batch"] == pytest.approx(6.75)
    # Percentiles of the five frames together (not a mean of each shard's p50s: 15 and 40).
    assert m["latency_ms"]["p50"] == 30.0 and m["latency_ms"]["n"] == 5 and m["latency_ms"]["mean"] == 30.0
    # CPU: 5 s + 2.5 s in the shards, 0.5 s in the parent, over 1350 frames in 10 s.
    assert m["cpu_ms_per_frame"] == pytest.approx(8000 / 1350, abs=1e-3)
    assert m["cpu_percent"] == 80.0 and m["cpu_parent_s"] == 0.5
    assert [s["gpu"] for s in m["shards"]] == [0, 1]
    assert [s["streams"] for s in m["shards"]] == [4, 2]
    assert m["shards"][0]["engine_busy"] == 0.4 and m["shards"][1]["engine_busy"] is None
    assert m["shards"][1]["age_p95_ms"] == 50.0
    assert m["camera_fps"] == {"min": 3.0, "max": 6.0}
    assert m["startup"] == {"cameras": 6, "all_streaming_s": 2.5}
    assert "samples_ms" not in a and "samples_ms" not in b  # taken by the merge


def test_merge_edge_cases() -> None:
    spec = RunSpec(streams=2, batch=1, fps=25.0, warmup_s=1.0, duration_s=10.0)
    a = fake_run(1, 10.0, 25.0, 10.0, [5.0], startup={"cameras": 1, "all_streaming_s": None})
    a["camera_fps"] = {"min": 1.0, "max": 1.0}
    b = fake_run(1, 10.0, 25.0, 10.0, [5.0])
    m = merge([a, b], spec, parent_cpu_s=0.0, gpus=None)
    assert m["startup"] == {"cameras": 1, "all_streaming_s": None}  # one shard never had all streaming
    assert [s["gpu"] for s in m["shards"]] == [None, None]
    idle = fake_run(1, 0.0, 0.0, 0.0, [])
    m = merge([idle], RunSpec(1, 1, 25.0, 1.0, 10.0), parent_cpu_s=0.0, gpus=None)
    assert m["processed_ratio"] is None and m["cpu_ms_per_frame"] is None and m["latency_ms"]["n"] == 0


def bench_options(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--shards", "0"], "--shards: expected an integer >= 1, got 0"),
        (["--shards", "-2"], "--shards"),
        (["--duration", "-1"], "--duration: expected a number > 0"),
        (["--duration", "0"], "--duration: expected a number > 0"),
        (["--duration", "nan"], "--duration: expected a number > 0, got nan"),
        (["--warmup", "nan"], "--warmup: expected a number >= 0"),
        (["--fps", "0"], "--fps 0 .* needs camera readers"),
        (["--fps", "nan"], "--fps: expected a number >= 0"),
        (["--shards", "2", "--gpus", "0,-1"], "--gpus: expected integers >= 0"),
        (["--shards", "2", "--gpus", "a"], "--gpus: expected comma-separated integers"),
        (["--shards", "2", "--flap", "1", "--decode"], "--flap compares cameras inside one process"),
    ],
)
def test_bench_options_refused(argv: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        bench_options(*argv)


def test_bench_options_shards_and_gpus() -> None:
    opts = bench_options("--shards", "4", "--gpus", "0,1")
    assert opts.shards == 4 and opts.gpus == [0, 1]
    assert bench_options().shards == 1 and bench_options().gpus is None
    assert bench_options("--gpus", "0").gpus == [0]
    unpaced = bench_options("--fps", "0", "--decode", "--shards", "2")
    assert unpaced.fps == 0 and unpaced.decode and unpaced.shards == 2
    assert bench_options("--fps", "0", "--rtsp", "rtsp://h/{i}").fps == 0


# ---- the stage window a shard hands over -------------------------------------------------------------
def test_stage_window_drain_starts_a_new_window() -> None:
    w = StageWindow(capacity=8)
    for ms in (1.0, 2.0, 3.0):
        w.add("infer", ms)
    w.add_many({"queue": 0.5, "publish": None})
    drained = w.drain()
    assert set(drained) == {"infer", "queue"}  # a stage without samples is not handed over
    samples, n = drained["infer"]
    assert n == 3 and samples.tolist() == [1.0, 2.0, 3.0]
    assert drained["queue"][1] == 1
    assert w.drain() == {}  # drained: the next window is empty
    assert w.summary()["infer"]["n"] == 0
    samples[0] = 99.0  # a copy: the window's ring is not shared
    w.add("infer", 4.0)
    assert w.drain()["infer"][0].tolist() == [4.0]


def test_stage_window_drain_past_capacity_keeps_the_count() -> None:
    w = StageWindow(capacity=4)
    for i in range(10):
        w.add("infer", float(i))
    samples, n = w.drain()["infer"]
    assert n == 10 and sorted(samples.tolist()) == [6.0, 7.0, 8.0, 9.0]  # the newest `capacity`


def test_stage_window_absorbs_every_shard() -> None:
    shard0, shard1 = StageWindow(capacity=16), StageWindow(capacity=16)
    for ms in (10.0, 20.0):
        shard0.add("infer", ms)
    for ms in (30.0, 40.0, 50.0):
        shard1.add("infer", ms)
    shard1.add("queue", 1.0)
    sup = StageWindow(capacity=32)
    sup.absorb(shard0.drain())
    sup.absorb(shard1.drain())
    s = sup.summary()
    assert s["infer"]["n"] == 5 and s["infer"]["p50"] == 30.0
    assert s["queue"]["n"] == 1
    assert sup.summary()["infer"]["n"] == 0  # the summary closed the supervisor's window


def test_stage_window_absorb_beyond_capacity_counts_all() -> None:
    shard = StageWindow(capacity=8)
    for i in range(20):
        shard.add("infer", float(i))
    sup = StageWindow(capacity=4)
    sup.add("infer", 100.0)
    sup.absorb(shard.drain())  # 8 samples (of 20) into a window of 4
    s = sup.summary()
    assert s["infer"]["n"] == 21
    assert s["infer"]["p50"] is not None and s["infer"]["p50"] < 100.0  # the newest samples won the ring
    sup.absorb({"infer": (np.array([1.0, 2.0]), 2)})
    assert sup.summary()["infer"]["n"] == 2


# ---- a shard's engine manager hands rebuilds to the supervisor ------------------------------------------
def test_engine_manager_delegates_rebuilds(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(
        {
            "engine_dir": str(tmp_path / "engines"),
            "models": {"det": {"onnx": "det.onnx", "backend": "tensorrt"}},
            "cameras": {"a": {"url": "rtsp://h/a", "model": "det"}},
        }
    )
    asked: list[tuple] = []
    answer = {"value": True}

    def delegate(name: str, force: bool, precision: str | None, reasons: list[str] | None) -> bool:
        asked.append((name, force, precision, reasons))
        return answer["value"]

    published: list[tuple] = []
    manager = EngineManager(
        cfg, lambda m, f: published.append((m, f)), lambda _m, _b: None, "test", role=ShardRole(delegate)
    )
    threads = set(threading.enumerate())
    assert manager.rebuild("det", force=True, precision="fp16", reasons=["plan refused"]) is True
    answer["value"] = False  # already under way at the supervisor
    assert manager.rebuild("det") is False
    assert asked == [("det", True, "fp16", ["plan refused"]), ("det", False, None, None)]
    assert not [t for t in threading.enumerate() if t not in threads and t.name.startswith("job-")]
    assert published == []  # no `building` state from the shard: the supervisor publishes it
    assert manager._store is None  # not even the engine store was opened
    assert not (tmp_path / "engines").exists()

    # Without a delegate the same call is the manager's own (here: a model it does not know).
    own = EngineManager(cfg, lambda m, f: None, lambda _m, _b: None, "test")
    with pytest.raises(KeyError):
        own.rebuild("det")
