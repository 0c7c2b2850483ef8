"""The engine cache as the configuration says now: made from `engines` (agent.config.engines) when a build
asks for it, made again after a reload changed the section (every key is LIVE), None without a cache.

    setup = CacheSetup(lambda: manager.cfg)
    shared = setup()            # a SharedCache (agent.lifecycle.shared_cache) or None
    setup.close()               # releases the build claims still held, disconnects them

The build claims take a connection of their own to the agent's broker (agent.fleet.claims); without MQTT
every device builds what it misses (nobody to agree with), and so does a device that does not push. A
section that cannot be used (a key file gone since the config was loaded) leaves the builds local, said
once per section.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agent.config import AgentConfig
from agent.fleet.claims import BuildClaims
from agent.lifecycle.shared_cache import NoClaims, SharedCache
from engines.cache.errors import CacheError
from engines.cache.ref import parse_cache_url
from engines.cache.signing import PlanSigner, PlanTrust

# The daemon's log names the engine manager for every line of its lifecycle.
log = logging.getLogger("agent.lifecycle.manager")


def make_shared(cfg: AgentConfig) -> SharedCache:
    """The SharedCache of `cfg` (its `engines.cache` set). ValueError / CacheError naming what is unusable
    (a path, a key id; never what a file holds)."""
    from engines.cache.client import EngineCache  # oras and requests: loaded only where a cache is set

    e = cfg.engines
    assert e.cache is not None
    ref = parse_cache_url(e.cache)
    cache = EngineCache(ref, credentials_file=e.credentials_file, ca_file=e.ca_file, timeout_s=e.timeout_s)
    trust = PlanTrust.from_files(e.trusted_keys)
    signer = None
    if e.push and e.signing_key is not None and e.signing_key_id is not None:
        signer = PlanSigner.from_file(e.signing_key, e.signing_key_id)
    # A device that does not push claims nothing: the others would wait for an engine that never comes.
    claims: Any = NoClaims()
    if cfg.mqtt.enabled and signer is not None:
        mqtt = cfg.mqtt
        claims = BuildClaims(mqtt, mqtt.prefix, cfg.device_id, ttl_s=e.claim_ttl_s, timeout_s=e.timeout_s)
    return SharedCache(cache, trust, signer, claims, device=cfg.device_id, wait_s=e.claim_wait_s)


class CacheSetup:
    def __init__(self, cfg: Callable[[], AgentConfig]) -> None:
        self._cfg = cfg
        self._lock = threading.Lock()
        self._made_for: Any = None  # (engines, mqtt, device_id) the current one was made from
        self._shared: SharedCache | None = None

    def __call__(self) -> SharedCache | None:
        cfg = self._cfg()
        if cfg.engines.cache is None:
            self.close()
            return None
        made_for = (cfg.engines, cfg.mqtt, cfg.device_id)
        with self._lock:
            if made_for == self._made_for:
                return self._shared
            self._close_locked()
            self._made_for = made_for
            try:
                self._shared = make_shared(cfg)
            except (ValueError, CacheError) as exc:
                reason = exc.reason if isinstance(exc, CacheError) else str(exc)
                log.warning("engine cache not used: %s; engines are built here", reason)
                self._shared = None
            else:
                push = "on" if self._shared.signer is not None else "off"
                log.info("engine cache %s (push %s)", self._shared.cache.ref, push)
            return self._shared

    def close(self) -> None:
        with self._lock:
            self._close_locked()
            self._made_for = None

    def _close_locked(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()  # a job waiting under it ends its wait (agent.lifecycle.cancel)

    def refresh(self) -> None:
        """After a reload: a section that changed is closed now (a wait under it must not outlive it); the
        new one is made at the next build."""
        cfg = self._cfg()
        with self._lock:
            if self._made_for is not None and (cfg.engines, cfg.mqtt, cfg.device_id) != self._made_for:
                self._close_locked()
                self._made_for = None
