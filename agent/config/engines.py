"""`engines`: the fleet's shared engine cache (an OCI registry; docs/DESIGN.md "Fleet: engine cache, build
claims, rollouts"). Off unless `cache` names a registry: a config without this section builds every engine
here, as before.

Every key is LIVE: the engine lifecycle reads the section when a build is about to start, so a reload
applies it to the next build (a key removed from trusted_keys is revoked by a SIGHUP; a build under way
keeps what it started with). Files are read at load, as `deploy`'s: an error names the key and the path,
never what a file holds. Registry credentials live in `credentials_file`, never in the URL (a URL is
logged and published).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from agent.config.files import file_problem
from agent.config.impact import Impact
from agent.config.keys import KeyFileError, key_id_problem, public_key_problem, read_private_key
from agent.config.strict import ConfigPath, StrictModel
from engines.cache.errors import CacheUnavailable
from engines.cache.ref import parse_cache_url

MAX_TRUSTED_KEYS = 64
MAX_URL = 1024


def cache_url_problem(url: str) -> str | None:
    """Why `url` cannot name the engine cache, or None. Never quotes the URL: it may hold a password."""
    if len(url) > MAX_URL:
        return f"longer than {MAX_URL} characters"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "oci":
        return "must be an oci://host:port/repository URL"
    if "@" in rest.split("/", 1)[0]:
        return "credentials do not belong in the URL (it is logged): put them in engines.credentials_file"
    try:
        parse_cache_url(url)
    except ValueError as exc:
        return str(exc).replace(url, "the URL")[:300]
    return None


def private_key_problem(path: Path) -> str | None:
    """Why `path` is not a readable unencrypted PEM ed25519 private key, or None (never its content)."""
    try:
        read_private_key(path)
    except KeyFileError as exc:
        return exc.reason.removeprefix(f"private key {path}: ")
    return None


class EnginesConfig(StrictModel):
    # oci://host:port/repository; null: no cache, every engine is built here.
    cache: Annotated[str | None, Impact.LIVE] = None
    # Push what this device built (and its gate passed) for the others; false: pull only.
    push: Annotated[bool, Impact.LIVE] = True
    # The registry's login (engines.cache.registry reads it: the format is in docs/DESIGN.md); never logged.
    credentials_file: Annotated[ConfigPath | None, Impact.LIVE] = None
    ca_file: Annotated[ConfigPath | None, Impact.LIVE] = None  # PEM CA(s) of a registry with its own CA
    # This device's ed25519 private key (PEM, `edge-agent keys generate`) and the id the others trust it as:
    # every pushed plan is signed (a plan is code: an unsigned one is never loaded).
    signing_key: Annotated[ConfigPath | None, Impact.LIVE] = None
    signing_key_id: Annotated[str | None, Impact.LIVE] = None
    # Key id -> public key PEM of the devices (or the fleet key) whose plans this device loads.
    trusted_keys: Annotated[dict[str, ConfigPath], Impact.LIVE] = Field(
        default_factory=dict, max_length=MAX_TRUSTED_KEYS
    )
    timeout_s: Annotated[float, Impact.LIVE] = Field(10.0, gt=0, le=600)  # each registry request
    # The build claim (one build per key across the fleet): how long a claim holds without its builder
    # renewing it (a builder that died frees the key after this), and how long a device waits for another
    # device's build before building itself.
    claim_ttl_s: Annotated[float, Impact.LIVE] = Field(120.0, ge=5, le=86_400)
    claim_wait_s: Annotated[float, Impact.LIVE] = Field(1800.0, ge=0, le=86_400)

    @field_validator("cache")
    @classmethod
    def _cache(cls, v: str | None) -> str | None:
        if v is not None:
            problem = cache_url_problem(v)
            if problem is not None:
                raise ValueError(problem)
        return v

    @field_validator("signing_key_id")
    @classmethod
    def _signing_key_id(cls, v: str | None) -> str | None:
        problem = None if v is None else key_id_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("trusted_keys")
    @classmethod
    def _key_ids(cls, v: dict[str, Path]) -> dict[str, Path]:
        for key_id in v:
            problem = key_id_problem(key_id)
            if problem is not None:
                raise ValueError(f"key id {key_id[:64]!r}: {problem}")
        return v

    @model_validator(mode="after")
    def _together(self) -> EnginesConfig:
        problems = []
        if (self.signing_key is None) != (self.signing_key_id is None):
            problems.append("signing_key and signing_key_id go together (the key, the id it is trusted as)")
        if self.cache is not None and not self.trusted_keys:
            problems.append(
                "cache without trusted_keys: every pulled plan would be refused (list the key id and public "
                "key of each device or fleet key whose plans this device loads)"
            )
        if self.cache is not None and self.push and self.signing_key is None:
            problems.append(
                "cache with push and no signing_key: a pushed plan must be signed (give this device's key "
                "and signing_key_id, or push: false)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    def resolved(self, rel: Callable[[Path | None], Path | None]) -> EnginesConfig:
        """This section with its paths resolved by `rel` (against the config file's folder)."""
        return self.model_copy(
            update={
                "credentials_file": rel(self.credentials_file),
                "ca_file": rel(self.ca_file),
                "signing_key": rel(self.signing_key),
                "trusted_keys": {k: rel(p) for k, p in self.trusted_keys.items()},
            }
        )


def engines_file_problems(engines: EnginesConfig) -> list[str]:
    """The section's files must be usable at load (--check-config and a reload catch them, not the next
    build). Lines name the key and the path, never what a file holds."""
    if not engines.enabled:
        return []
    problems = []
    for key_id, path in engines.trusted_keys.items():
        problem = public_key_problem(path)
        if problem is not None:
            problems.append(f"engines.trusted_keys.{key_id}: {path}: {problem}")
    if engines.signing_key is not None:
        problem = private_key_problem(engines.signing_key)
        if problem is not None:
            problems.append(f"engines.signing_key: {engines.signing_key}: {problem}")
    if engines.credentials_file is not None:
        problem = _credentials_problem(engines.credentials_file)
        if problem is not None:
            problems.append(f"engines.credentials_file: {problem}")
    if engines.ca_file is not None:
        problem = _ca_problem(engines.ca_file)
        if problem is not None:
            problems.append(f"engines.ca_file: {engines.ca_file}: {problem}")
    return problems


def _ca_problem(path: Path) -> str | None:
    problem = file_problem(path)
    if problem is not None:
        return problem
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, ValueError):
        return "not a PEM CA certificate"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    return None


def _credentials_problem(path: Path) -> str | None:
    """Why the registry login file cannot be used ('{path}: ...'), never what it holds."""
    problem = file_problem(path)
    if problem is not None:
        return f"{path}: {problem}"
    from engines.cache.registry import read_credentials  # the registry client (oras): only where used

    try:
        read_credentials(path)
    except CacheUnavailable as exc:
        return exc.reason.removeprefix("credentials file ")
    return None
