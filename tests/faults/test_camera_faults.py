"""Camera faults on real GStreamer RTSP servers (tools/rtsp_server.py): a server frozen with SIGSTOP (socket
open, nothing answers: a hung camera), killed with SIGKILL (a crash or power loss), and cameras that fail
for different reasons, whose `last_error` must say which.

Each camera has its own server process, so one can be broken while the other must keep publishing.
Bounds come from the camera's timeouts and the reader's reconnect backoff (full jitter, ceiling doubling
from 0.5 s up to 30 s: pipelines/sources/spec.py), plus slack for a loaded 2-core CI box.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_agent import AgentProcess, wait
from fixtures_mqtt import Broker, free_port
from fixtures_rtsp import RtspServer

from faults.harness import (
    LiveSubscriber,
    assert_clean_log,
    auth_rtsp_server,
    bodies,
    camera_states,
    config_dict,
    detections,
    first_time,
    is_state,
    last_state,
    write_config,
)

pytestmark = pytest.mark.slow

DEVICE = "faults-cam"
BASE = f"edge-agent/{DEVICE}"
READ_TIMEOUT_S = 1.0
OPEN_TIMEOUT_S = 2.0
BACKOFF_MAX_S = 30.0  # the reader's backoff ceiling (SourceSpec.backoff_max_s)
SLACK_S = 10.0
# Back to streaming after the camera is: at worst one attempt in progress (open timeout, then the cause
# probe, bounded by the open timeout too), the longest backoff wait, one more open.
RECOVERY_BOUND_S = 3 * OPEN_TIMEOUT_S + BACKOFF_MAX_S + SLACK_S


def camera(url: str) -> dict:
    return {"url": url, "read_timeout_s": READ_TIMEOUT_S, "open_timeout_s": OPEN_TIMEOUT_S}


def start_two(
    tmp_path: Path,
    broker: Broker,
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[..., AgentProcess],
) -> tuple[RtspServer, RtspServer, AgentProcess]:
    gate_server = make_rtsp_server(mounts=("/cam",))
    yard_server = make_rtsp_server(mounts=("/cam",))
    cams = {"gate": camera(gate_server.url()), "yard": camera(yard_server.url())}
    cfg = config_dict(tmp_path, broker.port, cams, device=DEVICE)
    return gate_server, yard_server, start_agent(write_config(tmp_path, cfg))


def streaming_and_detecting(msgs: list) -> bool:
    return all(last_state(msgs, c) == "streaming" and len(detections(msgs, c)) >= 2 for c in ("gate", "yard"))


def errors_of(msgs: list, cam: str) -> list[str]:
    return [
        s["last_error"] for s in camera_states(msgs, cam) if s["state"] == "reconnecting" and s["last_error"]
    ]


def test_rtsp_server_sigstop_then_sigcont(
    tmp_path: Path,
    mqtt_broker: Broker,
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        gate_server, _, agent = start_two(tmp_path, mqtt_broker, make_rtsp_server, start_agent)
        wait(sub, streaming_and_detecting, 60, agent, "both cameras streaming and detecting")

        gate_server.pause()  # SIGSTOP
        stopped = time.monotonic()
        mark = len(sub.timed())
        detect_bound = READ_TIMEOUT_S + 5.0
        wait(
            sub,
            lambda m: last_state(m[mark:], "gate") == "reconnecting",
            detect_bound + 5,
            agent,
            "gate reconnecting",
        )
        seen = first_time(sub.timed(), is_state("gate", "reconnecting"), after=stopped)
        assert seen is not None
        record_recovery("camera server SIGSTOP", seen - stopped, detect_bound, "hung camera -> reconnecting")
        assert seen - stopped <= detect_bound, f"hung camera noticed after {seen - stopped:.1f} s"
        first_error = errors_of(sub.snapshot()[mark:], "gate")[0]
        assert "no frame for" in first_error, first_error  # the stream stalled, named as such

        # While it stays frozen, reopen attempts hang too: the error says so, not "refused".
        msgs = wait(
            sub,
            lambda m: any(e != first_error for e in errors_of(m[mark:], "gate")),
            4 * OPEN_TIMEOUT_S + BACKOFF_MAX_S,
            agent,
            "an error from a reopen attempt on the frozen server",
        )
        reopen_error = next(e for e in errors_of(msgs[mark:], "gate") if e != first_error)
        assert "refused" not in reopen_error, reopen_error
        assert any(w in reopen_error for w in ("no answer", "timed out", "within")), reopen_error
        assert len(detections(msgs[mark:], "yard")) >= 5, "yard stopped publishing while gate hung"
        assert bodies(msgs, "/status")[-1]["state"] == "degraded"

        gate_server.resume()  # SIGCONT
        resumed = time.monotonic()
        mark = len(sub.timed())
        wait(
            sub,
            lambda m: last_state(m[mark:], "gate") == "streaming" and len(detections(m[mark:], "gate")) >= 2,
            RECOVERY_BOUND_S + 5,
            agent,
            "gate streaming again after SIGCONT",
        )
        back = first_time(sub.timed(), is_state("gate", "streaming"), after=resumed)
        assert back is not None
        record_recovery("camera server SIGSTOP", back - resumed, RECOVERY_BOUND_S, "SIGCONT -> streaming")
        assert back - resumed <= RECOVERY_BOUND_S
        msgs = wait(sub, lambda m: bodies(m, "/status")[-1]["state"] == "online", 10, agent, "online again")
        assert camera_states(msgs, "gate")[-1]["reconnects"] >= 1
        assert agent.proc.poll() is None
        assert_clean_log(agent)
    finally:
        sub.close()


def test_rtsp_server_sigkill_then_restart(
    tmp_path: Path,
    mqtt_broker: Broker,
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[..., AgentProcess],
    record_recovery: Callable[..., None],
) -> None:
    sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
    try:
        gate_server, _, agent = start_two(tmp_path, mqtt_broker, make_rtsp_server, start_agent)
        wait(sub, streaming_and_detecting, 60, agent, "both cameras streaming and detecting")

        gate_server.kill()  # SIGKILL
        killed = time.monotonic()
        mark = len(sub.timed())
        detect_bound = READ_TIMEOUT_S + 5.0
        wait(
            sub,
            lambda m: last_state(m[mark:], "gate") == "reconnecting",
            detect_bound + 5,
            agent,
            "gate reconnecting",
        )
        seen = first_time(sub.timed(), is_state("gate", "reconnecting"), after=killed)
        assert seen is not None
        record_recovery("camera server SIGKILL", seen - killed, detect_bound, "dead camera -> reconnecting")
        assert seen - killed <= detect_bound
        # Reopen attempts meet a closed port: named as refused.
        wait(
            sub,
            lambda m: any("refused" in e for e in errors_of(m[mark:], "gate")),
            15,
            agent,
            "last_error naming the refused connection",
        )
        time.sleep(max(0.0, 5.0 - (time.monotonic() - killed)))  # a 5 s outage
        assert len(detections(sub.snapshot()[mark:], "yard")) >= 5, (
            "yard stopped publishing while gate was down"
        )

        gate_server.restart()
        up = time.monotonic()
        mark = len(sub.timed())
        wait(
            sub,
            lambda m: last_state(m[mark:], "gate") == "streaming" and len(detections(m[mark:], "gate")) >= 2,
            RECOVERY_BOUND_S + 5,
            agent,
            "gate streaming again after the server restart",
        )
        back = first_time(sub.timed(), is_state("gate", "streaming"), after=up)
        assert back is not None
        record_recovery("camera server SIGKILL", back - up, RECOVERY_BOUND_S, "server READY -> streaming")
        assert back - up <= RECOVERY_BOUND_S
        wait(sub, lambda m: bodies(m, "/status")[-1]["state"] == "online", 10, agent, "online again")
        assert agent.proc.poll() is None
        assert_clean_log(agent)
    finally:
        sub.close()


def test_last_error_names_the_cause(
    tmp_path: Path,
    mqtt_broker: Broker,
    make_rtsp_server: Callable[..., RtspServer],
    start_agent: Callable[..., AgentProcess],
) -> None:
    secret, wrong = "s3cretPW", "wr0ngPW"
    server = make_rtsp_server(mounts=("/cam",))
    with auth_rtsp_server(tmp_path, "viewer", secret) as auth_url:
        host = auth_url.removeprefix("rtsp://")
        cams = {
            "refused": camera(f"rtsp://127.0.0.1:{free_port()}/cam"),  # nothing listens there
            "notfound": camera(server.url("/nope")),
            "badauth": camera(f"rtsp://viewer:{wrong}@{host}"),
            "noauth": camera(auth_url),
            # A file missing at start is refused before anything starts (preflight, naming the camera's
            # url: tests/test_config_strict.py); at run time only network causes remain to tell apart.
            "ok": camera(f"rtsp://viewer:{secret}@{host}"),
        }
        expected = {
            "refused": ("refused",),
            "notfound": ("404", "not found"),
            "badauth": ("401", "authentication failed"),
            "noauth": ("401", "authentication required"),
        }
        cfg = config_dict(tmp_path, mqtt_broker.port, cams, device=DEVICE)
        sub = LiveSubscriber(mqtt_broker.port, f"{BASE}/#")
        try:
            agent = start_agent(write_config(tmp_path, cfg))
            msgs = wait(
                sub,
                lambda m: last_state(m, "ok") == "streaming" and all(errors_of(m, c) for c in expected),
                60,
                agent,
                "a last_error for every failing camera and the authenticated one streaming",
            )
            time.sleep(3.0)  # a few more attempts each: the cause must stay the same
            msgs = sub.snapshot()
            seen = {cam: errors_of(msgs, cam)[-1] for cam in expected}
            for cam, words in expected.items():
                assert all(w in seen[cam].lower() for w in words), (
                    f"{cam}: last_error {seen[cam]!r}, want {words}"
                )
            assert len(set(seen.values())) == len(seen), seen  # four causes, four different errors
            # Credentials never leave the agent: not in any payload, not in the log.
            everything = b"".join(p for _, p, _ in msgs).decode(errors="replace") + agent.text()
            assert secret not in everything and wrong not in everything
            assert agent.proc.poll() is None
            assert_clean_log(agent)
        finally:
            sub.close()
    print("last_error by cause:", json.dumps(seen, indent=1))  # shown with -s / -rP
