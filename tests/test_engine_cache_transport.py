"""The engine cache's transport against a real registry: down, slow, TLS with a test CA, htpasswd logins,
and the oci:// URLs and credentials files it accepts. A registry that cannot be used is CacheUnavailable
(the device builds locally) with a reason that names the cause and never a password."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from engine_cache_fixtures import Engine, build_tiny, tiny_onnx
from fixtures_http import make_pki
from fixtures_registry import DockerRegistry, running_registry, running_token_server, slow_proxy

from engines.cache.client import MIN_RATE_BPS, EngineCache
from engines.cache.errors import CacheUnavailable
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust

PASSWORD = "s3cret-Pa55word"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pytest.importorskip("tensorrt_rtx")
    from engines.fingerprint import probe_fingerprint
    from engines.trt import import_trt

    root = tmp_path_factory.mktemp("cache-engine")
    fp = probe_fingerprint(import_trt("tensorrt_rtx"))
    return build_tiny(root / "store", tiny_onnx(root / "tiny.onnx"), fp, "8.6")


@pytest.fixture
def keys() -> tuple[PlanSigner, PlanTrust]:
    private = Ed25519PrivateKey.generate()
    return PlanSigner(private, "dev1"), PlanTrust({"dev1": private.public_key()})


def _round_trip(cache: EngineCache, e: Engine, keys: tuple[PlanSigner, PlanTrust], dest: Path) -> None:
    signer, trust = keys
    assert cache.push(e.key, e.plan, e.manifest, e.timing_cache, signer, "dev-1") is not None
    pulled = cache.pull(e.key, dest, trust)
    assert pulled is not None and pulled.plan.read_bytes() == e.plan.read_bytes()


def test_a_registry_down_is_unavailable_and_back_again(
    registry: DockerRegistry, engine: Engine, keys: tuple[PlanSigner, PlanTrust], tmp_path: Path
) -> None:
    cache = EngineCache(parse_cache_url(registry.url()), timeout_s=5)
    _round_trip(cache, engine, keys, tmp_path / "d")
    registry.stop()
    port = f"127.0.0.1:{registry.port}"
    with pytest.raises(CacheUnavailable, match=f"registry {port}: connection refused"):
        cache.pull(engine.key, tmp_path / "d2", keys[1])
    with pytest.raises(CacheUnavailable, match="connection refused"):
        cache.push(engine.key, engine.plan, engine.manifest, None, keys[0], "dev-1")
    registry.start()  # same port, same storage
    assert cache.pull(engine.key, tmp_path / "d2", keys[1]) is not None


def test_a_slow_registry_is_unavailable_within_the_timeout(
    registry: DockerRegistry, engine: Engine, keys: tuple[PlanSigner, PlanTrust], tmp_path: Path
) -> None:
    with slow_proxy(registry.port, delay_s=60) as port:
        cache = EngineCache(parse_cache_url(f"oci://127.0.0.1:{port}/site/engines"), timeout_s=1)
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailable, match=f"registry 127.0.0.1:{port}: no answer within 1 s"):
            cache.pull(engine.key, tmp_path / "d", keys[1])
        # Bounded by the timeout, not by the registry: far below the proxy's 60 s (no oras retries).
        assert time.monotonic() - t0 < 30
        with pytest.raises(CacheUnavailable, match="no answer within 1 s"):
            cache.push(engine.key, engine.plan, engine.manifest, None, keys[0], "dev-1")
    assert not (tmp_path / "d").exists()


def test_a_dripping_registry_is_cut_off_by_the_minimum_rate(
    registry: DockerRegistry, engine: Engine, keys: tuple[PlanSigner, PlanTrust], tmp_path: Path
) -> None:
    """Every read answers within the timeout, but ~10 KiB/s: the plan would take half a minute. The pull
    stops once the blob is slower on average than MIN_RATE_BPS (after timeout_s)."""
    cache = EngineCache(parse_cache_url(registry.url()), timeout_s=1)
    assert cache.push(engine.key, engine.plan, engine.manifest, None, keys[0], "dev-1") is not None
    assert engine.plan.stat().st_size > 20 * MIN_RATE_BPS // 10  # > 2 s at the minimum rate
    with slow_proxy(registry.port, delay_s=0.05, piece=512) as port:
        dripping = EngineCache(parse_cache_url(f"oci://127.0.0.1:{port}/site/engines"), timeout_s=1)
        with pytest.raises(CacheUnavailable, match=r"too slow \(under 64 KiB/s on average\)"):
            dripping.pull(engine.key, tmp_path / "d", keys[1])
    assert list(tmp_path.iterdir()) == []


def test_tls_with_the_registrys_ca_works_and_without_it_is_refused(
    tmp_path: Path, engine: Engine, keys: tuple[PlanSigner, PlanTrust]
) -> None:
    pki = make_pki(tmp_path / "pki")
    with running_registry(tmp_path / "reg", pki=pki) as reg:
        with_ca = EngineCache(parse_cache_url(reg.url()), ca_file=pki.ca_cert, timeout_s=5)
        _round_trip(with_ca, engine, keys, tmp_path / "d")
        https_no_ca = EngineCache(parse_cache_url(reg.url(query="?plain-http=false")), timeout_s=5)
        with pytest.raises(CacheUnavailable, match=r"TLS certificate not trusted \(give engines.ca_file"):
            https_no_ca.pull(engine.key, tmp_path / "d2", keys[1])
        plain = EngineCache(parse_cache_url(reg.url()), timeout_s=5)  # loopback, no CA: plain HTTP
        with pytest.raises(CacheUnavailable, match="speaks HTTPS"):
            plain.pull(engine.key, tmp_path / "d2", keys[1])
    assert not (tmp_path / "d2").exists()


def _credentials(path: Path, user: str, password: str) -> Path:
    path.write_text(json.dumps({"username": user, "password": password}))
    return path


def test_htpasswd_login_works_and_a_wrong_password_is_named_never_shown(
    tmp_path: Path, engine: Engine, keys: tuple[PlanSigner, PlanTrust]
) -> None:
    with running_registry(tmp_path / "reg", users={"fleet": PASSWORD}) as reg:
        url = parse_cache_url(reg.url())
        good = _credentials(tmp_path / "good.json", "fleet", PASSWORD)
        _round_trip(EngineCache(url, credentials_file=good, timeout_s=5), engine, keys, tmp_path / "d")

        wrong = _credentials(tmp_path / "wrong.json", "fleet", PASSWORD + "x")
        with pytest.raises(CacheUnavailable) as exc:
            EngineCache(url, credentials_file=wrong, timeout_s=5).pull(engine.key, tmp_path / "d2", keys[1])
        assert f"login refused for the user of credentials file {wrong}" in exc.value.reason
        assert PASSWORD not in str(exc.value) and PASSWORD not in repr(exc.value)

        with pytest.raises(CacheUnavailable, match="asks for a login and no credentials file is configured"):
            EngineCache(url, timeout_s=5).pull(engine.key, tmp_path / "d2", keys[1])


def test_a_token_registry_logs_in_through_its_token_server(
    tmp_path: Path, engine: Engine, keys: tuple[PlanSigner, PlanTrust]
) -> None:
    """Distribution with `auth: token` (how Harbor and GitLab registries work): the client fetches a bearer
    token per scope from the realm with the credentials file's login; anonymous pulls where allowed."""
    with running_token_server(tmp_path / "tokens", {"fleet": PASSWORD}, anonymous_pull=True) as tokens, \
            running_registry(tmp_path / "reg", token=tokens) as reg:
        url = parse_cache_url(reg.url())
        good = _credentials(tmp_path / "good.json", "fleet", PASSWORD)
        _round_trip(EngineCache(url, credentials_file=good, timeout_s=5), engine, keys, tmp_path / "d")
        scopes = {scope for user, scope in tokens.requests if user == "fleet"}
        assert scopes == {"repository:site/engines:pull", "repository:site/engines:pull,push"}, scopes

        assert EngineCache(url, timeout_s=5).pull(engine.key, tmp_path / "d2", keys[1]) is not None
        elsewhere = EngineCache(parse_cache_url(reg.url("site/other")), timeout_s=5)  # anonymous: pull only
        with pytest.raises(CacheUnavailable, match=r"without a login \(no credentials file configured\)"):
            elsewhere.push(engine.key, engine.plan, engine.manifest, None, keys[0], "dev-1")

        wrong = _credentials(tmp_path / "wrong.json", "fleet", PASSWORD + "x")
        with pytest.raises(CacheUnavailable, match=f"its token server refused the user of {wrong}") as e:
            EngineCache(url, credentials_file=wrong, timeout_s=5).pull(engine.key, tmp_path / "d3", keys[1])
        assert PASSWORD not in str(e.value)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "no such file"),
        ("user:pass", "not JSON"),
        ('{"username": "a:b", "password": "p"}', "no ':' in the user name"),
        ('{"username": "u", "password": "p", "token": "t"}', 'must be {"username"'),
    ],
)
def test_a_bad_credentials_file_is_unavailable_naming_the_path_only(
    tmp_path: Path, content: str | None, why: str
) -> None:
    path = tmp_path / "creds.json"
    if content is not None:
        path.write_text(content)
    pattern = re.escape(f"credentials file {path}: ") + ".*" + re.escape(why)
    with pytest.raises(CacheUnavailable, match=pattern) as e:
        EngineCache(parse_cache_url("oci://127.0.0.1:5000/site/engines"), credentials_file=path)
    assert "pass" not in e.value.reason.replace("password", "")


