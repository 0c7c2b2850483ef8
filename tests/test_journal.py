"""journald fields from the real agent: libsystemd's native protocol, received on the journal socket.

journald does not run here; the test binds /run/systemd/journal/socket itself (only where no journald
owns it and the path is writable, i.e. as root in a container) and reads what sd_journal_send wrote.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures_agent import bundled_model
from fixtures_mqtt import free_port

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
JOURNAL = Path("/run/systemd/journal/socket")

pytest.importorskip("systemd.journal", reason="systemd-python (README install step) is missing")


def parse_native(data: bytes) -> dict[str, str]:
    """journald's native datagram: KEY=value lines, or KEY\\n<le64 size><bytes>\\n for binary-safe values."""
    fields, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", data, nl + 1)
            value = data[nl + 9 : nl + 9 + size]
            i = nl + 9 + size + 1
        fields[key.decode()] = value.decode(errors="replace")
    return fields


@pytest.fixture
def journal_socket() -> socket.socket:
    if JOURNAL.exists():
        pytest.skip(f"{JOURNAL} exists (a real journald owns it)")
    try:
        JOURNAL.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(JOURNAL))
    except OSError as exc:
        pytest.skip(f"cannot bind {JOURNAL}: {exc}")
    sock.settimeout(0.2)
    try:
        yield sock
    finally:
        sock.close()
        JOURNAL.unlink(missing_ok=True)


def test_agent_logs_to_journald_with_camera_and_model_fields(
    tmp_path: Path, journal_socket: socket.socket
) -> None:
    cfg = {
        "device_id": "jrnl",
        "engine_dir": str(tmp_path / "engines"),
        "models": {"detector": bundled_model()},
        "cameras": {
            "gate": {
                "url": f"rtsp://viewer:s3cret@127.0.0.1:{free_port()}/x",
                "model": "detector",
                "open_timeout_s": 0.5,
            }
        },
        "mqtt": {"enabled": False},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    err = (tmp_path / "stderr").open("w")
    st = os.fstat(err.fileno())
    # As systemd sets it: stderr is connected to the journal.
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(path), "--log-level", "info"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    records: list[dict[str, str]] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                records.append(parse_native(journal_socket.recv(1 << 20)))
            except TimeoutError:
                continue
            warned = any(r.get("CAMERA") == "gate" and r.get("PRIORITY") == "4" for r in records)
            if warned and any("started" in r.get("MESSAGE", "") for r in records):
                break
    finally:
        proc.terminate()
        proc.wait(15)
        err.close()
    gate = [r for r in records if r.get("CAMERA") == "gate"]
    assert gate, records
    warn = [r for r in gate if r.get("PRIORITY") == "4"]  # reconnecting is a warning
    assert warn and "reconnecting" in warn[0]["MESSAGE"]
    assert all(r.get("SYSLOG_IDENTIFIER") == "edge-agent" for r in records)
    model = [r for r in records if r.get("MODEL") == "detector"]
    assert model and "served by onnxruntime" in model[0]["MESSAGE"] and model[0]["PRIORITY"] == "6"
    assert any(r.get("LOGGER") == "agent.daemon" and "started" in r["MESSAGE"] for r in records)
    # Our records went to the journal only (FFmpeg's own stderr lines reach journald through the stream).
    stderr = (tmp_path / "stderr").read_text()
    assert "agent.daemon:" not in stderr and "camera gate" not in stderr
    assert not [r for r in records if "s3cret" in "".join(r.values())] and "s3cret" not in stderr
