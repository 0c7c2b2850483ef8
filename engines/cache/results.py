"""What a pull and a push of the engine cache give back: plain records, importable without the registry
client (engines.cache.client loads oras and requests, which an agent without a cache never needs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pulled:
    plan: Path
    manifest: Path
    timing_cache: Path | None
    digest: str  # the OCI manifest's digest (sha256:...)
    bytes: int  # blob bytes downloaded (the OCI manifest aside)
    seconds: float
    builder: str  # the device that built and signed it (from the verified statement)
    key_id: str  # the key that signed it


@dataclass(frozen=True)
class Pushed:
    digest: str
    bytes: int
    seconds: float
