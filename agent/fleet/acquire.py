"""Getting the engine of one compatibility key: from the fleet's cache, or built here (issue 38 items 1-2).

    got = acquire_engine(key, pull=pull, build=build, push=push, claims=claims,
                         wait_s=engines.claim_wait_s, poll_s=5.0, log=log.info)
    got.origin        # "cache" | "built"

Pure orchestration over callables, so every path runs in a test with a real broker and fakes where nothing
real can run (the registry client is engines.cache; the build is the lifecycle's job):

- `pull(key)` -> a `Pulled` (hit: origin "cache") | None (miss); raises CacheUnavailable / CacheRejected.
- `build(key)` -> whatever the build returns (kept in `Acquired.built`); raising ends the acquisition.
- `push(key, built)` -> a `Pushed` | None (the tag exists, or the caller declines: a failed gate);
  raises CacheUnavailable / CacheRejected. Called only after build() returned.
- `claims`: claim/holder/release (agent.fleet.claims.BuildClaims; ClaimsUnavailable from any of them).

The walk: pull; a hit is the answer. A miss: claim. The winner builds, pushes, releases (a failed build
releases too, so a waiter claims next). A waiter pulls every `poll_s` until a hit, until the claim is gone
(it pulls once more, then claims again), or until `wait_s` has passed since it began to wait: then it
builds itself and says so. The registry unavailable (down, slow, refused): build here, said once, no push
(a registry that timed out a pull would time out the push too). A rejected artifact under the key: build
here, never push over it, and no claim (the others reject it too and build for themselves). Claims
unavailable (broker): build here without agreement, said once; the push still happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from agent.fleet.claim_record import ClaimsUnavailable
from engines.cache.errors import CacheError, CacheRejected, CacheUnavailable

B = TypeVar("B")


class Claims(Protocol):
    def claim(self, key: str) -> bool: ...
    def holder(self, key: str) -> str | None: ...
    def release(self, key: str) -> None: ...


@dataclass(frozen=True)
class Acquired(Generic[B]):
    """How the engine of `key` was obtained. `why` (origin "built"): "claimed" (this device won the claim),
    "waited" (waited wait_s for another's build), "unavailable" (registry), "rejected" (what the registry
    holds failed verification), "no claims" (the broker could not agree)."""

    key: str
    origin: str  # "cache" | "built"
    why: str = ""
    waited_s: float = 0.0  # waiting for another device's build
    pull_s: float = 0.0  # every pull, hits and misses
    build_s: float = 0.0
    bytes: int = 0  # pulled (cache) or pushed (built), 0 when nothing moved
    pulled: Any = None  # the Pulled of a hit
    built: B | None = None  # what build() returned
    pushed: Any = None  # the Pushed, None when nothing was pushed
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was said to `log`


@dataclass
class _Walk(Generic[B]):
    key: str
    pull: Callable[[str], Any]
    build: Callable[[str], B]
    push: Callable[[str, B], Any]
    claims: Claims
    clock: Callable[[], float]
    log: Callable[[str], None]
    pull_s: float = 0.0
    waited_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    cache_off: str = ""  # "unavailable" | "rejected" once the registry is out of this acquisition

    def say(self, line: str) -> None:
        self.notes.append(line)
        self.log(line)

    def off(self, why: str, exc: CacheError, doing: str) -> None:
        if not self.cache_off:  # said once: the first reason stands
            self.cache_off = why
            verb = "is unavailable" if why == "unavailable" else "holds a plan that must not be loaded"
            self.say(f"engine cache {verb} ({doing} {self.key}: {exc.reason}); building here")

    def try_pull(self) -> Any:
        """The Pulled of a hit, None for a miss or a registry out of the game (cache_off says which)."""
        if self.cache_off:
            return None
        start = self.clock()
        try:
            return self.pull(self.key)
        except CacheUnavailable as exc:
            self.off("unavailable", exc, "pull")
        except CacheRejected as exc:
            self.off("rejected", exc, "pull")
        finally:
            self.pull_s += self.clock() - start
        return None

    def hit(self, pulled: Any) -> Acquired[B]:
        n = int(getattr(pulled, "bytes", 0) or 0)
        return Acquired(
            self.key, "cache", "", self.waited_s, self.pull_s, 0.0, n, pulled, notes=tuple(self.notes)
        )

    def build_here(self, why: str, claimed: bool = False) -> Acquired[B]:
        """Build; push unless the registry is out; release our claim however it ends."""
        start = self.clock()
        try:
            built = self.build(self.key)
            build_s = self.clock() - start
            pushed = None if self.cache_off else self._push(built)
        finally:
            if claimed:
                self._release()
        n = int(getattr(pushed, "bytes", 0) or 0)
        fields = (self.waited_s, self.pull_s, build_s, n, None, built, pushed, tuple(self.notes))
        return Acquired(self.key, "built", why, *fields)

    def _push(self, built: B) -> Any:
        try:
            return self.push(self.key, built)
        except CacheUnavailable as exc:
            self.off("unavailable", exc, "push")
        except CacheRejected as exc:  # the registry refused what we built: ours stays here
            self.say(f"engine cache refused the push of {self.key} ({exc.reason})")
        return None

    def _release(self) -> None:
        try:
            self.claims.release(self.key)
        except ClaimsUnavailable as exc:  # it expires by itself
            self.say(f"build claim {self.key}: release failed ({exc})")


def acquire_engine(
    key: str,
    *,
    pull: Callable[[str], Any],
    build: Callable[[str], B],
    push: Callable[[str, B], Any],
    claims: Claims,
    wait_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
) -> Acquired[B]:
    """The engine of `key`, from the cache or built here (module docstring). Raises only what build() raises
    (after releasing the claim) and what sleep() raises: how a waiter is cancelled (it holds no claim)."""
    if not poll_s > 0 or wait_s < 0:
        raise ValueError("acquire_engine: poll_s must be > 0 and wait_s >= 0")
    walk = _Walk(key, pull, build, push, claims, clock, log)
    began: float | None = None  # when this device began to wait for another's build
    while True:
        pulled = walk.try_pull()
        if pulled is not None:
            return walk.hit(pulled)
        if walk.cache_off:
            return walk.build_here(walk.cache_off)
        try:
            if claims.claim(key):
                return walk.build_here("claimed", claimed=True)
            holder = claims.holder(key)
        except ClaimsUnavailable as exc:
            walk.say(f"build claims unavailable ({exc}); building {key} here without agreement")
            return walk.build_here("no claims")
        began = clock() if began is None else began
        walk.say(f"{holder or 'another device'} builds {key}; waiting up to {wait_s:.0f} s for its push")
        outcome = _wait(walk, began, wait_s, poll_s, sleep)
        if outcome is not None:
            return outcome


def _wait(
    walk: _Walk[B], began: float, wait_s: float, poll_s: float, sleep: Callable[[float], None]
) -> Acquired[B] | None:
    """Poll while another device holds the claim: an Acquired (hit, or built after wait_s), or None when the
    claim is gone (the caller pulls once more and claims again)."""
    while True:
        walk.waited_s = walk.clock() - began
        if walk.waited_s >= wait_s:
            walk.say(
                f"waited {walk.waited_s:.0f} s for the build of {walk.key} by another device; building here"
            )
            return walk.build_here("waited")
        sleep(min(poll_s, max(0.0, wait_s - walk.waited_s)))
        pulled = walk.try_pull()
        walk.waited_s = walk.clock() - began
        if pulled is not None:
            return walk.hit(pulled)
        if walk.cache_off:
            return walk.build_here(walk.cache_off)
        try:
            holder = walk.claims.holder(walk.key)
        except ClaimsUnavailable as exc:
            walk.say(f"build claims unavailable ({exc}); building {walk.key} here without agreement")
            return walk.build_here("no claims")
        if holder is None:
            return None
