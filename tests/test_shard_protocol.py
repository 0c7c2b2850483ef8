"""The shard pipe's typed protocol (agent.shards.protocol): every message type either way has exactly one
handler on the side that reads it, and every message survives the pipe (pickled) unchanged."""

from __future__ import annotations

import multiprocessing as mp
import threading
import typing
from types import SimpleNamespace

from agent.config import RestartConfig, parse_config
from agent.runtime.reports import CameraState
from agent.service.supervisor import ModelProgress, Progress
from agent.shards import protocol
from agent.shards.child import _Requests
from agent.shards.host import ShardHost
from agent.shards.sharded import ShardedRuntime


def members(union: object) -> set[type]:
    return set(typing.get_args(union))


def config() -> object:
    cam = {"url": "rtsp://cam/1", "model": "m"}
    models = {"m": {"onnx": "/m.onnx", "format": "nanodet", "labels": "/l", "backend": "onnxruntime"}}
    return parse_config({"device_id": "p", "models": models, "cameras": {"a": cam, "b": cam}}, "<test>")


def test_every_message_from_a_shard_has_one_handler_at_the_supervisor() -> None:
    host = ShardHost(0, None, None, "info", SimpleNamespace(), RestartConfig())  # type: ignore[arg-type]
    runtime = ShardedRuntime(config(), plan=None)  # type: ignore[arg-type]
    own, forwarded = set(host.own_messages()), set(runtime._on_message)
    assert not own & forwarded
    assert own | forwarded == members(protocol.Up)


def test_every_request_to_a_shard_has_one_handler_in_the_shard() -> None:
    requests = _Requests(SimpleNamespace(), SimpleNamespace(), threading.Event())
    # Assign comes first and once (main()), Stop ends the serve loop: neither is a request.
    assert set(requests.table) | {protocol.Assign, protocol.Stop} == members(protocol.Down)


def test_messages_cross_the_pipe_unchanged() -> None:
    progress = Progress({"a": "streaming"}, {"m": ModelProgress(10, 9, True, "onnxruntime fp32", 1)}, 5.0)
    state = CameraState("streaming", 5.0, 4.9, 1, 2, None, "cpu", "no NVDEC here")
    msgs = [
        protocol.Assign(1, config(), "info", 2**32 + 1),  # type: ignore[arg-type]
        protocol.Stop(),
        protocol.Snapshot(3, "a"),
        protocol.Tap(4, "m", 8, 0.5, 30.0),
        protocol.Started(123),
        protocol.Failed("models.m.onnx: not found"),
        protocol.CameraChanged("a", state),
        protocol.ProgressReport(progress),
        protocol.TelemetryReport({"cameras": {}}, {"infer": [1.0]}),
        protocol.EngineState("m", {"state": "ready"}),
        protocol.RebuildAsked("m", True, "fp16", ["plan refused"]),
        protocol.TrackEvent("a", {"type": "new", "track_id": 1}),
        protocol.RegionState("p/d/cameras/a/zones/z", b'{"count": 0}'),
        protocol.Answer(3, True, {"camera": "a", "bytes": 10}),
    ]
    parent, child = mp.Pipe()
    for msg in msgs:
        parent.send(msg)
        assert child.recv() == msg
