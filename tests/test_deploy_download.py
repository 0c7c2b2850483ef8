"""agent.deploy.download against a real nginx (HTTPS with a test CA, plain HTTP) and a Python fault server:
every refusal has a named reason without the URL's credentials, leaves nothing behind but a resumable
.part where resuming makes sense, and a resumed download (after a drop, a restart, a server that ignores
Range) produces the right file."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_http import NGINX, FaultServer, FaultState, Nginx, Pki, make_pki, running_faults, running_nginx

from agent.config.deploy import DeployConfig
from agent.deploy import download
from agent.deploy.document import Artifact
from agent.deploy.download import DownloadCancelled, FetchPolicy, fetch
from agent.deploy.errors import DownloadError

PAYLOAD = random.Random(37).randbytes(300_000)
PASSWORD, TOKEN = "s3cr3t-pass", "tok-9f8e7d6c"
CREDS = f"deploy:{PASSWORD}@"
QUERY = f"?token={TOKEN}"


def artifact(url: str, data: bytes = PAYLOAD, size: int | None = None, sha: str | None = None) -> Artifact:
    return Artifact(url=url, sha256=sha or hashlib.sha256(data).hexdigest(), size=size or len(data))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Nginx]:
    if NGINX is None:
        pytest.skip("needs nginx (apt-get install nginx-light; .ci/run installs it)")
    root = tmp_path_factory.mktemp("www")
    (root / "private").mkdir()
    (root / "model.onnx").write_bytes(PAYLOAD)
    (root / "private" / "model.onnx").write_bytes(PAYLOAD)
    (root / "big.onnx").write_bytes(PAYLOAD * 8)  # 2.4 MB: more than the small filesystem holds
    with running_nginx(tmp_path_factory.mktemp("nginx"), root, pki, {"deploy": PASSWORD}) as server:
        yield server


@pytest.fixture
def faults(pki: Pki) -> Iterator[FaultServer]:
    with running_faults(FaultState(PAYLOAD), pki.server_context()) as server:
        yield server


@pytest.fixture
def policy(pki: Pki) -> FetchPolicy:
    return FetchPolicy(allow_http=False, ca_file=pki.ca_cert, max_bytes=10 << 20, connect_timeout_s=2.0,
                       read_timeout_s=2.0, retries=3, backoff_s=0.01, reserve_bytes=0)


def with_(policy: FetchPolicy, **changes: object) -> FetchPolicy:
    return FetchPolicy(**{**policy.__dict__, **changes})  # type: ignore[arg-type]


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    (tmp_path / "staging").mkdir()
    return tmp_path / "staging" / "model.onnx"


def left(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir())


def refused(caplog: pytest.LogCaptureFixture, art: Artifact, dest: Path, policy: FetchPolicy,
            **kw: object) -> DownloadError:
    """fetch must fail; the reason, the field and the logs never hold the URL's password or token."""
    caplog.set_level(logging.DEBUG, logger="agent.deploy")
    with pytest.raises(DownloadError) as info:
        fetch(art, dest, policy, field="artifacts.onnx", **kw)  # type: ignore[arg-type]
    exc = info.value
    for text in (str(exc), exc.reason, caplog.text, repr(exc.args)):
        assert PASSWORD not in text and TOKEN not in text, text
    assert exc.field is not None and exc.field.startswith("artifacts.onnx.")
    assert str(exc).startswith("download of "), str(exc)
    return exc


# -- nginx: the happy paths, TLS, auth and resume --------------------------------------------------------
def test_https_with_a_private_ca_gives_the_file_and_reports_progress(nginx: Nginx, policy: FetchPolicy,
                                                                      dest: Path) -> None:
    seen: list[tuple[int, int]] = []
    out = fetch(artifact(nginx.url("model.onnx", auth=CREDS, query=QUERY)), dest, policy,
                progress=lambda done, total: seen.append((done, total)))
    assert out == dest and dest.read_bytes() == PAYLOAD
    assert left(dest) == ["model.onnx"]
    assert seen[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) < 20