@pytest.mark.parametrize(
    ("url", "host", "repository", "http"),
    [
        ("oci://127.0.0.1:5000/site/engines", "127.0.0.1:5000", "site/engines", True),
        ("oci://localhost/engines", "localhost", "engines", True),
        ("oci://[::1]:5000/a/b-c", "[::1]:5000", "a/b-c", True),
        ("oci://127.0.0.1:5000/x?plain-http=false", "127.0.0.1:5000", "x", False),
        ("oci://registry.site.lan:5000/site/engines", "registry.site.lan:5000", "site/engines", False),
        ("oci://10.0.0.5:5000/e?plain-http=true", "10.0.0.5:5000", "e", True),
    ],
)
def test_cache_urls_name_registry_repository_and_transport(
    url: str, host: str, repository: str, http: bool
) -> None:
    ref = parse_cache_url(url)
    assert (ref.registry, ref.repository, ref.uses_http()) == (host, repository, http)
    assert str(ref) == url


def test_a_ca_file_means_https_on_loopback_too() -> None:
    assert not parse_cache_url("oci://127.0.0.1:5000/x").uses_http(Path("/etc/ca.pem"))


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:5000/x", "must be an oci://host:port/repository URL"),
        ("oci://fleet:hunter2@127.0.0.1:5000/x", "credentials do not belong in the URL"),
        ("oci://127.0.0.1:5000", "names no repository"),
        ("oci://127.0.0.1:5000/Site", "OCI name rule"),
        ("oci://127.0.0.1:5000/site:latest", "not a tag or digest"),
        ("oci://127.0.0.1:99999/x", "port must be a number from 1 to 65535"),
        ("oci://bad_host/x", "not a valid host name"),
        ("oci://h/x?insecure=1", "unknown URL option 'insecure'"),
        ("oci://h/x?plain-http=yes", "plain-http must be true or false"),
        ("oci:///x", "names no registry host"),
    ],
)
def test_a_bad_cache_url_names_what_is_wrong_and_never_quotes_it(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as exc:
        parse_cache_url(url)
    assert "hunter2" not in str(exc.value)
