"""Why the shared engine cache could not serve or take a plan.

CacheError            base: `.reason` is one line, safe to log and publish (never a credential)
├── CacheUnavailable  the registry cannot be used now (down, slow, 5xx, TLS or login refused): build here
└── CacheRejected     what the registry holds must never be loaded (digest or sha256 mismatch, unsigned,
                      untrusted key, bad signature, a manifest for another key or device kind)
"""

from __future__ import annotations


class CacheError(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class CacheUnavailable(CacheError):
    """The registry did not answer as a registry should: build locally, say so once."""


class CacheRejected(CacheError):
    """The artifact under the tag fails verification: never load it, never push over it."""
