"""The typed forms of engine state at their edges: the MQTT payload, the manifest on disk, the job pipe.

Each keeps the bytes it had as a dict: the retained engine state's keys in the order first set, a
manifest written back as it was read (older ones lack the optional build fields), events on the pipe.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from agent.lifecycle.state import EngineState, payload_of
from engines.buildproc import Progress, Result, event_from_wire, failure
from engines.manifest import BuildInfo, Manifest, manifest_from_dict
from engines.precision import REQUESTABLE, parse_precision

OLD_BUILD = {  # a manifest of a build before the profiling issue: no optional fields, one unknown key
    "onnx_sha256": "ab" * 32,
    "precision": "fp16",
    "profiles": [{"images": {"min": [1, 3, 8, 8], "opt": [1, 3, 8, 8], "max": [1, 3, 8, 8]}}],
    "workspace_bytes": None,
    "optimization_level": 3,
    "calibration": None,
    "timing_cache": None,
    "built_at": "2026-01-01T00:00:00.000+00:00",
    "build_s": 1.5,
    "agent_version": "0.0.9",
    "plan_sha256": "cd" * 32,
    "from_the_future": {"x": 1},
}
FINGERPRINT = {
    "trt_flavor": "tensorrt_rtx",
    "trt_version": "1.7",
    "gpu_name": None,
    "compute_capability": "8.6",
    "cuda_driver": None,
    "cuda_runtime": None,
    "l4t": None,
    "dla_core": None,
    "platform": "linux-x86_64",
}


def test_engine_state_payload_keeps_keys_in_the_order_first_set() -> None:
    s = EngineState()
    s.update(state="checking", backend="onnxruntime")
    s.update(fingerprint={"gpu_name": None})
    s.update(state="building", progress=Progress("build", 1, 2), error=None)
    s.update(state="ready", progress=None, key="k")
    assert list(s.to_payload()) == ["state", "backend", "fingerprint", "progress", "error", "key"]
    assert s.to_payload()["state"] == "ready" and s.to_payload()["progress"] is None
    s.update(progress=Progress("build", 2, 2))
    assert s.to_payload()["progress"] == {"phase": "build", "step": 2, "total": 2}
    assert "load_error" not in s.to_payload()  # never set: never published
    with pytest.raises(TypeError, match="no field 'bogus'"):
        s.update(bogus=1)
    assert payload_of(state="ready", reasons=[]) == {"state": "ready", "reasons": []}


def test_an_old_manifest_loads_typed_and_is_written_back_as_read() -> None:
    data = {"schema": "edge-agent/engine-manifest/1", "fingerprint": FINGERPRINT, "build": OLD_BUILD}
    m = manifest_from_dict(json.loads(json.dumps(data)))
    assert m.build.plan_sha256 == "cd" * 32 and m.build.precision == "fp16" and m.build.layers is None
    assert "layers" not in m.build.to_dict()
    assert json.dumps(m.to_dict()["build"]) == json.dumps(OLD_BUILD)  # same keys, same order
    # A record set later is written after the keys read; cleared, it is absent again.
    marked = replace(m.build, refused_at_load={"error": "x"})
    assert list(marked.to_dict()) == [*OLD_BUILD, "refused_at_load"]
    assert marked.without("refused_at_load").to_dict() == OLD_BUILD
    built = Manifest(FINGERPRINT, BuildInfo.from_dict({**OLD_BUILD, "refused_at_load": {"error": "x"}}))
    assert built.build.refused_at_load == {"error": "x"}
    assert built.build.without("refused_at_load").to_dict() == OLD_BUILD


def test_job_events_cross_the_pipe_and_back() -> None:
    p = Progress("accuracy gate fp16: candidate", 3, 20)
    assert event_from_wire(json.loads(json.dumps(p.to_wire()))) == p
    r = failure("child died", "Crashed")
    back = event_from_wire(json.loads(json.dumps(r.to_wire())))
    assert isinstance(back, Result) and not back.ok and back.error == "child died"
    assert back.fields["error_type"] == "Crashed"
    assert event_from_wire({"event": "other"}) is None and event_from_wire([1]) is None


def test_precision_is_parsed_once_where_it_enters() -> None:
    assert REQUESTABLE == ("fp32", "fp16", "int8", "best")
    assert parse_precision("best") == "best"
    with pytest.raises(ValueError, match="--precision: 'fp8' is not one of fp32, fp16, int8, best"):
        parse_precision("fp8", "--precision")
