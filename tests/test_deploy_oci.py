"""Deployment artifacts from an OCI registry (`oci://host:port/repo@sha256:<manifest digest>`), against a
real CNCF Distribution (tests/fixtures_registry.py) and agent.deploy.download: by digest only, the
manifest's digest checked, the artifact's layer picked and checked against the document before a byte is
fetched, the blob's bytes checked as any download's; every refusal names the field."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from fixtures_oci_models import LABELS_TYPE, ONNX_TYPE, Pushed, push_files
from fixtures_registry import (
    DockerRegistry,
    registry,  # noqa: F401  (the fixture)
    running_registry,
    running_token_server,
)

from agent.config.deploy import DeployConfig, deploy_file_problems
from agent.deploy.document import Artifact, parse_document
from agent.deploy.download import FetchPolicy, fetch
from agent.deploy.errors import DeployError, DownloadError

PAYLOAD = random.Random(38).randbytes(200_000)
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(PAYLOAD)
    return path


@pytest.fixture
def pushed(registry: DockerRegistry, model: Path) -> Pushed:  # noqa: F811
    return push_files(registry, "site/models", [(model, "application/vnd.oci.image.layer.v1.tar")])


@pytest.fixture
def policy() -> FetchPolicy:
    return FetchPolicy(allow_http=False, ca_file=None, max_bytes=1 << 20, connect_timeout_s=5,
                       read_timeout_s=5, retries=1, backoff_s=0.05)


def art(d: dict[str, object]) -> Artifact:
    return Artifact.model_validate(d)


def document(url: str) -> dict[str, object]:
    a = {"url": url, "sha256": "0" * 64, "size": 1}
    return {"model": "det", "version": "v2", "format": "nanodet", "artifacts": {"onnx": a, "labels": a}}


# ---- the URL in the document ------------------------------------------------------------------------------
def test_a_manifest_by_digest_is_taken_in_a_document() -> None:
    url = f"oci://registry.local:5000/site/models@{DIGEST}"
    doc, _ = parse_document(document(url), "deploy.json")
    assert doc.artifacts.onnx.url == url
    parse_document(document(f"oci://127.0.0.1:5000/m@{DIGEST}?plain-http=true"), "")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("oci://registry.local:5000/site/models:v2", "names a tag"),
        ("oci://registry.local:5000/site/models", "names no manifest digest"),
        (f"oci://registry.local:5000/site/models:v2@{DIGEST}", "give the digest only"),
        ("oci://registry.local:5000/site/models@sha256:abc", "must name the manifest by digest"),
        (f"oci://user:s3cret@registry.local:5000/m@{DIGEST}", "credentials do not belong in the URL"),
        (f"oci://registry.local:5000/Site@{DIGEST}", "repository must be lowercase"),
        (f"oci://registry.local:5000@{DIGEST}", "names no repository"),
    ],
)
def test_a_tag_or_anything_but_a_digest_is_refused_naming_the_field(url: str, words: str) -> None:
    with pytest.raises(DeployError) as e:
        parse_document(document(url), "deploy.json")
    assert e.value.field == "artifacts.onnx.url"
    assert e.value.reason.startswith("deploy.json: artifacts.onnx.url: ")
    assert words in e.value.reason
    assert "s3cret" not in e.value.reason and "models:v2" not in e.value.reason


# ---- the download -----------------------------------------------------------------------------------------
def test_the_single_layer_is_fetched_with_progress(pushed: Pushed, model: Path, policy: FetchPolicy,
                                                   tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    dest = fetch(art(pushed.artifact(model)), tmp_path / "out" / "model.onnx", policy,
                 progress=lambda n, t: seen.append((n, t)), field="artifacts.onnx")
    assert dest.read_bytes() == PAYLOAD
    assert seen[-1] == (len(PAYLOAD), len(PAYLOAD)) and len(seen) > 1


def test_of_several_layers_each_artifact_takes_its_media_type(registry: DockerRegistry,  # noqa: F811
                                                              model: Path, policy: FetchPolicy,
                                                              tmp_path: Path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("person\nbicycle\n")
    pushed = push_files(registry, "models", [(model, ONNX_TYPE), (labels, LABELS_TYPE)], tag="v2")
    out = tmp_path / "out"
    assert fetch(art(pushed.artifact(model)), out / "m.onnx", policy, field="artifacts.onnx").read_bytes() \
        == PAYLOAD
    got = fetch(art(pushed.artifact(labels)), out / "l.txt", policy, field="artifacts.labels")
    assert got.read_text() == "person\nbicycle\n"
    # Two layers of no type of ours: which one is the model cannot be told.
    plain = push_files(registry, "models", [(model, "a/b"), (labels, "a/c")], tag="other")
    with pytest.raises(DownloadError) as e:
        fetch(art(plain.artifact(model)), out / "x.onnx", policy, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.url"
    assert f"2 layers and 0 of media type {ONNX_TYPE}: one expected" in e.value.reason


def test_a_digest_the_registry_has_no_manifest_of_is_refused_at_once(pushed: Pushed, model: Path,
                                                                     policy: FetchPolicy,
                                                                     tmp_path: Path) -> None:
    dest = tmp_path / "model.out"
    with pytest.raises(DownloadError) as e:
        fetch(art(pushed.artifact(model, digest=DIGEST)), dest, policy, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.url" and not e.value.retryable
    assert e.value.reason == (
        f"download of artifacts.onnx (oci://127.0.0.1:{pushed.registry.port}/site/models manifest "
        f"{DIGEST[:19]}): the registry has no manifest of this digest in this repository"
    )
    assert list(tmp_path.glob("model.out*")) == []


def test_a_layer_other_than_the_documents_file_is_refused_before_its_download(
    pushed: Pushed, model: Path, policy: FetchPolicy, tmp_path: Path
) -> None:
    wrong = {**pushed.artifact(model), "sha256": hashlib.sha256(b"another model").hexdigest()}
    with pytest.raises(DownloadError) as e:
        fetch(art(wrong), tmp_path / "m.onnx", policy, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.sha256" and "not the document's sha256" in e.value.reason
    bigger = {**pushed.artifact(model), "size": len(PAYLOAD) + 1}
    with pytest.raises(DownloadError) as e:
        fetch(art(bigger), tmp_path / "m.onnx", policy, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.size"
    assert list(tmp_path.glob("m.onnx*")) == []


def test_a_blob_tampered_with_in_the_registry_is_refused_and_nothing_kept(
    pushed: Pushed, model: Path, policy: FetchPolicy, tmp_path: Path
) -> None:
    blob = pushed.registry.blob_file(pushed.blobs[model])
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0xFF  # same size: only the bytes' sha256 can tell
    blob.write_bytes(bytes(data))
    with pytest.raises(DownloadError) as e:
        fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", policy, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.sha256" and "sha256 mismatch" in e.value.reason
    assert list(tmp_path.glob("m.onnx*")) == []


def test_a_registry_down_is_retried_then_a_retryable_error(pushed: Pushed, model: Path,
                                                           policy: FetchPolicy, tmp_path: Path) -> None:
    pushed.registry.stop()
    with pytest.raises(DownloadError) as e:
        fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", policy, field="artifacts.onnx")
    assert e.value.retryable and e.value.field == "artifacts.onnx.url"
    assert f"registry 127.0.0.1:{pushed.registry.port}: connection refused (gave up after 2 attempts)" \
        in e.value.reason
    pushed.registry.start()  # back: the same document goes through
    assert fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", policy).read_bytes() == PAYLOAD


def test_a_part_left_by_an_interrupted_download_is_completed(pushed: Pushed, model: Path,
                                                             policy: FetchPolicy, tmp_path: Path) -> None:
    (tmp_path / "m.onnx.part").write_bytes(PAYLOAD[:70_000])
    assert fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", policy).read_bytes() == PAYLOAD
    assert not (tmp_path / "m.onnx.part").exists()


def test_the_size_cap_applies(pushed: Pushed, model: Path, policy: FetchPolicy, tmp_path: Path) -> None:
    small = FetchPolicy(**{**policy.__dict__, "max_bytes": 1000})
    with pytest.raises(DownloadError) as e:
        fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", small, field="artifacts.onnx")
    assert e.value.field == "artifacts.onnx.size" and "over the cap of 1000 bytes" in e.value.reason


def test_plain_http_off_this_machine_needs_allow_http(policy: FetchPolicy, tmp_path: Path) -> None:
    a = art({"url": f"oci://registry.example:5000/m@{DIGEST}?plain-http=true", "sha256": "0" * 64, "size": 9})
    with pytest.raises(DownloadError) as e:
        fetch(a, tmp_path / "m", policy, field="artifacts.labels")
    assert e.value.field == "artifacts.labels.url"
    assert "plain-HTTP registry refused (deploy.allow_http is off)" in e.value.reason


def test_a_registry_with_a_login_takes_the_credentials_file(tmp_path: Path, model: Path,
                                                            policy: FetchPolicy) -> None:
    pytest.importorskip("bcrypt")
    creds = tmp_path / "login.json"
    creds.write_text(json.dumps({"username": "deployer", "password": "pa55-w0rd"}))
    with running_registry(tmp_path / "reg", users={"deployer": "pa55-w0rd"}) as reg:
        pushed = push_files(reg, "models", [(model, ONNX_TYPE)], credentials_file=creds)
        with pytest.raises(DownloadError) as e:
            fetch(art(pushed.artifact(model)), tmp_path / "a.onnx", policy, field="artifacts.onnx")
        assert e.value.field == "artifacts.onnx.url" and not e.value.retryable
        assert "asks for a login and no credentials file is configured" in e.value.reason
        login = FetchPolicy(**{**policy.__dict__, "registry_credentials_file": creds})
        got = fetch(art(pushed.artifact(model)), tmp_path / "b.onnx", login, field="artifacts.onnx")
        assert got.read_bytes() == PAYLOAD
        creds.write_text("{}")
        with pytest.raises(DownloadError) as e:
            fetch(art(pushed.artifact(model)), tmp_path / "c.onnx", login, field="artifacts.onnx")
        assert e.value.field == "deploy.registry_credentials_file" and "pa55" not in e.value.reason


def test_the_credentials_file_comes_from_the_config_and_is_checked_at_load(tmp_path: Path) -> None:
    creds = tmp_path / "login.json"
    creds.write_text('{"username": "u", "password": "secret-value"}')
    cfg = DeployConfig(enabled=True, allow_unsigned=True, registry_credentials_file=creds)
    assert FetchPolicy.from_config(cfg).registry_credentials_file == creds
    assert deploy_file_problems(cfg) == []
    creds.write_text('{"user": "secret-value"}')
    (problem,) = deploy_file_problems(cfg)
    assert problem.startswith(f"deploy.registry_credentials_file: {creds}: must be ")
    assert "secret-value" not in problem
    creds.unlink()
    assert deploy_file_problems(cfg) == [f"deploy.registry_credentials_file: {creds}: no such file"]


def test_a_token_registry_gives_the_blob_to_the_bearer_of_its_token(tmp_path: Path, model: Path,
                                                                    policy: FetchPolicy) -> None:
    """Distribution with `auth: token` (Harbor, GitLab): the manifest's 401 leads to a token for the
    repository's pull scope, and the blob's GET (by the download's own HTTP client) carries it."""
    creds = tmp_path / "login.json"
    creds.write_text(json.dumps({"username": "deployer", "password": "pa55-w0rd"}))
    with running_token_server(tmp_path / "tokens", {"deployer": "pa55-w0rd"}) as tokens, \
            running_registry(tmp_path / "reg", token=tokens) as reg:
        pushed = push_files(reg, "site/models", [(model, ONNX_TYPE)], credentials_file=creds)
        login = FetchPolicy(**{**policy.__dict__, "registry_credentials_file": creds})
        got = fetch(art(pushed.artifact(model)), tmp_path / "m.onnx", login, field="artifacts.onnx")
        assert got.read_bytes() == PAYLOAD
        assert ("deployer", "repository:site/models:pull") in tokens.requests
        with pytest.raises(DownloadError) as e:  # no login: the token server refuses anonymous pulls
            fetch(art(pushed.artifact(model)), tmp_path / "n.onnx", policy, field="artifacts.onnx")
        assert e.value.field == "artifacts.onnx.url" and "token server refused anonymous" in e.value.reason
