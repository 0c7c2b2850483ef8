"""EngineCache: push a built engine as one signed OCI artifact, pull and verify one before loading it.

    cache = EngineCache(parse_cache_url(url), credentials_file=..., ca_file=..., timeout_s=10)
    pulled = cache.pull(key, dest, trust, check)   # None: no artifact under tag `key`
    pushed = cache.push(key, plan, manifest, timing_cache, signer, builder)   # None: the tag exists

A pull downloads into a temp folder next to `dest` (`.NAME.pull-*`; one a killed pull left is removed by
a later pull of the same NAME once an hour old: engines/cache/stale.py) and renames it to `dest` only
after every check held: the OCI manifest's own digest; exactly the engine layers (engines.cache.artifact);
the signature against PlanTrust; the statement's key == the tag and its sha256s == the layers' digests;
each blob's sha256 and size as it arrives; the engine manifest parses, records the same key and the
plan's sha256; then the caller's `check(manifest_path)` (its compatibility check against the live
device). `dest` then holds `engine.plan`, `manifest.json` and `timing.cache` (when the artifact has one).

One EngineCache is used by one thread at a time (its HTTP session is not shared across threads).
A push never replaces a tag: it looks first and returns None when the key is there (two devices pushing
the same key in the same instant both write valid signed artifacts; the build claim makes that rare).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import oras.defaults
import requests
import urllib3

from engines.cache import artifact
from engines.cache.errors import CacheRejected, CacheUnavailable
from engines.cache.ref import CacheRef, tag_problem
from engines.cache.registry import Registry, unavailable
from engines.cache.results import Pulled, Pushed
from engines.cache.signing import PlanSigner, PlanTrust
from engines.cache.stale import pull_leftovers, remove_stale
from engines.errors import ManifestError
from engines.manifest import load_manifest
from engines.store.fsutil import fsync_dir

FILES = {"plan": "engine.plan", "manifest": "manifest.json", "timing_cache": "timing.cache"}
_CHUNK = 1 << 20
MIN_RATE_BPS = 64 * 1024  # slower on average (after timeout_s) and the registry counts as unavailable


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class EngineCache:
    def __init__(
        self,
        ref: CacheRef,
        *,
        credentials_file: Path | None = None,
        ca_file: Path | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        """CacheUnavailable when the credentials file cannot be used (it names the path only)."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.ref = ref
        self.timeout_s = timeout_s
        self._registry = Registry(
            ref, credentials_file=credentials_file, ca_file=ca_file, timeout_s=timeout_s
        )

    def __repr__(self) -> str:
        return f"EngineCache({self.ref})"

    # ---- push ------------------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """Is there a manifest under tag `key`? (CacheUnavailable when the registry cannot tell.)"""
        _check_tag(key)
        url = f"{self._registry.prefix}://{self._registry.get_container(self.ref.target(key)).manifest_url()}"
        # Any manifest kind counts: a tag holding something else is not ours to replace either.
        accept = ", ".join(oras.defaults.default_manifest_accepted_media_types)
        r = self._registry.do_request(url, "HEAD", headers={"Accept": accept})
        if r.status_code in (200, 404):
            return r.status_code == 200
        raise CacheUnavailable(f"{self._registry.where}: answered {r.status_code} to a manifest lookup")

    def push(
        self,
        key: str,
        plan: Path,
        manifest: Path,
        timing_cache: Path | None,
        signer: PlanSigner,
        builder: str,
    ) -> Pushed | None:
        """Push the engine under tag `key`, signed; None when the tag exists (never pushed over).
        ValueError when the engine manifest does not record `key` (every puller would reject it)."""
        t0 = time.monotonic()
        _check_tag(key)
        try:
            recorded = load_manifest(manifest).recorded_key
        except ManifestError as e:
            raise ValueError(str(e)) from None
        if recorded != key:
            raise ValueError(f"manifest {manifest} records key {recorded!r}, not {key!r}")
        if self.exists(key):
            return None
        with tempfile.TemporaryDirectory(prefix="edge-agent-push-") as tmp:
            # What is signed is what is sent: the manifest and the timing cache (rewritten in place by the
            # next build of any model) are pushed from copies; a stored plan is never rewritten.
            manifest = Path(shutil.copyfile(manifest, Path(tmp) / "manifest.json"))
            if timing_cache is not None:
                timing_cache = Path(shutil.copyfile(timing_cache, Path(tmp) / "timing.cache"))
            tc_sha = None if timing_cache is None else _sha256(timing_cache)
            st = artifact.statement(key, builder, _sha256(plan), _sha256(manifest), tc_sha)
            signed = artifact.signature_document(st, signer.key_id, signer.sign(artifact.canonical(st)))
            sig, config = Path(tmp) / "signature.json", Path(tmp) / "config.json"
            sig.write_bytes(signed)
            config.write_bytes(b"{}")
            files = [(plan, artifact.PLAN), (manifest, artifact.MANIFEST), (sig, artifact.SIGNATURE)]
            if timing_cache is not None:
                files.insert(2, (timing_cache, artifact.TIMING_CACHE))
            r = self._oras_push(key, files, config, builder)
            size = sum(p.stat().st_size for p, _ in files)
        return Pushed(r.headers.get("Docker-Content-Digest", ""), size, time.monotonic() - t0)

    def _oras_push(
        self, key: str, files: list[tuple[Path, str]], config: Path, builder: str
    ) -> requests.Response:
        try:
            r: requests.Response = self._registry.push(
                target=self.ref.target(key),
                files=[f"{path}:{media_type}" for path, media_type in files],
                disable_path_validation=True,
                manifest_config=f"{config}:{artifact.CONFIG}",
                manifest_annotations={artifact.ANNOTATION_KEY: key, artifact.ANNOTATION_BUILDER: builder},
                quiet=True,
            )
            return r
        except CacheUnavailable:
            raise
        except requests.RequestException as e:
            raise unavailable(self._registry.where, e, self.timeout_s) from None
        except ValueError as e:  # oras: a 4xx answer ("Issue with URL: reason"; no credential in it)
            raise CacheUnavailable(f"{self._registry.where}: push refused: {str(e)[:200]}") from None
        except (RecursionError, KeyError, TypeError, AttributeError, IndexError) as e:
            # oras reading a registry's junk answer (an error body nested too deep, a missing field)
            raise CacheUnavailable(f"{self._registry.where}: push failed ({type(e).__name__})") from None

    # ---- pull ------------------------------------------------------------------------------------------
    def pull(
        self, key: str, dest: Path, trust: PlanTrust, check: Callable[[Path], None] | None = None
    ) -> Pulled | None:
        """The verified engine under tag `key` in `dest` (replaced whole), or None on a miss.
        CacheUnavailable: the registry cannot be used; CacheRejected: never load what it holds."""
        t0 = time.monotonic()
        _check_tag(key)
        remove_stale(dest.parent, pull_leftovers(dest))  # of a pull of this name killed mid-way
        got = self._oci_manifest(key)
        if got is None:
            return None
        digest, layers = got
        signed = self._verified_statement(key, layers, trust)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))
        try:
            total = layers["signature"].size
            for role in ("plan", "manifest", "timing_cache"):
                if role in layers:
                    total += self._download(layers[role], tmp / FILES[role])
            _check_engine_manifest(key, tmp / FILES["manifest"], layers["plan"].sha256)
            _run_check(check, tmp / FILES["manifest"])
            _replace_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return Pulled(
            plan=dest / FILES["plan"],
            manifest=dest / FILES["manifest"],
            timing_cache=dest / FILES["timing_cache"] if "timing_cache" in layers else None,
            digest=digest,
            bytes=total,
            seconds=time.monotonic() - t0,
            builder=signed.statement["builder"],
            key_id=signed.key_id,
        )

    def _oci_manifest(self, key: str) -> tuple[str, dict[str, artifact.Layer]] | None:
        container = self._registry.get_container(self.ref.target(key))
        url = f"{self._registry.prefix}://{container.manifest_url()}"
        r = self._registry.do_request(url, "GET", headers={"Accept": artifact.OCI_MANIFEST}, stream=True)
        with r:
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                raise CacheUnavailable(f"{self._registry.where}: answered {r.status_code} for tag {key}")
            body = self._read_small(r, artifact.MAX_OCI_MANIFEST, "OCI manifest")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        said = r.headers.get("Docker-Content-Digest")
        if said is not None and said != digest:
            raise CacheRejected(f"OCI manifest of tag {key}: digest {digest}, not the {said[:80]} announced")
        return digest, artifact.parse_oci_manifest(body)

    def _chunks(self, r: requests.Response, size: int) -> Iterator[bytes]:
        """The body as it arrives. A registry that answers but drips (each read within timeout_s) is cut
        off once the body is slower on average than MIN_RATE_BPS after the first timeout_s."""
        deadline = time.monotonic() + self.timeout_s + size / MIN_RATE_BPS
        # urllib3 >= 2: read1 returns what has arrived, without waiting for the whole amount.
        read = getattr(r.raw, "read1", None) or r.raw.read
        try:
            while True:
                data = read(64 << 10, decode_content=True)
                if not data:
                    return
                yield data
                if time.monotonic() > deadline:
                    raise CacheUnavailable(
                        f"{self._registry.where}: too slow (under {MIN_RATE_BPS // 1024} KiB/s on average)"
                    )
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            raise unavailable(self._registry.where, e, self.timeout_s) from None

    def _read_small(self, r: requests.Response, limit: int, what: str) -> bytes:
        data = bytearray()
        for chunk in self._chunks(r, limit):
            data += chunk
            if len(data) > limit:
                raise CacheRejected(f"{what}: larger than {limit} bytes")
        return bytes(data)

    def _blob(self, layer: artifact.Layer) -> requests.Response:
        r: requests.Response = self._registry.get_blob(self.ref.name, layer.digest, stream=True)
        if r.status_code != 200:
            r.close()
            if r.status_code == 404:
                raise CacheRejected(f"{layer.role} blob {layer.digest} is missing from the registry")
            where = self._registry.where
            raise CacheUnavailable(f"{where}: answered {r.status_code} for a {layer.role} blob")
        return r

    def _verified_statement(
        self, key: str, layers: dict[str, artifact.Layer], trust: PlanTrust
    ) -> artifact.Signed:
        sig = layers["signature"]
        with self._blob(sig) as r:
            data = self._read_small(r, artifact.MAX_SIZE["signature"], "signature layer")
        if hashlib.sha256(data).hexdigest() != sig.sha256:
            raise CacheRejected("signature layer: sha256 does not match its digest (tampered)")
        signed = artifact.parse_signature(data)
        trust.verify(signed.key_id, signed.statement_bytes, signed.signature)
        st = signed.statement
        if st["key"] != key:
            raise CacheRejected(f"signed for key {st['key']}, found under tag {key}")
        for role in ("plan", "manifest", "timing_cache"):
            want = st[f"{role}_sha256"]
            have = layers[role].sha256 if role in layers else None
            if want != have:
                raise CacheRejected(f"{role} layer is not the one signed (sha256 {have} != signed {want})")
        return signed

    def _download(self, layer: artifact.Layer, path: Path) -> int:
        """Stream one blob into `path`, checking its size and sha256 as it arrives; the bytes written."""
        h, n = hashlib.sha256(), 0
        with self._blob(layer) as r, open(path, "wb") as f:
            for chunk in self._chunks(r, layer.size):
                n += len(chunk)
                if n > layer.size:
                    raise CacheRejected(f"{layer.role} blob: more than its {layer.size} bytes (tampered)")
                h.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if n != layer.size or h.hexdigest() != layer.sha256:
            raise CacheRejected(f"{layer.role} blob: sha256 or size does not match its digest (tampered)")
        return n


