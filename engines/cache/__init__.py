"""The fleet's shared engine cache: one signed OCI artifact per compatibility key in a registry the site
already runs (docs/DESIGN.md "Fleet: engine cache, build claims, rollouts").

    ref = parse_cache_url("oci://registry:5000/site/engines")
    cache = EngineCache(ref, credentials_file=..., ca_file=..., timeout_s=10)
    pulled = cache.pull(key, dest, trust, check)        # None: a miss
    pushed = cache.push(key, plan, manifest, timing_cache, signer, builder)   # None: the tag exists

    ref.py       oci:// URLs
    artifact.py  media types, the signed statement, the checks of an OCI manifest
    signing.py   PlanSigner / PlanTrust (ed25519)
    registry.py  the HTTP side (oras-py without its retries, with timeouts and a login)
    client.py    EngineCache: push and verified pull
    stale.py     the temp folders of killed pulls, removed once stale
"""

from __future__ import annotations

from engines.cache.errors import CacheError, CacheRejected, CacheUnavailable
from engines.cache.ref import CacheRef, parse_cache_url

__all__ = ["CacheError", "CacheRef", "CacheRejected", "CacheUnavailable", "parse_cache_url"]
