"""`edge-agent models publish` against a real registry: what it prints is the `artifacts` object of a
deployment document (oci://...@sha256: by digest) that the device's download takes byte for byte; bad
input exits 2 and a registry that cannot be reached exits 1, each with one line."""

from __future__ import annotations

import json
from pathlib import Path

from fixtures_agent import run_cli
from fixtures_registry import (
    DockerRegistry,
    registry,  # noqa: F401  (the fixture)
)

from agent.deploy.document import parse_document
from agent.deploy.download import FetchPolicy, fetch


def test_published_files_are_a_documents_artifacts_the_download_takes(
    registry: DockerRegistry, tmp_path: Path  # noqa: F811
) -> None:
    onnx, labels = tmp_path / "model.onnx", tmp_path / "labels.txt"
    onnx.write_bytes(b"\x08\x07" * 5000)
    labels.write_text("person\ncar\n")
    proc = run_cli("models", "publish", "--onnx", str(onnx), "--labels", str(labels),
                   "--to", registry.url("site/models"), "--tag", "det-v2", timeout=120)
    assert proc.returncode == 0, proc.stderr
    artifacts = json.loads(proc.stdout)
    assert set(artifacts) == {"onnx", "labels"}
    url = artifacts["onnx"]["url"]
    assert url.startswith(f"oci://127.0.0.1:{registry.port}/site/models@sha256:")
    assert artifacts["labels"]["url"] == url  # one manifest, a layer each
    assert f"site/models:det-v2 = {url.split('@')[1]}" in proc.stderr
    doc = {"model": "det", "version": "v2", "format": "nanodet", "artifacts": artifacts}
    parsed, _ = parse_document(doc, "")
    policy = FetchPolicy(allow_http=False, ca_file=None, max_bytes=1 << 20, connect_timeout_s=5,
                         read_timeout_s=5)
    got = fetch(parsed.artifacts.onnx, tmp_path / "out" / "model.onnx", policy, field="artifacts.onnx")
    assert got.read_bytes() == onnx.read_bytes()
    got = fetch(parsed.artifacts.labels, tmp_path / "out" / "labels.txt", policy, field="artifacts.labels")
    assert got.read_text() == "person\ncar\n"


def test_bad_input_exits_2_and_an_unreachable_registry_1(registry: DockerRegistry,  # noqa: F811
                                                         tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx")
    tagged = run_cli("models", "publish", "--onnx", str(onnx), "--to", registry.url("site/models:v2"))
    assert tagged.returncode == 2 and "--to: name the repository only (a tag goes in --tag" in tagged.stderr
    missing = run_cli("models", "publish", "--onnx", str(tmp_path / "nope.onnx"), "--to", registry.url())
    assert missing.returncode == 2 and f"--onnx {tmp_path / 'nope.onnx'}: no such file" in missing.stderr
    registry.stop()
    down = run_cli("models", "publish", "--onnx", str(onnx), "--to", registry.url(), "--timeout", "3")
    assert down.returncode == 1, down.stderr
    why = f"registry 127.0.0.1:{registry.port}: connection refused"
    assert down.stderr.strip() == f"edge-agent models publish: {why}"
