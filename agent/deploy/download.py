"""Artifact download for deployments: one URL to one verified file, resumable across drops and restarts.

Standard library only (http.client + ssl): a Jetson gets no extra wheel for it, and every socket read is
ours to time out. An ``oci://...@sha256:`` artifact is the same download of its blob, once
agent.deploy.oci_source has resolved the registry's manifest (the only part that needs oras-py).
``fetch`` writes ``<dest>.part`` (kept across drops and process restarts, resumed with ``Range``), hashes
while it writes, and renames to ``dest`` only once size and sha256 agree with the document. URLs may carry
credentials (``user:pass@``, ``?token=``): every reason and log line shows the URL without userinfo and
query, and is scrubbed of the URL's secrets as well.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import logging
import os
import re
import shutil
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from agent.deploy.errors import DownloadError
from agent.deploy.oci_ref import is_oci
from agent.deploy.oci_source import OciSource
from agent.deploy.transport import Opener, Target, parse_target, tls_context
from pipelines.urls import scrubber

if TYPE_CHECKING:
    from agent.config.deploy import DeployConfig

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
_RETRY_STATUS = frozenset({408, 425, 429})  # and every 5xx
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
# An attempt that moved the part forward by this much does not count against `retries`: a long download
# over a link that drops now and then goes on, a server that sends a few bytes per attempt does not.
_REAL_PROGRESS = 1 << 20


class ArtifactRef(Protocol):
    """What ``fetch`` reads of an artifact (agent.deploy.document.Artifact has these)."""

    @property
    def url(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def size(self) -> int: ...


class DownloadCancelled(DownloadError):
    """``cancel`` was set: the part file is kept (the caller decides whether to resume or discard it)."""


@dataclass(frozen=True)
class FetchPolicy:
    """How ``fetch`` may download. The first five come from the ``deploy`` config; the rest have defaults."""

    allow_http: bool
    ca_file: Path | None
    max_bytes: int
    connect_timeout_s: float
    read_timeout_s: float
    # The stall rule: over each read_timeout_s window at least min_rate_bps * read_timeout_s bytes (or the
    # rest of the file) must arrive, else the attempt ends: a server that drips a byte a second never
    # trips a per-read timeout.
    min_rate_bps: int = 1024
    retries: int = 4  # failed attempts in a row (without real progress) before giving up
    max_attempts: int = 30  # all attempts of one call, progress or not
    backoff_s: float = 1.0  # doubled after each failure in a row, up to max_backoff_s
    max_backoff_s: float = 30.0
    max_redirects: int = 5
    follow_other_hosts: bool = False  # https -> https on another host (credentials never forwarded)
    reserve_bytes: int = 16 << 20  # free space left on the filesystem beyond the artifact
    registry_credentials_file: Path | None = None  # the login of oci:// artifacts' registries

    @classmethod
    def from_config(cls, cfg: DeployConfig, **more: Any) -> FetchPolicy:
        """The policy of the ``deploy`` config section (``more``: the defaulted fields, for tests)."""
        max_bytes = int(cfg.max_artifact_mb * (1 << 20))
        return cls(allow_http=cfg.allow_http, ca_file=cfg.ca_file, max_bytes=max_bytes,
                   connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                   registry_credentials_file=cfg.registry_credentials_file, **more)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("FetchPolicy: max_bytes and the timeouts must be > 0")
        if self.retries < 0 or self.max_attempts < 1 or self.max_redirects < 0 or self.reserve_bytes < 0:
            raise ValueError("FetchPolicy: retries, max_redirects, reserve_bytes >= 0 and max_attempts >= 1")


def _write_chunk(out: BinaryIO, data: bytes) -> None:
    """Write all of ``data`` (a raw file may take part of it when the disk fills)."""
    view = memoryview(data)
    while view:
        written = out.write(view)
        view = view[written or 0 :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_of(path: Path, hasher: hashlib._Hash | None = None) -> hashlib._Hash:
    hasher = hasher or hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)
    return hasher


class _Transfer:
    """One fetch: the part file, its running sha256 and the attempts that extend it."""

    def __init__(
        self,
        artifact: ArtifactRef,
        dest: Path,
        policy: FetchPolicy,
        field: str,
        progress: Callable[[int, int], None] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.size, self.sha256 = artifact.size, artifact.sha256.lower()
        self.dest, self.part = dest, dest.with_name(dest.name + ".part")
        self.policy, self.field, self.progress, self.cancel = policy, field, progress, cancel
        self.hasher, self.done, self.reported = hashlib.sha256(), 0, -1
        self.step = max(self.size // 100, CHUNK)
        self.oci: OciSource | None = None
        self.origin: Target | None = None  # an oci:// artifact's: its blob, once resolved (attempt)
        if is_oci(artifact.url):  # no credentials in it; its `host:port/repo@` would pass for a password
            self.scrub = scrubber("")
            self.oci = OciSource.for_fetch(artifact.url, field, policy)
            self.shown, scheme = self.oci.shown, self.oci.scheme
        else:
            self.scrub = scrubber(artifact.url)
            self.origin = self._parse(artifact.url)
            self.shown, scheme = self.origin.shown, self.origin.scheme
        try:
            tls = tls_context(policy.ca_file) if scheme == "https" else None
        except (OSError, ssl.SSLError) as exc:
            what = f"deploy.ca_file {policy.ca_file}: cannot load ({exc})"
            raise DownloadError(what, "deploy.ca_file") from None
        # A registry may redirect a blob to its storage (S3, a CDN): followed, without the registry's login.
        self.opener = Opener(tls, policy.connect_timeout_s, policy.read_timeout_s, policy.max_redirects,
                             policy.follow_other_hosts or self.oci is not None)

    # -- reasons -------------------------------------------------------------------------------------
    def error(self, what: str, *, retryable: bool = False, part: str = "url") -> DownloadError:
        reason = self.scrub(f"download of {self.shown}: {what}")
        return DownloadError(reason, f"{self.field}.{part}", retryable=retryable)

    def _parse(self, url: str) -> Target:
        try:
            target = parse_target(url)
        except ValueError as exc:
            raise DownloadError(f"download: bad URL ({exc})", f"{self.field}.url") from None
        if target.scheme not in ("https", "http"):
            what = "only https:// URLs (http:// where deploy.allow_http is on)"
        elif target.scheme == "http" and not self.policy.allow_http:
            what = "http:// refused (deploy.allow_http is off)"
        else:
            return target
        raise DownloadError(self.scrub(f"download of {target.shown}: {what}"), f"{self.field}.url")

    # -- the part file -------------------------------------------------------------------------------
    def check_size_cap(self) -> None:
        if self.size > self.policy.max_bytes:
            raise self.error(f"size {self.size} over the cap of {self.policy.max_bytes} bytes", part="size")

    def load_part(self) -> None:
        """Resume from an existing part: hash what is there (a part longer than the artifact is dropped)."""
        if not self.part.exists():
            return
        have = self.part.stat().st_size
        if have > self.size:
            log.info("%s: part of %d bytes is longer than the artifact, restarting", self.shown, have)
            return self.restart()
        self.hasher, self.done = _sha256_of(self.part), have
        if have == self.size and self.hasher.hexdigest() != self.sha256:
            log.info("%s: complete part does not match sha256, restarting", self.shown)
            self.restart()

    def restart(self) -> None:
        self.part.parent.mkdir(parents=True, exist_ok=True)
        with self.part.open("wb"):
            pass
        self.hasher, self.done, self.reported = hashlib.sha256(), 0, -1

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)

    def check_space(self) -> None:
        self.part.parent.mkdir(parents=True, exist_ok=True)
        need = self.size - self.done + self.policy.reserve_bytes
        free = shutil.disk_usage(self.part.parent).free
        if free < need:
            raise self.error(
                f"not enough space on {self.part.parent}: {need} bytes needed "
                f"({self.size - self.done} + {self.policy.reserve_bytes} reserve), {free} free",
                part="size",
            )

    # -- one attempt ---------------------------------------------------------------------------------
    def attempt(self) -> None:
        headers = {"Range": f"bytes={self.done}-"} if self.done else {}
        if self.origin is None:  # an oci:// artifact: the manifest by digest, then its layer's blob
            assert self.oci is not None
            self.origin = self.oci.resolve(self.sha256, self.size, self.error)
        conn, resp = self.opener.open(self.origin, headers, self.error)
        try:
            self._check_response(resp)
            self._stream(resp)
        finally:
            conn.close()

    def _check_response(self, resp: http.client.HTTPResponse) -> None:
        status = resp.status
        if status == 200:
            if self.done:
                log.info("%s: the server ignored Range, restarting from 0", self.shown)
                self.restart()
        elif status == 206:
            self._check_content_range(resp.getheader("Content-Range") or "")
        elif status == 416:  # the server's file is shorter than our part: it is not the file we had
            asked = self.done
            self.restart()
            raise self.error(f"range from {asked} not satisfiable, restarting from 0", retryable=True)
        else:
            what = f"the server answered {status} {resp.reason}".rstrip()
            raise self.error(what, retryable=status >= 500 or status in _RETRY_STATUS)
        length = resp.getheader("Content-Length")
        if length is not None:
            expected = self.size - self.done
            if not length.strip().isdigit():
                raise self.error(f"bad Content-Length {length[:40]!r}")
            if int(length) != expected:
                raise self.error(f"the server announces {int(length)} bytes, {expected} expected "
                                 f"(size {self.size} from byte {self.done})", part="size")

    def _check_content_range(self, value: str) -> None:
        m = _CONTENT_RANGE.fullmatch(value.strip())
        if not m:
            raise self.error(f"206 with a bad Content-Range {value[:60]!r}")
        start, total = int(m.group(1)), m.group(3)
        if total != "*" and int(total) != self.size:
            raise self.error(f"the server says {total} bytes, the document {self.size}", part="size")
        if start != self.done:
            asked = self.done
            self.restart()
            raise self.error(f"asked for bytes from {asked}, got from {start}: restarting", retryable=True)

    def _stream(self, resp: http.client.HTTPResponse) -> None:
        window_at, window_done = time.monotonic(), self.done
        window = self.policy.read_timeout_s
        with self.part.open("ab", buffering=0) as out:
            while True:
                if self.cancel is not None and self.cancel.is_set():
                    raise DownloadCancelled(self.scrub(f"download of {self.shown}: cancelled"),
                                            f"{self.field}.url", retryable=False)
                chunk = self._read(resp)
                if not chunk:
                    break
                if self.done + len(chunk) > self.size:
                    raise self.error(f"the body is longer than the {self.size} bytes announced", part="size")
                self._write(out, chunk)
                now = time.monotonic()
                if now - window_at >= window:
                    floor = min(self.policy.min_rate_bps * window, self.size - window_done)
                    if self.done - window_done < floor:
                        got, took = self.done - window_done, now - window_at
                        raise self.error(f"stalled: {got} bytes in {took:.1f} s", retryable=True)
                    window_at, window_done = now, self.done
            os.fsync(out.fileno())
        if self.done < self.size:
            raise self.error(f"connection closed after {self.done} of {self.size} bytes", retryable=True)

    def _read(self, resp: http.client.HTTPResponse) -> bytes:
        try:
            return resp.read1(CHUNK)  # one socket read at most: the read timeout applies to each
        except TimeoutError:
            raise self.error(f"no data for {self.policy.read_timeout_s:g} s after {self.done} bytes",
                             retryable=True) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self.error(f"connection lost after {self.done} of {self.size} bytes ({type(exc).__name__})",
                             retryable=True) from None

    def _write(self, out: BinaryIO, chunk: bytes) -> None:
        try:
            _write_chunk(out, chunk)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self.error(f"disk full writing {self.part.parent} after {self.done} bytes",
                                 part="size") from None
            raise self.error(f"cannot write {self.part}: {exc.strerror or exc}") from None
        self.hasher.update(chunk)
        self.done += len(chunk)
        if self.progress is not None and (self.done - self.reported >= self.step or self.done == self.size):
            self.reported = self.done
            self.progress(self.done, self.size)

    # -- the end -------------------------------------------------------------------------------------
    def finish(self) -> Path:
        digest = self.hasher.hexdigest()
        if self.done != self.size or digest != self.sha256:
            raise self.error(f"sha256 mismatch: got {digest}, the document says {self.sha256}", part="sha256")
        os.replace(self.part, self.dest)
        _fsync_dir(self.dest.parent)
        return self.dest

    def wait(self, seconds: float) -> bool:
        """Sleep between attempts; True when cancelled meanwhile."""
        if self.cancel is not None:
            return self.cancel.wait(seconds)
        time.sleep(seconds)
        return False


def fetch(
    artifact: ArtifactRef,
    dest: Path,
    policy: FetchPolicy,
    *,
    progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
    field: str = "artifact",
) -> Path:
    """Download ``artifact`` to ``dest`` (size and sha256 verified, fsynced, renamed into place).

    ``progress(done, total)`` is called about every 1 % (and at the end). ``field`` prefixes the
    DownloadError's field (``artifacts.onnx`` -> ``artifacts.onnx.sha256``). A retryable error that outlasts
    the retries raises ``DownloadError(retryable=True)`` and keeps ``<dest>.part`` for a later call; every
    other refusal removes it; cancelling raises ``DownloadCancelled`` and keeps it.
    """
    t = _Transfer(artifact, dest, policy, field, progress, cancel)
    try:
        t.check_size_cap()
        if dest.exists() and dest.stat().st_size == t.size and _sha256_of(dest).hexdigest() == t.sha256:
            t.discard()
            return dest  # already fetched (a restart after the rename)
        t.load_part()
        t.check_space()
        return _attempts(t)
    except DownloadCancelled:
        raise
    except OSError as exc:  # the staging folder itself (permissions, a read-only filesystem)
        t.discard()
        raise t.error(f"cannot write {t.part}: {exc.strerror or exc}") from None
    except DownloadError as exc:
        if not getattr(exc, "retryable", False):
            t.discard()
        raise


def _attempts(t: _Transfer) -> Path:
    policy, failures = t.policy, 0
    for attempt in range(1, policy.max_attempts + 1):
        before = t.done
        try:
            if t.done < t.size:
                t.attempt()
            return t.finish()
        except DownloadError as exc:
            if not exc.retryable:
                raise
            failures = 0 if t.done - before >= _REAL_PROGRESS else failures + 1
            if failures > policy.retries or attempt == policy.max_attempts:
                tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                raise DownloadError(f"{exc.reason} (gave up after {tries})", exc.field,
                                    retryable=True) from None
            delay = min(policy.backoff_s * 2 ** max(failures - 1, 0), policy.max_backoff_s)
            log.warning("%s; attempt %d, retrying in %.1f s", exc.reason, attempt, delay)
        if t.wait(delay):
            raise DownloadCancelled(t.scrub(f"download of {t.shown}: cancelled"), f"{t.field}.url",
                                    retryable=False)
    raise AssertionError("unreachable")  # the loop returns or raises
