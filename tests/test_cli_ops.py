"""Operator experience (issue 29), through the real command line where it matters: output into a pipe whose
reader left, range-checked numbers, the demo's and `fleet`'s own identities on a broker, camera failures
told in the agent's words only (never FFmpeg's or OpenCV's), the example config and the README's claims."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures_agent import ASSETS, REPO, bundled_model, run_cli, wait_until
from fixtures_mqtt import Broker, Subscriber, free_port, retain

from agent.cli import build_parser, demo_config, demo_device_id, main
from agent.config import AgentConfig, MqttConfig, name_problem
from agent.mqtt import MqttClient
from agent.mqtt.fleet import client_id as fleet_client_id
from agent.mqtt.topics import Topics

# What FFmpeg (`[tcp @ 0x55d0c...] Connection ... refused`) and OpenCV (`[ WARN:0@0.1] global ...`,
# `[ERROR:0@0.02] ...`, `[OPENCV:FFMPEG:16] ...`) print on their own.
RAW_LINE = re.compile(
    r"^\[(?:[\w,.-]+ @ 0x[0-9a-f]+|\s*(?:WARN|ERROR|INFO|DEBUG|FATAL)[^\]]*|OPENCV:FFMPEG:\d+)\]"
)
AGENT_ID = re.compile(r".+-[0-9a-f]{8}(-shard\d+)?")  # {prefix}-{device}-{instance}[-shard{k}]


def config(tmp_path: Path, cameras: dict, **extra: object) -> Path:
    data = {
        "device_id": "ops-test",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"det": bundled_model()},
        "cameras": cameras,
        "mqtt": {"enabled": False},
        **extra,
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, stdout: int, timeout: float = 120, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`edge-agent ARGS` with stdout on the given descriptor: (exit status, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stderr


def into_closed_pipe(*args: str, timeout: float = 120) -> tuple[int, str]:
    """stdout is a pipe whose reader is gone before the command writes: every write fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return cli(*args, stdout=w, timeout=timeout)
    finally:
        os.close(w)


# ---- 1. a reader that left --------------------------------------------------------------------------
def test_output_into_a_closed_pipe_is_quiet(tmp_path: Path, mqtt_broker: Broker) -> None:
    cfg = config(tmp_path, {})
    now = time.time()
    status = {"ts": now, "state": "online", "version": "1", "cameras_up": 1, "cameras_total": 1}
    retain(
        mqtt_broker.port,
        [(f"edge-agent/dev-{i:03d}/status", json.dumps(status).encode()) for i in range(300)],
    )
    fleet = ("fleet", "status", "--json", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port))
    for args in (
        ("check", "--json", "-c", str(cfg)),  # issue 29's example
        fleet,  # 300 agents: about 90 KB of JSON, more than a pipe holds
        ("install-service", "--dry-run", "--root", str(tmp_path / "stage")),
        ("demo", "--mqtt-port", str(free_port())),  # its banner is the first write
        ("--help",),
    ):
        rc, err = into_closed_pipe(*args)
        assert rc in (0, 141) and err == "", (args, rc, err)
    assert not (tmp_path / "stage").exists()  # --dry-run changed nothing

    # `| head -3` as written in the issue, in a shell with pipefail: quiet, and the status says why.
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m agent.cli {' '.join(fleet)} | head -3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 141) and done.stderr == "" and done.stdout.count("\n") == 3, done


