"""`edge-agent keys generate`, `models sign` and `models verify` (issue 37, 1), as an operator runs them:
keys generate -> the printed config lines trust the key -> models sign -> models verify passes against that
config, and fails once the document is changed; bad input ends with exit 2 and one line, nothing written."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
SHA = "0f" * 32
MARK = "SECRET-MARK"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def document(version: str = "v2") -> dict[str, object]:
    art = {"url": f"https://ci:{MARK}@store.example/det.onnx", "sha256": SHA, "size": 4096}
    return {
        "model": "det",
        "version": version,
        "format": "nanodet",
        "artifacts": {"onnx": art, "labels": dict(art, size=80)},
    }


def one_line_error(proc: subprocess.CompletedProcess[str], command: str) -> str:
    assert proc.returncode == 2, proc
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"edge-agent {command}: "), proc.stderr
    assert MARK not in proc.stderr and "Traceback" not in proc.stderr
    return proc.stderr.strip()


def test_generate_sign_verify_round_trip(tmp_path: Path) -> None:
    made = cli("keys", "generate", "--dir", "keys", "--key-id", "ops", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "key id       ops" in made.stdout
    private, public = tmp_path / "keys" / "ops.key", tmp_path / "keys" / "ops.pub"
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600 and public.is_file()
    assert private.read_text() not in made.stdout + made.stderr  # the key itself is never printed

    # The printed config lines, with the public key where this test keeps it, make a device config.
    lines = made.stdout[made.stdout.index("deploy:") :].replace("/etc/edge-agent/keys/ops.pub", str(public))
    config = tmp_path / "agent.yaml"
    models = f"models:\n  det: {{onnx: {MODEL}, format: nanodet, backend: onnxruntime}}\n"
    config.write_text(models + "cameras: {}\nmqtt: {enabled: false}\n" + lines)

    doc = tmp_path / "deploy.json"
    doc.write_text(json.dumps(document()))
    signed = cli("models", "sign", "deploy.json", "--key", "keys/ops.key", cwd=tmp_path)
    assert signed.returncode == 0, signed.stderr
    assert re.fullmatch(r"deploy\.json: signed with key ops; document [0-9a-f]{16}\n", signed.stdout)
    body = json.loads(doc.read_text())
    assert (
        body["signature"]["key_id"] == "ops"
        and {k: v for k, v in body.items() if k != "signature"} == document()
    )

    ok = cli("models", "verify", "deploy.json", "-c", str(config), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("deploy.json: valid; signed by trusted key ops; document ")
    assert ok.stdout.split()[-1] == signed.stdout.split()[-1]  # the same digest

    body["version"] = "v3"  # changed after signing
    doc.write_text(json.dumps(body, indent=2))
    bad = cli("models", "verify", "deploy.json", "-c", str(config), cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stderr == (
        "edge-agent models verify: signature.ed25519: does not match the document (changed after signing,"
        " or not signed by key ops)\n"
    )


def test_sign_writes_elsewhere_or_to_stdout_and_takes_a_key_id(tmp_path: Path) -> None:
    cli("keys", "generate", "--dir", "k", "--key-id", "ops", cwd=tmp_path)
    doc = tmp_path / "d.json"
    doc.write_text(json.dumps(document()))
    before = doc.read_bytes()
    done = cli(
        "models", "sign", "d.json", "--key", "k/ops.key", "--key-id", "ci", "--out", "s.json", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert (
        doc.read_bytes() == before
        and json.loads((tmp_path / "s.json").read_text())["signature"]["key_id"] == "ci"
    )
    out = cli("models", "sign", "d.json", "--key", "k/ops.key", "--out", "-", cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["signature"]["key_id"] == "ops"
    assert out.stderr.startswith("signed with key ops; document ")
    verified = cli("models", "verify", "s.json", "--trust", "ci=k/ops.pub", cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_keys_are_never_overwritten_without_force(tmp_path: Path) -> None:
    cli("keys", "generate", "--dir", "k", "--key-id", "ops", cwd=tmp_path)
    key = (tmp_path / "k" / "ops.key").read_bytes()
    again = cli("keys", "generate", "--dir", "k", "--key-id", "ops", cwd=tmp_path)
    assert "exists; a key is never overwritten (--force replaces it)" in one_line_error(
        again, "keys generate"
    )
    assert (tmp_path / "k" / "ops.key").read_bytes() == key
    forced = cli("keys", "generate", "--dir", "k", "--key-id", "ops", "--force", cwd=tmp_path)
    assert forced.returncode == 0 and (tmp_path / "k" / "ops.key").read_bytes() != key
    bad_id = cli("keys", "generate", "--dir", "k", "--key-id", "../x", cwd=tmp_path)
    assert "key id: must be a name" in one_line_error(bad_id, "keys generate")


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path: Path) -> None:
    cli("keys", "generate", "--dir", "k", "--key-id", "ops", cwd=tmp_path)
    doc = tmp_path / "d.json"
    wrong = document()
    wrong["artifacts"]["onnx"]["sha256"] = MARK  # type: ignore[index]
    doc.write_text(json.dumps(wrong))
    before = doc.read_bytes()
    proc = cli("models", "sign", "d.json", "--key", "k/ops.key", cwd=tmp_path)
    assert one_line_error(proc, "models sign").endswith(
        "d.json: artifacts.onnx.sha256: must be a sha256: 64 lowercase hexadecimal digits"
    )
    assert doc.read_bytes() == before
    doc.write_text(json.dumps(document()))
    assert "no such file" in one_line_error(
        cli("models", "sign", "none.json", "--key", "k/ops.key", cwd=tmp_path), "models sign"
    )
    assert "not a PEM private key" in one_line_error(
        cli("models", "sign", "d.json", "--key", "k/ops.pub", cwd=tmp_path), "models sign"
    )
    assert "must be ID=PUBLIC_KEY_FILE" in one_line_error(
        cli("models", "verify", "d.json", "--trust", "k/ops.pub", cwd=tmp_path), "models verify"
    )
    assert "no trusted key" in one_line_error(
        cli("models", "verify", "d.json", cwd=tmp_path), "models verify"
    )
    unsigned = cli("models", "verify", "d.json", "--trust", "ops=k/ops.pub", cwd=tmp_path)
    assert unsigned.returncode == 1 and "not signed" in unsigned.stderr
    allowed = cli("models", "verify", "d.json", "--allow-unsigned", cwd=tmp_path)
    assert allowed.returncode == 0 and "unsigned (allowed)" in allowed.stdout
