"""The `engines` config section (issue 38): no cache by default (a config without it behaves as before),
strict values naming the file and the key, files read at load (relative to the config's folder; an error
names the key and the path, never what a file holds, never a password of the URL), and what a reload does
with each key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, load_config, parse_config
from agent.config.engines import EnginesConfig
from agent.config.impact import Impact, keys
from agent.config.reload import plan_reload
from agent.deploy.signing import generate_keys

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "agent" / "assets" / "nanodet-m-416.onnx"
MARK = "SECRET-MARK"
CACHE = "oci://127.0.0.1:5000/site/engines"

BASE = f"""\
models:
  det: {{onnx: {MODEL}, format: nanodet, backend: onnxruntime}}
cameras: {{}}
mqtt: {{enabled: false}}
"""
SIGNED = "  signing_key: keys/dev1.key\n  signing_key_id: dev1\n  trusted_keys: {dev1: keys/dev1.pub}\n"


def load(tmp_path: Path, engines: str) -> AgentConfig:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE + "engines:\n" + engines)
    return load_config(path, env={})


def refused(tmp_path: Path, engines: str) -> list[str]:
    path = tmp_path / "agent.yaml"
    with pytest.raises(ConfigError) as info:
        load(tmp_path, engines)
    lines = str(info.value).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    assert MARK not in str(info.value)
    return [line.removeprefix(f"{path}: ") for line in lines]


@pytest.fixture
def pub(tmp_path: Path) -> Path:
    return generate_keys(tmp_path / "keys", "dev1")[1]


def test_no_cache_by_default_and_a_config_without_the_section_loads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(BASE)
    cfg = load_config(path, env={})
    assert cfg.engines == EnginesConfig() and cfg.engines.cache is None and not cfg.engines.enabled
    assert cfg.engines.push is True and cfg.engines.timeout_s == 10.0


def test_a_full_section_loads_with_paths_against_the_config_folder(tmp_path: Path, pub: Path) -> None:
    (tmp_path / "creds.json").write_text('{"username": "u", "password": "p"}')
    cfg = load(
        tmp_path,
        f"  cache: {CACHE}\n{SIGNED}  credentials_file: creds.json\n  timeout_s: 3\n"
        "  claim_ttl_s: 60\n  claim_wait_s: 600\n",
    )
    e = cfg.engines
    assert e.enabled and e.cache == CACHE and e.push
    assert e.signing_key == tmp_path / "keys" / "dev1.key" and e.signing_key_id == "dev1"
    assert e.trusted_keys == {"dev1": pub} and e.credentials_file == tmp_path / "creds.json"
    assert (e.timeout_s, e.claim_ttl_s, e.claim_wait_s) == (3.0, 60.0, 600.0)


@pytest.mark.parametrize(
    ("engines", "line"),
    [
        ("  cache: http://127.0.0.1:5000/x\n  push: false\n  trusted_keys: {a: k.pub}\n",
         "engines.cache: must be an oci://host:port/repository URL"),
        (f"  cache: oci://user:{MARK}@127.0.0.1:5000/x\n  push: false\n  trusted_keys: {{a: k.pub}}\n",
         "engines.cache: credentials do not belong in the URL"),
        (f"  cache: {CACHE}\n  push: false\n", "engines: cache without trusted_keys"),
        (f"  cache: {CACHE}\n  trusted_keys: {{a: k.pub}}\n", "engines: cache with push and no signing_key"),
        ("  signing_key: k.key\n", "engines: signing_key and signing_key_id go together"),
        ("  push: maybe\n", "engines.push: must be true or false"),
        ("  bogus: 1\n", "engines.bogus: unknown key"),
        ("  timeout_s: 0\n", "engines.timeout_s: must be > 0"),
        ("  timeout_s: '10'\n", "engines.timeout_s: must be a number, not a string"),
        ("  claim_ttl_s: 1\n", "engines.claim_ttl_s: must be >= 5"),
        ("  trusted_keys: {'a b': k.pub}\n", "engines.trusted_keys: key id 'a b': must be a name"),
        ("  signing_key_id: 'a/b'\n  signing_key: k.key\n", "engines.signing_key_id: must be a name"),
    ],
)
def test_bad_values_name_the_file_and_the_key(tmp_path: Path, engines: str, line: str) -> None:
    lines = refused(tmp_path, engines)
    assert any(x.startswith(line) for x in lines), lines


def test_files_are_read_at_load_naming_the_key_never_the_content(tmp_path: Path, pub: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text(f"-----BEGIN PRIVATE KEY-----\n{MARK}\n-----END PRIVATE KEY-----\n")
    private = pub.with_suffix(".key")
    lines = refused(
        tmp_path,
        f"  cache: {CACHE}\n  signing_key: garbage.pem\n  signing_key_id: dev1\n"
        "  trusted_keys: {dev1: keys/dev1.pub, gone: nowhere.pub, secret: keys/dev1.key}\n"
        "  credentials_file: creds.json\n  ca_file: keys\n",
    )
    assert lines == [
        f"engines.trusted_keys.gone: {tmp_path / 'nowhere.pub'}: no such file",
        f"engines.trusted_keys.secret: {private}: not a PEM public key",
        f"engines.signing_key: {garbage}: not a PEM private key",
        f"engines.credentials_file: {tmp_path / 'creds.json'}: no such file",
        f"engines.ca_file: {tmp_path / 'keys'}: is a directory, not a file",
    ]
    # A public key given as the signing key is named as such; nothing of it is quoted.
    lines = refused(tmp_path, f"  cache: {CACHE}\n  signing_key: keys/dev1.pub\n  signing_key_id: dev1\n"
                    "  trusted_keys: {dev1: keys/dev1.pub}\n")
    assert lines == [f"engines.signing_key: {pub}: not a PEM private key"]
    # A login file that is not {"username", "password"} JSON is named; its content never shown.
    creds = tmp_path / "creds.json"
    creds.write_text(f'{{"user": "{MARK}"}}')
    lines = refused(tmp_path, f"  cache: {CACHE}\n  push: false\n  trusted_keys: {{dev1: keys/dev1.pub}}\n"
                    "  credentials_file: creds.json\n")
    assert len(lines) == 1 and lines[0].startswith(f"engines.credentials_file: {creds}: must be "), lines
    # Without a cache nothing is read: the section may be prepared before the registry exists.
    cfg = load(tmp_path, "  trusted_keys: {gone: nowhere.pub}\n")
    assert cfg.engines.trusted_keys["gone"] == tmp_path / "nowhere.pub"


def test_each_key_declares_what_a_reload_does_with_it() -> None:
    found = {k.path: k.impact for k in keys(AgentConfig) if k.path.startswith("engines.")}
    assert set(found) >= {"engines.cache", "engines.push", "engines.trusted_keys", "engines.claim_wait_s"}
    # Read when a build starts: a SIGHUP that drops a trusted key revokes it for the next pull.
    assert set(found.values()) == {Impact.LIVE}


def test_a_reload_applies_the_section_to_the_next_build(tmp_path: Path, pub: Path) -> None:
    models = {"det": {"onnx": str(MODEL), "format": "nanodet", "backend": "onnxruntime"}}
    old = parse_config({"models": models, "cameras": {}})
    section = {"cache": CACHE, "push": False, "trusted_keys": {"dev1": str(pub)}}
    new = parse_config({"models": models, "cameras": {}, "engines": section})
    plan = plan_reload(old, new)
    assert plan.needs_restart == [] and plan.live == ["engines.cache", "engines.push", "engines.trusted_keys"]


def test_a_reload_takes_effect_at_the_next_build(tmp_path: Path, pub: Path) -> None:
    """The engine manager's CacheSetup makes the cache of the config in effect when a build asks: none
    without `cache`, the same one while the section is unchanged, a new one after a reload changed it."""
    from agent.lifecycle.cache_setup import CacheSetup
    from agent.lifecycle.shared_cache import NoClaims

    models = {"det": {"onnx": str(MODEL), "format": "nanodet", "backend": "onnxruntime"}}
    base = {"models": models, "cameras": {}, "mqtt": {"enabled": False}}
    key = str(pub.with_suffix(".key"))
    section = {"cache": CACHE, "trusted_keys": {"dev1": str(pub)}, "signing_key": key}
    section["signing_key_id"] = "dev1"
    current = [parse_config(base)]
    setup = CacheSetup(lambda: current[0])
    assert setup() is None
    current[0] = parse_config({**base, "engines": section})
    first = setup()
    assert first is not None and first.signer is not None and isinstance(first.claims, NoClaims)
    assert setup() is first
    current[0] = parse_config({**base, "engines": {**section, "push": False}})
    second = setup()
    assert second is not None and second is not first and second.signer is None
    current[0] = parse_config(base)
    assert setup() is None