def test_basic_auth_from_the_url_and_a_wrong_password_refused_without_showing_it(
    nginx: Nginx, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fetch(artifact(nginx.url("private/model.onnx", auth=CREDS)), dest, policy)
    assert dest.read_bytes() == PAYLOAD
    assert 'user="deploy"' in nginx.requests()[-1]
    dest.unlink()
    wrong = "deploy:wr0ng-pass-7@"
    exc = refused(caplog, artifact(nginx.url("private/model.onnx", auth=wrong, query=QUERY)), dest, policy)
    assert "401" in exc.reason and "wr0ng-pass-7" not in exc.reason and not exc.retryable
    assert left(dest) == []


def test_plain_http_only_where_allowed(nginx: Nginx, policy: FetchPolicy, dest: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    before = len(nginx.requests())
    art = artifact(nginx.url("model.onnx", tls=False, auth=CREDS, query=QUERY))
    exc = refused(caplog, art, dest, policy)
    assert "http:// refused" in exc.reason and exc.field == "artifacts.onnx.url"
    assert len(nginx.requests()) == before  # refused before any connection
    fetch(art, dest, with_(policy, allow_http=True))
    assert dest.read_bytes() == PAYLOAD


def test_a_server_unknown_to_the_system_cas_is_refused(nginx: Nginx, policy: FetchPolicy, dest: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    exc = refused(caplog, artifact(nginx.url("model.onnx", auth=CREDS, query=QUERY)), dest,
                  with_(policy, ca_file=None))
    assert "TLS certificate of 127.0.0.1 refused" in exc.reason and not exc.retryable
    assert left(dest) == []


def test_404_is_final_at_once(nginx: Nginx, policy: FetchPolicy, dest: Path,
                              caplog: pytest.LogCaptureFixture) -> None:
    exc = refused(caplog, artifact(nginx.url("gone.onnx", auth=CREDS, query=QUERY)), dest, policy)
    assert "404" in exc.reason and not exc.retryable
    assert sum("/gone.onnx" in line for line in nginx.requests()) == 1  # no retry of a 4xx
    assert left(dest) == []


def test_a_restart_resumes_the_part_with_range(nginx: Nginx, policy: FetchPolicy, dest: Path) -> None:
    dest.with_name("model.onnx.part").write_bytes(PAYLOAD[:100_000])  # what a killed process left
    fetch(artifact(nginx.url("model.onnx")), dest, policy)
    assert dest.read_bytes() == PAYLOAD and left(dest) == ["model.onnx"]
    last = nginx.requests()[-1]
    assert last.startswith('206 "GET /model.onnx') and 'range="bytes=100000-"' in last


def test_a_part_longer_than_the_artifact_or_complete_but_wrong_is_started_over(
    nginx: Nginx, policy: FetchPolicy, dest: Path
) -> None:
    part = dest.with_name("model.onnx.part")
    for stale in (PAYLOAD + b"more", b"\0" * len(PAYLOAD)):
        part.write_bytes(stale)
        fetch(artifact(nginx.url("model.onnx")), dest, policy)
        assert dest.read_bytes() == PAYLOAD and left(dest) == ["model.onnx"]
        assert nginx.requests()[-1].startswith('200 "GET /model.onnx') and 'range="-"' in nginx.requests()[-1]
        dest.unlink()


def test_sha256_mismatch_leaves_nothing(nginx: Nginx, policy: FetchPolicy, dest: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    url = nginx.url("model.onnx", auth=CREDS, query=QUERY)
    exc = refused(caplog, artifact(url, sha="ab" * 32), dest, policy)
    assert "sha256 mismatch" in exc.reason and exc.field == "artifacts.onnx.sha256" and not exc.retryable
    assert left(dest) == []


def test_a_size_other_than_the_documents_or_over_the_cap_is_refused(
    nginx: Nginx, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = nginx.url("model.onnx", auth=CREDS, query=QUERY)
    exc = refused(caplog, artifact(url, size=len(PAYLOAD) + 10), dest, policy)
    assert "announces 300000 bytes, 300010 expected" in exc.reason and exc.field == "artifacts.onnx.size"
    assert left(dest) == []
    before = len(nginx.requests())
    exc = refused(caplog, artifact(url), dest, with_(policy, max_bytes=len(PAYLOAD) - 1))
    assert "over the cap" in exc.reason and len(nginx.requests()) == before
    assert left(dest) == []


def test_cancel_between_reads_keeps_the_part_for_a_resume(nginx: Nginx, policy: FetchPolicy,
                                                          dest: Path) -> None:
    cancel = threading.Event()
    with pytest.raises(DownloadCancelled, match="cancelled"):
        fetch(artifact(nginx.url("big.onnx"), PAYLOAD * 8), dest, policy, cancel=cancel,
              progress=lambda done, total: cancel.set())
    part = dest.with_name("model.onnx.part")
    assert left(dest) == ["model.onnx.part"] and 0 < part.stat().st_size < len(PAYLOAD) * 8
    fetch(artifact(nginx.url("big.onnx"), PAYLOAD * 8), dest, policy)
    assert dest.read_bytes() == PAYLOAD * 8


# -- disk full: a real small filesystem where this machine lets us mount one ------------------------------
@contextlib.contextmanager
def small_filesystem(where: Path) -> Iterator[bool]:
    """A 1 MiB tmpfs at `where` (True), or False where mounting is not permitted."""
    where.mkdir()
    mount = shutil.which("mount")
    proc = subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                          check=False) if mount else None
    mounted = proc is not None and proc.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def test_not_enough_space_is_refused_before_any_request(nginx: Nginx, policy: FetchPolicy, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with small_filesystem(tmp_path / "small") as mounted:
        dest = tmp_path / "small" / "model.onnx"
        # Without a small filesystem: the reserve asks for more than the real one has free.
        pol = policy if mounted else with_(policy, reserve_bytes=shutil.disk_usage(tmp_path).free)
        before = len(nginx.requests())
        art = artifact(nginx.url("big.onnx", auth=CREDS, query=QUERY), PAYLOAD * 8)
        exc = refused(caplog, art, dest, pol)
        assert "not enough space" in exc.reason and not exc.retryable
        assert len(nginx.requests()) == before and left(dest) == []


def fake_enospc_write(out: object, data: bytes) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_the_download_removes_the_part(nginx: Nginx, policy: FetchPolicy, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with small_filesystem(tmp_path / "small") as mounted:
        dest = tmp_path / "small" / "model.onnx"

        def fill(done: int, total: int) -> None:  # once the download runs, something else takes the space
            with contextlib.suppress(OSError), (dest.parent / "other").open("ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)

        if not mounted:
            monkeypatch.setattr(download, "_write_chunk", fake_enospc_write)
        exc = refused(caplog, artifact(nginx.url("model.onnx", auth=CREDS, query=QUERY)), dest, policy,
                      progress=fill)
        assert "disk full" in exc.reason and not exc.retryable
        assert "model.onnx.part" not in left(dest) and "model.onnx" not in left(dest)


# -- the fault server ----------------------------------------------------------------------------------
def test_500_is_retried_until_it_serves_and_given_up_after_the_retries(
    faults: FaultServer, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fetch(artifact(faults.url("flaky", auth=CREDS, query=QUERY)), dest, policy)  # 2 x 500, then the file
    assert dest.read_bytes() == PAYLOAD and faults.state.counts["flaky"] == 3
    dest.unlink()
    faults.state.fail_times, faults.state.counts["flaky"] = 10, 0
    exc = refused(caplog, artifact(faults.url("flaky", auth=CREDS, query=QUERY)), dest, policy)
    assert "500" in exc.reason and "gave up after 4 attempts" in exc.reason and exc.retryable
    assert faults.state.counts["flaky"] == 4 and "retrying" in caplog.text


def test_a_drop_mid_body_resumes_with_range(faults: FaultServer, policy: FetchPolicy, dest: Path) -> None:
    fetch(artifact(faults.url("drop-once", auth=CREDS, query=QUERY)), dest, policy)
    assert dest.read_bytes() == PAYLOAD and left(dest) == ["model.onnx"]
    assert [s.headers.get("Range") for s in faults.state.seen] == [None, f"bytes={len(PAYLOAD) // 3}-"]


def test_a_body_always_truncated_keeps_a_resumable_part_that_a_restart_completes(
    faults: FaultServer, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    exc = refused(caplog, artifact(faults.url("truncate", auth=CREDS, query=QUERY)), dest, policy)
    assert "connection closed after" in exc.reason and exc.retryable
    part = dest.with_name("model.onnx.part")
    have = part.stat().st_size
    assert left(dest) == ["model.onnx.part"] and part.read_bytes() == PAYLOAD[:have]
    fetch(artifact(faults.url("ok")), dest, policy)  # a new process, the server fixed
    assert dest.read_bytes() == PAYLOAD and faults.state.seen[-1].headers["Range"] == f"bytes={have}-"


def test_a_process_killed_mid_download_is_resumed_by_the_next(faults: FaultServer, pki: Pki,
                                                             dest: Path) -> None:
    faults.state.drip_s, faults.state.drip_for_s = 0.005, 30.0
    code = (
        "import sys; from pathlib import Path; from agent.deploy.download import FetchPolicy, fetch;"
        "from agent.deploy.document import Artifact;"
        "a = Artifact(url=sys.argv[1], sha256=sys.argv[2], size=int(sys.argv[3]));"
        "fetch(a, Path(sys.argv[4]), FetchPolicy(False, Path(sys.argv[5]), 1 << 30, 5.0, 5.0))"
    )
    url = faults.url("drip", auth=CREDS, query=QUERY)
    args = [url, hashlib.sha256(PAYLOAD).hexdigest(), str(len(PAYLOAD)), str(dest), str(pki.ca_cert)]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=root)
    part = dest.with_name("model.onnx.part")
    try:
        deadline = time.monotonic() + 20
        while not (part.exists() and part.stat().st_size >= 50) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait(5)
    have = part.stat().st_size
    assert have >= 50 and part.read_bytes() == PAYLOAD[:have]
    fetch(artifact(faults.url("ok")), dest, policy=FetchPolicy(False, pki.ca_cert, 1 << 30, 5.0, 5.0))
    assert dest.read_bytes() == PAYLOAD and left(dest) == ["model.onnx"]
    assert faults.state.seen[-1].headers["Range"] == f"bytes={have}-"


@pytest.mark.parametrize(("mode", "says"), [("long-length", "announces 301000 bytes, 300000 expected"),
                                            ("short-length", "announces 299000 bytes, 300000 expected"),
                                            ("no-length-long", "longer than the 300000 bytes")])
def test_a_wrong_length_is_refused_and_leaves_nothing(
    faults: FaultServer, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture, mode: str,
    says: str,
) -> None:
    exc = refused(caplog, artifact(faults.url(mode, auth=CREDS, query=QUERY)), dest, policy)
    assert says in exc.reason and exc.field == "artifacts.onnx.size" and not exc.retryable
    assert left(dest) == [] and faults.state.counts[mode] == 1


def test_a_slow_drip_ends_by_the_stall_rule(faults: FaultServer, policy: FetchPolicy, dest: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    faults.state.drip_s = 0.3  # a byte every 0.3 s: each read comes well within the 1 s read timeout
    exc = refused(caplog, artifact(faults.url("drip", auth=CREDS, query=QUERY)), dest,
                  with_(policy, read_timeout_s=1.0, retries=0))
    assert "stalled" in exc.reason and exc.retryable
    part = dest.with_name("model.onnx.part").read_bytes()  # a drip may be resumed later: the part stays
    assert left(dest) == ["model.onnx.part"] and 0 < len(part) < 20 and part == PAYLOAD[: len(part)]


def test_headers_dripped_end_by_the_answer_deadline(faults: FaultServer, policy: FetchPolicy, dest: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    faults.state.drip_s = 0.2
    exc = refused(caplog, artifact(faults.url("drip-headers", auth=CREDS, query=QUERY)), dest,
                  with_(policy, read_timeout_s=1.0, retries=0))
    assert "no complete answer within 1 s" in exc.reason and exc.retryable and left(dest) == []


def test_a_server_that_never_answers_times_out(faults: FaultServer, policy: FetchPolicy, dest: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    exc = refused(caplog, artifact(faults.url("hang", auth=CREDS, query=QUERY)), dest,
                  with_(policy, read_timeout_s=0.5, retries=1))
    assert "no complete answer within 0.5 s" in exc.reason and "gave up after 2 attempts" in exc.reason
    assert faults.state.counts["hang"] == 2


def test_a_redirect_off_https_is_refused(faults: FaultServer, policy: FetchPolicy, dest: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    exc = refused(caplog, artifact(faults.url("to-http", auth=CREDS, query=QUERY)), dest,
                  with_(policy, allow_http=True))
    assert "changes the scheme (https -> http)" in exc.reason and not exc.retryable
    assert left(dest) == [] and "ok" not in faults.state.counts


def test_a_redirect_to_another_host_is_refused_unless_allowed_and_then_gets_no_credentials(
    faults: FaultServer, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    art = artifact(faults.url("to-other-host", auth=CREDS, query=QUERY))
    exc = refused(caplog, art, dest, policy)
    assert "redirect to another host refused (https://localhost:" in exc.reason and left(dest) == []
    fetch(art, dest, with_(policy, follow_other_hosts=True))
    assert dest.read_bytes() == PAYLOAD
    first, last = faults.state.seen[-2], faults.state.seen[-1]
    assert first.headers.get("Authorization", "").startswith("Basic ")
    assert last.headers["Host"].startswith("localhost:") and "Authorization" not in last.headers


def test_redirects_on_the_same_host_are_followed_but_not_forever(
    faults: FaultServer, policy: FetchPolicy, dest: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fetch(artifact(faults.url("to-same", auth=CREDS, query=QUERY)), dest, policy)
    assert dest.read_bytes() == PAYLOAD and "Authorization" in faults.state.seen[-1].headers
    dest.unlink()
    exc = refused(caplog, artifact(faults.url("loop", auth=CREDS, query=QUERY)), dest, policy)
    assert "more than 5 redirects" in exc.reason and faults.state.counts["loop"] == 6
    assert left(dest) == []


def test_a_200_to_a_range_request_restarts_from_zero(faults: FaultServer, policy: FetchPolicy,
                                                     dest: Path) -> None:
    fetch(artifact(faults.url("ignore-range")), dest, policy)
    assert dest.read_bytes() == PAYLOAD
    assert [s.headers.get("Range") for s in faults.state.seen] == [None, f"bytes={len(PAYLOAD) // 2}-"]


def test_a_206_from_the_wrong_offset_restarts_from_zero(faults: FaultServer, policy: FetchPolicy,
                                                        dest: Path) -> None:
    fetch(artifact(faults.url("wrong-start")), dest, policy)
    assert dest.read_bytes() == PAYLOAD
    assert [s.headers.get("Range") for s in faults.state.seen] == [None, f"bytes={len(PAYLOAD) // 2}-", None]


def test_a_certificate_for_another_name_is_refused(pki: Pki, policy: FetchPolicy, dest: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with running_faults(FaultState(PAYLOAD), pki.server_context(other_name=True)) as wrong:
        exc = refused(caplog, artifact(wrong.url("ok", auth=CREDS, query=QUERY)), dest, policy)
        assert "TLS certificate of 127.0.0.1 refused" in exc.reason and "mismatch" in exc.reason.lower()
        assert not exc.retryable and "ok" not in wrong.state.counts and left(dest) == []


def test_the_policy_comes_from_the_deploy_config() -> None:
    cfg = DeployConfig(allow_http=True, max_artifact_mb=1.5, connect_timeout_s=3.0, read_timeout_s=4.0)
    pol = FetchPolicy.from_config(cfg, retries=2)
    got = (pol.allow_http, pol.ca_file, pol.max_bytes, pol.connect_timeout_s, pol.read_timeout_s, pol.retries)
    assert got == (True, None, 1_572_864, 3.0, 4.0, 2)
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        with_(pol, read_timeout_s=0.0)