def _check_tag(key: str) -> None:
    problem = tag_problem(key)
    if problem is not None:
        raise ValueError(f"key {key[:140]!r}: {problem}")


def _check_engine_manifest(key: str, path: Path, plan_sha256: str) -> None:
    try:
        m = load_manifest(path)
    except ManifestError as e:
        raise CacheRejected(str(e).replace(str(path), "the pulled manifest")[:300]) from None
    if m.recorded_key != key:
        raise CacheRejected(f"the pulled manifest records key {m.recorded_key!r}, not the tag {key}")
    if m.build.plan_sha256 != plan_sha256:
        raise CacheRejected("the pulled manifest describes another plan (build.plan_sha256 differs)")


def _run_check(check: Callable[[Path], None] | None, manifest: Path) -> None:
    if check is None:
        return
    try:
        check(manifest)
    except CacheRejected:
        raise
    except Exception as e:
        reason = getattr(e, "reason", None) or str(e) or type(e).__name__
        raise CacheRejected(f"does not fit this device: {str(reason)[:300]}") from None


def _replace_dir(tmp: Path, dest: Path) -> None:
    """`tmp` becomes `dest` by a rename (a reader never sees half an engine); an old `dest` goes first."""
    if dest.exists() or dest.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / "engine")
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, dest)
    with contextlib.suppress(OSError):
        fsync_dir(dest.parent)