def test_a_broken_pipe_that_is_not_stdout_is_still_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only stdout's reader leaving is quiet: a BrokenPipeError from anything else (a dead child's pipe in a
    bench) is a failure to report."""

    def broken(_args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("agent.cli.lifecycle.cmd_check", broken)
    assert main(["check", "-c", "x.yaml"]) == 2
    assert "internal error: BrokenPipeError" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_stops_quietly_when_its_reader_leaves() -> None:
    """`edge-agent demo | head -2`: the console lines come from the scheduler's thread; once the reader is
    gone the demo stops by itself, with no traceback per line on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--mqtt-port", str(free_port())],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]  # the banner and the first console line
        assert lines[0].startswith("edge-agent demo:") and " fps " in lines[1], lines
        proc.stdout.close()
        rc = proc.wait(60)
        err = proc.stderr.read() if proc.stderr else ""
        assert rc in (0, 141) and err == "", (rc, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.slow
def test_run_keeps_serving_when_its_console_reader_leaves(tmp_path: Path) -> None:
    """`run` with `console: true` whose stdout reader left: one warning, no more console lines, and the
    agent goes on (a daemon does not stop because a console went away); SIGTERM still stops it cleanly."""
    cams = {"clip": {"url": str(ASSETS / "bikes.mp4"), "model": "det", "fps": 5}}
    cfg = config(tmp_path, cams, console=True, log_level="warning")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(cfg)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert " fps " in proc.stdout.readline()
        proc.stdout.close()
        time.sleep(4)  # a console line every second: each would have failed
        assert proc.poll() is None
        proc.terminate()
        rc = proc.wait(30)
        err = proc.stderr.read()
        assert rc == 0 and err.count("console: stdout was closed") == 1, err
        assert "Traceback" not in err and "BrokenPipeError" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# ---- 2. numbers -------------------------------------------------------------------------------------
BAD_NUMBERS = [
    (["fleet", "status", "--wait", "-3"], "--wait"),
    (["fleet", "status", "--wait", "nan"], "--wait"),
    (["fleet", "status", "--wait", "inf"], "--wait"),
    (["fleet", "status", "--wait", "0"], "--wait"),
    (["fleet", "status", "--wait", "1e9"], "--wait"),
    (["fleet", "status", "--wait", "soon"], "--wait"),
    (["fleet", "status", "--mqtt-port", "0"], "--mqtt-port"),
    (["fleet", "status", "--mqtt-port", "65536"], "--mqtt-port"),
    (["fleet", "status", "--mqtt-port", "-1"], "--mqtt-port"),
    (["demo", "--mqtt-port", "0"], "--mqtt-port"),
    (["demo", "--mqtt-port", "99999"], "--mqtt-port"),
    (["rebuild", "-c", "x", "--wait", "-1"], "--wait"),
    (["rebuild", "-c", "x", "--wait", "NaN"], "--wait"),
    (["rebuild", "-c", "x", "--wait=-inf"], "--wait"),  # "-inf" alone reads as an option
    (["calibrate", "-c", "x", "--samples", "-5"], "--samples"),
    (["calibrate", "-c", "x", "--samples", "1.5"], "--samples"),
    (["calibrate", "-c", "x", "--held-out", "0"], "--held-out"),
    (["calibrate", "-c", "x", "--interval", "0"], "--interval"),
    (["calibrate", "-c", "x", "--interval", "-2"], "--interval"),
    (["calibrate", "-c", "x", "--interval", "nan"], "--interval"),
    (["profile", "-c", "x", "--iterations", "1.5"], "--iterations"),  # >= 1: run_profile (test_profile.py)
]


@pytest.mark.parametrize(("argv", "option"), BAD_NUMBERS, ids=[" ".join(a) for a, _ in BAD_NUMBERS])
def test_every_number_is_range_checked(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "", (out, err)
    assert err.startswith("usage: edge-agent") and f"error: argument {option}: " in err, err
    assert ("must be" in err or "not a" in err or "invalid int" in err) and "Traceback" not in err, err


def test_numbers_in_range_still_parse() -> None:
    p = build_parser()
    assert p.parse_args(["fleet", "status", "--wait", "0.2", "--mqtt-port", "65535"]).wait == 0.2
    assert p.parse_args(["rebuild", "-c", "x", "--wait", "0"]).wait == 0.0
    args = p.parse_args(["calibrate", "-c", "x", "--samples", "0", "--held-out", "1", "--interval", "0.5"])
    assert (args.samples, args.held_out, args.interval) == (0, 1, 0.5)
    args = p.parse_args(["profile", "-c", "x", "--iterations", "1", "--top", "1"])
    assert (args.iterations, args.top) == (1, 1)
    assert p.parse_args(["demo", "--mqtt-port", "1"]).mqtt_port == 1
    assert p.parse_args(["fleet", "status"]).wait == 0.5  # defaults are untouched


def test_profile_counts_below_one_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(config(tmp_path, {}))
    for flag in ("--iterations", "--top"):
        for value in ("0", "-3"):
            assert main(["profile", "-c", cfg, flag, value]) == 2
            assert "--iterations and --top must be >= 1" in capsys.readouterr().err


def test_a_bad_number_from_the_real_cli_is_a_usage_error() -> None:
    proc = run_cli("fleet", "status", "--wait", "-3", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines()[-1] == (
        "edge-agent fleet status: error: argument --wait: "
        "-3: must be a number of seconds, more than 0 and at most 60"
    ), proc.stderr


# ---- 3. identities ----------------------------------------------------------------------------------
def test_the_demo_never_takes_the_services_device_id() -> None:
    host = socket.gethostname()
    service = AgentConfig.model_validate({"models": {"m": bundled_model()}, "cameras": {}}).device_id
    assert service == host  # the service's default (and install-service writes the host name too)
    cfg = demo_config()
    assert cfg.device_id != service and cfg.device_id.endswith("-demo")
    for node, expect in (
        ("yard-01", "yard-01-demo"),
        ("my host", "my-host-demo"),
        ("_odd", "odd-demo"),
        ("café.lan", "caf-.lan-demo"),
        ("", "edge-agent-demo"),
    ):
        assert demo_device_id(node) == expect and name_problem(expect) is None, node


def test_fleet_client_id_cannot_be_an_agents() -> None:
    """An agent's client id always ends in `-<8 hex>` (its instance; shards add `-shard<k>`); the fleet
    reader's never does, whatever the prefix and device id, so it cannot throw an agent off the broker."""
    ids = set()
    for prefix, device in (("edge-agent", "fleet"), ("edge-agent/fleet", "x"), ("edge-agent-fleet", "a")):
        for shard in (None, 0):
            c = MqttClient(MqttConfig(), Topics(prefix, device), shard=shard)
            assert AGENT_ID.fullmatch(c.client_id), c.client_id
    for _ in range(50):
        ids.add(fleet_client_id())
        assert not AGENT_ID.fullmatch(fleet_client_id())
    assert len(ids) == 50


def test_fleet_status_connects_as_itself_and_publishes_nothing(tmp_path: Path, mqtt_broker: Broker) -> None:
    """Against a real broker: the client id the broker logs is the fleet's own, and `fleet status` leaves
    no message (no status, no will) on any topic, an agent's status topic included."""
    now = time.time()
    retain(
        mqtt_broker.port, [("edge-agent/fleet/status", json.dumps({"ts": now, "state": "online"}).encode())]
    )
    sub = Subscriber(mqtt_broker.port, "#")
    try:
        time.sleep(0.5)
        before = len(sub.snapshot())
        proc = run_cli(
            "fleet", "status", "--json", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port)
        )
        assert proc.returncode == 0 and json.loads(proc.stdout)[0]["device"] == "fleet", proc
        time.sleep(0.5)
        assert len(sub.snapshot()) == before
    finally:
        sub.close()
    logged = re.findall(r"New client connected from \S+ as (\S+)", mqtt_broker.log_tail(20000))
    fleet_ids = [c for c in logged if c.startswith("edge-agent-fleet.")]
    assert len(fleet_ids) == 1 and not AGENT_ID.fullmatch(fleet_ids[0]), logged


@pytest.mark.slow
def test_demo_publishes_under_its_own_device_id(mqtt_broker: Broker) -> None:
    host = socket.gethostname()
    sub = Subscriber(mqtt_broker.port, "edge-agent/#")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "demo", "--mqtt-port", str(mqtt_broker.port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = wait_until(lambda: any(t.endswith("/status") for t, _, _ in sub.snapshot()), 60)
        topics = {t for t, _, _ in sub.snapshot()}
        assert seen and f"edge-agent/{host}-demo/status" in topics, topics
        assert not any(t.startswith(f"edge-agent/{host}/") for t in topics), topics
    finally:
        sub.close()
        proc.terminate()
        proc.wait(15)


# ---- 4. camera failures in our words ------------------------------------------------------------------
def closed_port() -> int:
    port = free_port()  # bound and released: nothing listens there now
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    return port


def run_agent(cfg: Path, seconds: float, env: dict[str, str] | None = None) -> tuple[str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(cfg), "--log-level", "info"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        time.sleep(seconds)
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    return out, err


def broken_sources(tmp_path: Path) -> dict[str, dict]:
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(os.urandom(20000))
    truncated = tmp_path / "truncated.mp4"  # FFmpeg: "moov atom not found"
    truncated.write_bytes((ASSETS / "bikes.mp4").read_bytes()[:3000])
    return {
        "rtsp": {"url": f"rtsp://127.0.0.1:{closed_port()}/x", "model": "det", "open_timeout_s": 2},
        "garbage": {"url": str(garbage), "model": "det"},
        "truncated": {"url": str(truncated), "model": "det"},
        "named": {"url": "rtsp://cam-gate.example/x", "model": "det", "open_timeout_s": 2},  # RFC 6761
    }


@pytest.mark.slow
def test_failing_cameras_are_told_in_the_agents_words_only(tmp_path: Path) -> None:
    cams = broken_sources(tmp_path)
    port = cams["rtsp"]["url"].split(":")[2].split("/")[0]
    out, err = run_agent(config(tmp_path, cams), seconds=6)
    raw = [line for line in (out + err).splitlines() if RAW_LINE.match(line)]
    assert raw == [], raw
    mine = [line for line in err.splitlines() if ": reconnecting (" in line]
    reasons = {re.search(r"camera (\w+): reconnecting \((.*)\)$", line).groups() for line in mine}  # type: ignore[union-attr]
    unreadable = "not a video FFmpeg can read (unknown format, damaged or incomplete)"
    named = {why for cam, why in reasons if cam == "named"}
    assert reasons - {("named", why) for why in named} == {
        ("rtsp", f"cannot open: rtsp://127.0.0.1:{port}/x: connection refused by 127.0.0.1:{port}"),
        ("garbage", f"cannot open {tmp_path}/garbage.mp4: {unreadable}"),
        ("truncated", f"cannot open {tmp_path}/truncated.mp4: {unreadable}"),
    }, mine
    # (without a resolver that answers at once, the open may time out first: the probe still names the host)
    assert len(named) == 1 and named.pop().endswith(
        "rtsp://cam-gate.example/x: host not found: cam-gate.example"
    )
    # once per change: every camera retried several times in 6 s (backoff from 0.5 s), one line each
    assert len(mine) == 4, mine


@pytest.mark.slow
def test_the_operators_own_ffmpeg_and_opencv_log_levels_are_kept(tmp_path: Path) -> None:
    """OPENCV_FFMPEG_LOGLEVEL set by the operator (to debug a camera) is not overridden."""
    cams = broken_sources(tmp_path)
    out, err = run_agent(
        config(tmp_path, {"rtsp": cams["rtsp"]}), seconds=3, env={"OPENCV_FFMPEG_LOGLEVEL": "16"}
    )
    assert any("Connection refused" in line and RAW_LINE.match(line) for line in (out + err).splitlines()), (
        out,
        err,
    )


# ---- 5. the example config --------------------------------------------------------------------------
PRIVATE = re.compile(
    r"(?<![\w.])(?:10(?:\.\d{1,3}){3}|192\.168(?:\.\d{1,3}){2}|172\.(?:1[6-9]|2\d|3[01])(?:\.\d{1,3}){2})(?![\w.])"
)  # RFC 1918


def test_example_config_names_no_reachable_host_and_passes_check_config(tmp_path: Path) -> None:
    text = (REPO / "examples" / "agent.yaml").read_text()
    assert not PRIVATE.search(text), PRIVATE.findall(text)
    hosts = re.findall(r"rtsp://(?:[^@/\s]*@)?([^:/\s]+)", text)
    assert hosts and all(h.endswith(".example") for h in hosts), hosts
    # Only the model's files change (here: the bundled NanoDet; the example's yolov8n is not shipped).
    data = yaml.safe_load(text)
    data["models"]["detector"].update(
        onnx=str(ASSETS / "nanodet-m-416.onnx"), labels=str(ASSETS / "coco.names"), format="nanodet"
    )
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    rc, err = cli(
        "run", "-c", str(path), "--check-config", stdout=subprocess.PIPE, env={"GATE_PASSWORD": "pw"}
    )
    assert rc == 0 and err == "", err


@pytest.mark.parametrize("doc", ["README.md", "docs/BENCHMARKS.md"])
def test_readme_names_no_private_address(doc: str) -> None:
    text = (REPO / doc).read_text()
    assert PRIVATE.findall(text) == []
    for host in re.findall(r"(?:host:|--mqtt-host|address|@)\s*([A-Za-z][\w.-]*\.[a-z]+)\b", text):
        assert host.endswith(".example") or host == "localhost", host


# ---- 6. README claims -------------------------------------------------------------------------------
def test_readme_fleet_json_is_what_fleet_status_prints(mqtt_broker: Broker) -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```json\n(\[.*?\])\n```", text[text.index("**Fleet view.**") :], re.S)
    assert block is not None
    documented = json.loads(block.group(1))
    now = time.time()
    status = {
        "ts": now,
        "state": "offline",
        "reason": "stopped",
        "version": "0.1.0",
        "cameras_up": 0,
        "cameras_total": 1,
    }
    retain(
        mqtt_broker.port,
        [
            ("edge-agent/yard-01/status", json.dumps(status).encode()),
            (
                "edge-agent/yard-01/engines/det",
                json.dumps({"ts": now, "state": "ready", "backend": "onnxruntime"}).encode(),
            ),
        ],
    )
    proc = run_cli(
        "fleet", "status", "--json", "--mqtt-host", "127.0.0.1", "--mqtt-port", str(mqtt_broker.port)
    )
    assert proc.returncode == 0, proc
    printed = json.loads(proc.stdout)
    assert isinstance(printed, list) and len(printed) == 1
    assert list(printed[0]) == list(documented[0])  # the same keys in the same order
    same = {k: v for k, v in printed[0].items() if k != "last_seen"}
    assert same == {k: v for k, v in documented[0].items() if k != "last_seen"}


def test_readme_documents_the_config_keys_it_was_missing() -> None:
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Configuration reference") : text.index("## Cameras")]
    for key in ("`mqtt.enabled`", "`cameras.C.enabled`", "`log_level`", "`models.M.calibration.folder`"):
        assert f"| {key}" in table, key


@pytest.mark.parametrize("backend", ["onnxruntime", "auto"])
def test_check_fails_naming_a_missing_onnx_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    """Issue 36 (5): ONNX Runtime serving needs no engine, but it needs the model: before, `check` said ok
    when models.det.onnx did not exist. Now an error (exit 2, as every check error) naming the path."""
    missing = tmp_path / "gone.onnx"
    cfg = config(tmp_path, {}, models={"det": bundled_model(onnx=str(missing), backend=backend)})
    assert main(["check", "-c", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "det: error" in out and f"models.det.onnx: {missing} does not exist" in out
    assert main(["check", "-c", str(cfg), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["models"]["det"]["status"] == "error"
    # The bundled model, present: ok as before.
    assert main(["check", "-c", str(config(tmp_path, {}))]) == 0


def test_check_config_is_a_command_of_its_own(tmp_path: Path) -> None:
    """Issue 36 (8): `edge-agent check-config -c F` (before: an argparse error, exit 2 for any config) says
    what `run -c F --check-config` says, with the same exit code, for a good and a broken config."""
    good = config(tmp_path, {})
    (tmp_path / "bad").mkdir()
    bad = config(tmp_path / "bad", {}, models={"det": bundled_model(onnx=str(tmp_path / "gone.onnx"))})
    said = {}
    for path, code in ((good, 0), (bad, 2)):
        new = run_cli("check-config", "-c", str(path), timeout=120)
        old = run_cli("run", "-c", str(path), "--check-config", timeout=120)
        assert (new.returncode, new.stdout, new.stderr) == (old.returncode, old.stdout, old.stderr)
        assert new.returncode == code, new.stderr
        said[code] = new
    assert said[0].stdout.strip() == f"{good}: ok (1 model(s), 0 camera(s))"
    assert "gone.onnx" in said[2].stderr and "Traceback" not in said[2].stderr
