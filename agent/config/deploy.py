"""`deploy`: model versions deployed to this device over MQTT or `edge-agent models deploy` (agent.deploy;
docs/DESIGN.md "Deployments"). Off unless `enabled`: a config without this section behaves as before.

What the deployment manager reads when a document arrives (trust, download policy, the checks' limits) is
LIVE: a reload applies it to the next document, so a key removed from trusted_keys is revoked by a SIGHUP.
Whether deployments are taken at all and where their state lives are fixed while the agent runs (AGENT).
Trusted keys and the CA file are read at load: an error names the key and the path, never what they hold.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from agent.config.files import file_problem
from agent.config.impact import Impact
from agent.config.keys import key_id_problem, public_key_problem
from agent.config.strict import ConfigPath, StrictModel

MAX_TRUSTED_KEYS = 64


class DeployGateConfig(StrictModel):
    """The agreement floor a candidate must reach against the serving model on recent live frames."""

    # mAP50 of the candidate against the serving model's detections (pipelines.agreement, as the precision
    # gate). Measured on the bundled NanoDet, 150 frames of bikes.mp4, ONNX Runtime: labels shuffled 0.04,
    # normalised /255 without mean 0.09, objects at 320/416 of their scale 0.33, RGB fed for BGR 0.56;
    # stand-ins for a retrained version (weights perturbed by 2 % / 3 %) 0.95 / 0.67. 0.6 refuses each
    # broken one and leaves a retrained model room.
    min_agreement: float = Field(0.6, ge=0.0, le=1.0)
    frames: int = Field(50, ge=1, le=10_000)  # the last N frames of the model's cameras


class DeployShadowConfig(StrictModel):
    """The candidate beside the serving model on live frames, publishing nothing, before promotion."""

    frames: int = Field(100, ge=1, le=100_000)
    max_latency_ratio: float = Field(2.0, ge=1.0, le=100.0)  # candidate / serving inference p95
    # Detections per frame, candidate / serving: outside these the candidate sees a different scene.
    min_detections_ratio: float = Field(0.5, ge=0.0, le=1.0)
    max_detections_ratio: float = Field(2.0, ge=1.0, le=100.0)
    max_errors: int = Field(0, ge=0, le=10_000)  # inference errors tolerated during the shadow run


class DeployWatchConfig(StrictModel):
    """After promotion, for deploy.watch_s: what makes the agent roll back by itself."""

    # Frame age p95 of the model's cameras beyond this factor of its value before the promotion.
    age_p95_factor: float = Field(3.0, ge=1.0, le=100.0)
    # Detections per frame below this share of the pre-promotion rate, on cameras that had traffic.
    detections_collapse_ratio: float = Field(0.2, ge=0.0, le=1.0)


class DeployConfig(StrictModel):
    # Off by default: deployments change what the device serves; a fleet opts in per config.
    enabled: Annotated[bool, Impact.AGENT] = False
    # Key id -> public key PEM (ed25519) trusted to sign documents; each read at load.
    trusted_keys: Annotated[dict[str, ConfigPath], Impact.LIVE] = Field(
        default_factory=dict, max_length=MAX_TRUSTED_KEYS
    )
    # DANGEROUS: anyone who can publish on the command topic deploys a model. For a lab, never a fleet.
    allow_unsigned: Annotated[bool, Impact.LIVE] = False
    allow_http: Annotated[bool, Impact.LIVE] = False  # plain http:// artifact URLs (sha256 still checked)
    ca_file: Annotated[ConfigPath | None, Impact.LIVE] = None  # PEM CA(s) of a private artifact store
    # The login ({"username", "password"} JSON) of the registries of oci:// artifacts; read at load.
    registry_credentials_file: Annotated[ConfigPath | None, Impact.LIVE] = None
    max_artifact_mb: Annotated[float, Impact.LIVE] = Field(1024.0, gt=0, le=1 << 20)  # per artifact
    keep_versions: Annotated[int, Impact.LIVE] = Field(2, ge=1, le=100)  # older ones kept for rollback
    # Versions, staging and the resumable record of each deployment; next to the engine store by default
    # (downloads are staged on the filesystem the versions are renamed into).
    state_dir: Annotated[ConfigPath, Impact.AGENT] = Path("/var/lib/edge-agent/deployments")
    connect_timeout_s: Annotated[float, Impact.LIVE] = Field(10.0, gt=0, le=300)
    read_timeout_s: Annotated[float, Impact.LIVE] = Field(30.0, gt=0, le=3600)  # each read of a body
    watch_s: Annotated[float, Impact.LIVE] = Field(300.0, ge=0, le=86_400)  # 0: no watch after promotion
    gate: Annotated[DeployGateConfig, Impact.LIVE] = DeployGateConfig()
    shadow: Annotated[DeployShadowConfig, Impact.LIVE] = DeployShadowConfig()
    watch: Annotated[DeployWatchConfig, Impact.LIVE] = DeployWatchConfig()

    @field_validator("trusted_keys")
    @classmethod
    def _key_ids(cls, v: dict[str, Path]) -> dict[str, Path]:
        for key_id in v:
            problem = key_id_problem(key_id)
            if problem is not None:
                raise ValueError(f"key id {key_id[:64]!r}: {problem}")
        return v

    @model_validator(mode="after")
    def _trust(self) -> DeployConfig:
        if self.enabled and not self.trusted_keys and not self.allow_unsigned:
            raise ValueError(
                "enabled without trusted_keys: every document would be refused (list a key id and its public"
                " key file, see `edge-agent keys generate`)"
            )
        return self

    @property
    def max_artifact_bytes(self) -> int:
        return int(self.max_artifact_mb * (1 << 20))

    def resolved(self, rel: Callable[[Path | None], Path | None]) -> DeployConfig:
        """This section with its paths resolved by `rel` (against the config file's folder)."""
        return self.model_copy(
            update={
                "trusted_keys": {k: rel(p) for k, p in self.trusted_keys.items()},
                "ca_file": rel(self.ca_file),
                "registry_credentials_file": rel(self.registry_credentials_file),
                "state_dir": rel(self.state_dir),
            }
        )


def deploy_file_problems(deploy: DeployConfig) -> list[str]:
    """Trusted keys and the CA file must be usable at load (--check-config and a reload catch them, not the
    first document). Lines name the key and the path, never what a file holds."""
    if not deploy.enabled:
        return []
    problems = []
    for key_id, path in deploy.trusted_keys.items():
        problem = public_key_problem(path)
        if problem is not None:
            problems.append(f"deploy.trusted_keys.{key_id}: {path}: {problem}")
    if deploy.ca_file is not None:
        problem = file_problem(deploy.ca_file)
        if problem is None:
            try:
                ssl.create_default_context(cafile=str(deploy.ca_file))
            except (ssl.SSLError, ValueError):
                problem = "not a PEM CA certificate"
            except OSError as exc:
                problem = f"cannot read ({exc.strerror or exc})"
        if problem is not None:
            problems.append(f"deploy.ca_file: {deploy.ca_file}: {problem}")
    if deploy.registry_credentials_file is not None:
        path = deploy.registry_credentials_file
        problem = _credentials_problem(path)
        if problem is not None:
            problems.append(f"deploy.registry_credentials_file: {path}: {problem}")
    return problems


def _credentials_problem(path: Path) -> str | None:
    """Why the registry login file cannot be used, never what it holds."""
    problem = file_problem(path)
    if problem is not None:
        return problem
    from engines.cache.errors import CacheUnavailable
    from engines.cache.registry import read_credentials  # the registry client (oras): only where used

    try:
        read_credentials(path)
    except CacheUnavailable as exc:
        return exc.reason.removeprefix(f"credentials file {path}: ")
    return None
