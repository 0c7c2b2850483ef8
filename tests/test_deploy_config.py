"""The `deploy` config section (issue 37): off by default (a config without it behaves as before), strict
values naming the file and the key, trusted keys and the CA file read at load (relative to the config's
folder; an error names the key id and the path, never what the file holds), and what a reload does with
each key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, DeployConfig, load_config, parse_config
from agent.config.impact import Impact, keys
from agent.config.reload import plan_reload
from agent.deploy.signing import generate_keys

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
MARK = "SECRET-MARK"

BASE = f"""\
models:
  det: {{onnx: {MODEL}, format: nanodet, backend: onnxruntime}}
cameras: {{}}
mqtt: {{enabled: false}}
"""


def load(tmp_path: Path, deploy: str) -> AgentConfig:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE + "deploy:\n" + deploy)
    return load_config(path, env={})


def refused(tmp_path: Path, deploy: str) -> list[str]:
    path = tmp_path / "agent.yaml"
    with pytest.raises(ConfigError) as info:
        load(tmp_path, deploy)
    lines = str(info.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    assert MARK not in str(info.value)
    return [line.removeprefix(f"{path}: ") for line in lines]


@pytest.fixture
def pub(tmp_path: Path) -> Path:
    return generate_keys(tmp_path / "keys", "ops")[1]


def test_off_by_default_and_a_config_without_the_section_loads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE)
    cfg = load_config(path, env={})
    assert cfg.deploy == DeployConfig() and cfg.deploy.enabled is False
    assert cfg.deploy.allow_unsigned is False and cfg.deploy.allow_http is False
    assert not cfg.deploy.trusted_keys
    assert cfg.deploy.state_dir == Path("/var/lib/edge-agent/deployments")
    assert cfg.deploy.max_artifact_bytes == 1024 << 20


def test_a_full_section_loads_with_paths_against_the_config_folder(tmp_path: Path, pub: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text(_test_ca())
    cfg = load(
        tmp_path,
        "  enabled: true\n  trusted_keys: {ops: keys/ops.pub}\n  ca_file: ca.pem\n  state_dir: state\n"
        "  keep_versions: 3\n  max_artifact_mb: 64\n  gate: {min_agreement: 0.6, frames: 20}\n"
        "  shadow: {frames: 30, max_latency_ratio: 1.5}\n  watch: {age_p95_factor: 2}\n  watch_s: 0\n",
    )
    d = cfg.deploy
    assert d.trusted_keys == {"ops": pub} and d.ca_file == ca and d.state_dir == tmp_path / "state"
    assert (d.keep_versions, d.max_artifact_bytes, d.gate.frames, d.shadow.frames) == (3, 64 << 20, 20, 30)
    assert d.watch.age_p95_factor == 2.0 and d.watch_s == 0


@pytest.mark.parametrize(
    ("deploy", "line"),
    [
        ("  enabled: true\n", "deploy: enabled without trusted_keys: every document would be refused"),
        ("  enabled: yes please\n", "deploy.enabled: must be true or false"),
        ("  bogus: 1\n", "deploy.bogus: unknown key"),
        ("  keep_versions: 0\n", "deploy.keep_versions: must be >= 1"),
        ("  max_artifact_mb: .nan\n", "deploy.max_artifact_mb: must be a finite number, not NaN"),
        ("  read_timeout_s: '30'\n", "deploy.read_timeout_s: must be a number, not a string (write it"),
        ("  gate: {min_agreement: 1.5}\n", "deploy.gate.min_agreement: must be <= 1"),
        ("  shadow: {max_latency_ratio: 0.5}\n", "deploy.shadow.max_latency_ratio: must be >= 1"),
        ("  watch_s: -1\n", "deploy.watch_s: must be >= 0"),
        ("  trusted_keys: {'a b': k.pub}\n", "deploy.trusted_keys: key id 'a b': must be a name"),
        (f"  trusted_keys: {{ops: ''}}\n  note: {MARK}\n", "deploy.trusted_keys.ops: must not be empty"),
    ],
)
def test_bad_values_name_the_file_and_the_key(tmp_path: Path, deploy: str, line: str) -> None:
    lines = refused(tmp_path, deploy)
    assert any(x.startswith(line) for x in lines), lines


def test_trusted_keys_are_read_at_load_naming_the_key_never_the_content(tmp_path: Path, pub: Path) -> None:
    garbage = tmp_path / "garbage.pub"
    garbage.write_text(f"-----BEGIN PUBLIC KEY-----\n{MARK}\n-----END PUBLIC KEY-----\n")
    private = pub.with_suffix(".key")
    keys_yaml = "{ops: keys/ops.pub, gone: nowhere.pub, junk: garbage.pub, secret: keys/ops.key, dir: keys}"
    lines = refused(tmp_path, f"  enabled: true\n  trusted_keys: {keys_yaml}\n")
    assert lines == [
        f"deploy.trusted_keys.gone: {tmp_path / 'nowhere.pub'}: no such file",
        f"deploy.trusted_keys.junk: {garbage}: not a PEM public key",
        f"deploy.trusted_keys.secret: {private}: not a PEM public key",
        f"deploy.trusted_keys.dir: {tmp_path / 'keys'}: is a directory, not a file",
    ]
    # While deployments are off nothing is read (as the mqtt section's files): the section may be prepared.
    cfg = load(tmp_path, f"  enabled: false\n  trusted_keys: {keys_yaml}\n")
    assert cfg.deploy.trusted_keys["gone"] == tmp_path / "nowhere.pub"


def test_a_ca_file_that_is_no_certificate_is_named(tmp_path: Path, pub: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text(f"-----BEGIN CERTIFICATE-----\n{MARK}\n-----END CERTIFICATE-----\n")
    trusted = "  enabled: true\n  trusted_keys: {ops: keys/ops.pub}\n"
    lines = refused(tmp_path, trusted + "  ca_file: ca.pem\n")
    assert lines == [f"deploy.ca_file: {bad}: not a PEM CA certificate"]
    assert refused(tmp_path, trusted + "  ca_file: none.pem\n") == [
        f"deploy.ca_file: {tmp_path / 'none.pem'}: no such file"
    ]


def test_unsigned_documents_may_be_allowed_without_keys(tmp_path: Path) -> None:
    assert load(tmp_path, "  enabled: true\n  allow_unsigned: true\n").deploy.allow_unsigned


def test_each_key_declares_what_a_reload_does_with_it() -> None:
    found = {k.path: k.impact for k in keys(AgentConfig) if k.path.startswith("deploy.")}
    assert found["deploy.enabled"] is Impact.AGENT and found["deploy.state_dir"] is Impact.AGENT
    # Read when a document arrives: a SIGHUP that drops a key revokes it for the next document.
    assert found["deploy.trusted_keys"] is Impact.LIVE and found["deploy.allow_unsigned"] is Impact.LIVE
    assert found["deploy.gate.min_agreement"] is Impact.LIVE
    assert found["deploy.watch.age_p95_factor"] is Impact.LIVE
    assert None not in found.values()


def test_a_reload_applies_trust_at_once_and_keeps_enabled_until_restart(tmp_path: Path) -> None:
    models = {"det": {"onnx": str(MODEL), "format": "nanodet", "backend": "onnxruntime"}}
    old = parse_config({"models": models, "cameras": {}})
    new = parse_config({"models": models, "cameras": {}, "deploy": {"enabled": True, "allow_unsigned": True}})
    plan = plan_reload(old, new)
    assert plan.needs_restart == ["deploy.enabled"] and plan.live == ["deploy.allow_unsigned"]


def _test_ca() -> str:
    """A self-signed CA certificate, made here (cryptography) so no file of the tree is needed."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def test_check_config_names_a_bad_trusted_key(tmp_path: Path, pub: Path) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "agent.yaml"
    path.write_text(BASE + "deploy: {enabled: true, trusted_keys: {ops: keys/ops.key}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "-c", str(path), "--check-config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    key = pub.with_suffix(".key")
    assert proc.stderr == f"edge-agent: {path}: deploy.trusted_keys.ops: {key}: not a PEM public key\n"
    assert key.read_text().splitlines()[1] not in proc.stderr
