"""A pull killed mid-way (a real process, killed while a real registry drips the plan to it) leaves its temp
folder next to the destination; a later pull of the same name removes it once nothing has written to it
for an hour, and never a folder a live pull is still writing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from engine_cache_fixtures import push_raw, signed_layers
from fixtures_registry import (
    DockerRegistry,
    registry,  # noqa: F401  (the fixture)
    slow_proxy,
)

from engines.cache.client import EngineCache
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust
from engines.cache.stale import STALE_S, remove_stale

KEY = "0123456789abcdef"
PULL = """
import sys
from pathlib import Path
from engines.cache.client import EngineCache
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanTrust
url, pub, dest = sys.argv[1:]
EngineCache(parse_cache_url(url), timeout_s=600).pull(
    "0123456789abcdef", Path(dest), PlanTrust.from_files({"dev1": Path(pub)}))
"""


def _age(folder: Path, seconds: float) -> None:
    """Every mtime in `folder` (and its own) set `seconds` into the past."""
    then = time.time() - seconds
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then))
    os.utime(folder, (then, then))


def test_a_killed_pull_leaves_its_folder_and_a_later_pull_of_the_name_removes_it_once_stale(
    registry: DockerRegistry, tmp_path: Path  # noqa: F811
) -> None:
    key = Ed25519PrivateKey.generate()
    signer = PlanSigner(key, "dev1")
    pub = tmp_path / "dev1.pub"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    plan = os.urandom(2 << 20)
    push_raw(registry, KEY, signed_layers(KEY, plan, b"{}", signer), tmp_path / "raw")
    dest = tmp_path / "store" / "engine"
    repo = Path(__file__).resolve().parents[1]
    with slow_proxy(registry.port, delay_s=0.05, piece=4096) as port:  # ~80 KB/s: the plan takes 25 s
        url = f"oci://127.0.0.1:{port}/site/engines"
        proc = subprocess.Popen([sys.executable, "-c", PULL, url, str(pub), str(dest)], cwd=repo)
        try:
            deadline = time.monotonic() + 60
            while not any(p.stat().st_size for p in dest.parent.glob(".engine.pull-*/engine.plan")):
                assert proc.poll() is None and time.monotonic() < deadline, "the pull never started its plan"
                time.sleep(0.1)
        finally:
            proc.kill()
            proc.wait()
    (left,) = dest.parent.glob(".engine.pull-*")
    assert (left / "engine.plan").stat().st_size < len(plan)  # killed mid-blob

    cache = EngineCache(parse_cache_url(registry.url()), timeout_s=10)
    trust = PlanTrust({"dev1": key.public_key()})
    assert cache.pull("fedcba9876543210", dest, trust) is None  # a miss, after looking for leftovers
    assert left.exists()  # written to a moment ago: it could be another process's live pull
    _age(left, STALE_S + 60)
    assert cache.pull("fedcba9876543210", dest, trust) is None
    assert not left.exists()
    other = dest.parent / ".other.pull-x"  # another name's: not this pull's business
    other.mkdir()
    _age(other, STALE_S + 60)
    cache.pull("fedcba9876543210", dest, trust)
    assert other.exists()


def test_a_folder_is_stale_only_when_nothing_in_it_was_written_lately(tmp_path: Path) -> None:
    # The agent's staging folder of a pull: .cache-pull-X/.engine.pull-Y/engine.plan (lifecycle/shared_cache)
    dead = tmp_path / ".cache-pull-a" / ".engine.pull-b"
    live = tmp_path / ".cache-pull-c" / ".engine.pull-d"
    for folder in (dead, live):
        folder.mkdir(parents=True)
        (folder / "engine.plan").write_bytes(b"part of a plan")
        _age(folder.parent, STALE_S + 60)
    (live / "engine.plan").write_bytes(b"part of a plan, growing")  # a live pull writes its blob
    (tmp_path / ".cache-pull-file").write_text("not a folder")
    os.utime(tmp_path / ".cache-pull-file", (0, 0))
    assert remove_stale(tmp_path, (".cache-pull-*",)) == [dead.parent]
    assert live.exists() and (tmp_path / ".cache-pull-file").exists()
