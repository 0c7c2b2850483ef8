"""A device's deployments (issue 37; docs/DESIGN.md "Deployments"): one Deployer (agent.deploy.manager) over
the runtime of this process, its commands and its retained states.

    deployments = DeviceDeployments(device)   # in Device.__init__; registers cmd/deploy and cmd/rollback
    deployments.start()                       # in Device.start, before runtime.open(): versions to serve
    new = deployments.overlay(new)            # a reload: deployed versions stay on top of the new sections
    deployments.close()                       # in Device.stop, before the runtime stops

- Off (`deploy.enabled: false`, the default): both commands are answered "deployments are off".
- Pipeline shards (agent.shards): deployments are refused (a `rejected` state and the answer say why); the
  versions a device deployed before it was sharded stay in the state folder, unserved, until shards are off.
- At start: the state folder's serving version of each model (sha256 checked again; a broken one falls
  back to the previous, then to the config's own model, published) replaces the config's section in the
  runtime; an interrupted download resumes.
- A reload (SIGHUP, cmd/reload) reads `deploy` live for the next document (trusted keys, limits); a model
  section that changed is reopened with the deployed version on top of the new section (its threads,
  batch, ... apply; the version keeps serving; the config's own ONNX is the fallback of a rollback). A
  deployment running during the reload goes on with the section it started from. A model removed from the
  config: its retained `deployments/{model}` is deleted (also one found at connect).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from agent.config import AgentConfig
from agent.deploy.errors import DeployError
from agent.deploy.manager import Deployer
from agent.deploy.state import REJECTED, DeploymentState
from agent.deploy.version_files import effective_model
from agent.deploy.versions import VersionStore
from agent.mqtt import MqttClient
from agent.mqtt.commands import CommandError, CommandRouter, DeployRequest, RollbackRequest
from agent.mqtt.topics import Topics


class Owner(Protocol):
    """What is used of agent.device.Device."""

    cfg: AgentConfig
    runtime: Any
    mqtt: MqttClient | None
    topics: Topics
    commands: CommandRouter
    reload_lock: threading.Lock

log = logging.getLogger("agent.deploy")

OFF = "deployments are off on this device (deploy.enabled: false)"
SHARDED = (
    "deployments are not taken while pipeline shards run (shards.enabled): a version would have to be "
    "promoted in every shard at once; turn shards off on this device to deploy"
)


def deployment_topic(topics: Topics, model: str) -> str:
    return f"{topics.base}/deployments/{model}"


class DeviceDeployments:
    def __init__(self, device: Owner) -> None:
        self.device = device
        self.deployer: Deployer | None = None
        self.refusal = OFF  # why no document is taken (while deployer is None)
        device.commands.register("deploy", self._cmd_deploy)
        device.commands.register("rollback", self._cmd_rollback)

    # ---- start, reload, stop -------------------------------------------------------------------------
    def start(self) -> None:
        """Before the runtime opens: the deployer, and the versions the runtime serves in place of the
        config's sections."""
        dev = self.device
        cfg = dev.cfg
        if not cfg.deploy.enabled:
            return
        runtime = dev.runtime
        host = runtime.deploy_host(own=lambda: dev.cfg, publish=self.publish, lock=dev.reload_lock)
        if host is None:  # the runtime takes no deployments (shards)
            self.refusal = SHARDED
            log.warning("deployments: %s", SHARDED)
            return
        self.deployer = Deployer(lambda: dev.cfg.deploy, VersionStore(cfg.deploy.state_dir), host)
        try:
            serve = self.deployer.start(cfg.models)
        except (DeployError, OSError) as exc:  # the cameras still start, on the config's own models
            why = exc.reason if isinstance(exc, DeployError) else (exc.strerror or str(exc))
            log.error("deployments: %s: %s; the config's own models serve", cfg.deploy.state_dir, why)
            serve = {}
        for model, mcfg in serve.items():
            log.info("model %s: serving the deployed version %s (%s)", model, self._serving(model), mcfg.onnx)
        runtime.serve_models(serve)

    def overlay(self, new: AgentConfig) -> AgentConfig:
        """`new` (a reloaded config) with each model's deployed version on top of its new section."""
        if self.deployer is None:
            return new
        store = self.deployer.store
        models = dict(new.models)
        for model, own in new.models.items():
            version = self._serving(model)
            if version is None:
                continue
            try:
                models[model] = effective_model(own, store.version_dir(model, version))
                if own != self.device.cfg.models.get(model):
                    said = "model %s: its section changed; the deployed version %s keeps serving"
                    log.info(said, model, version)
            except DeployError as exc:
                log.warning("model %s: version %s cannot serve the reloaded section: %s", model, version, exc)
        return new.model_copy(update={"models": models})

    def reloaded(self, old: AgentConfig) -> None:
        """After a reload: the states of models the config no longer has are deleted."""
        for model in set(old.models) - set(self.device.cfg.models):
            self._clear(model)

    def close(self) -> None:
        if self.deployer is not None:
            self.deployer.close()

    def _serving(self, model: str) -> str | None:
        if self.deployer is None:
            return None
        try:
            return self.deployer.store.serving(model)
        except DeployError:
            return None

    # ---- MQTT ----------------------------------------------------------------------------------------
    def publish(self, model: str, body: bytes) -> None:
        """The retained `deployments/{model}` state (kept while offline, sent again at each connect)."""
        client = self.device.mqtt
        if client is not None:
            topic = deployment_topic(self.device.topics, model)
            client.publish(topic, body, qos=1, retain=True, kind="state")

    def _clear(self, model: str) -> None:
        client = self.device.mqtt
        if client is not None:
            log.info("deleting the deployment state of %s (not a model of the config)", model)
            client.publish(deployment_topic(self.device.topics, model), b"", qos=1, retain=True, kind="state")

    def watch(self, client: MqttClient, topics: Topics) -> None:
        """Delete retained deployment states of models the config does not have (removed while stopped)."""

        def stale(topic: str, body: bytes) -> None:
            model = topic.rsplit("/", 1)[-1]
            if body and model not in self.device.cfg.models:
                self._clear(model)

        client.watch(deployment_topic(topics, "+"), stale)

    # ---- commands ------------------------------------------------------------------------------------
    def _cmd_deploy(self, req: DeployRequest) -> dict[str, Any]:
        """cmd/deploy DOCUMENT: answered at once (accepted / already serving / a refusal naming the field);
        the stages follow on deployments/{model}."""
        if self.deployer is None:
            self._refused_state(req, self.refusal)
            raise CommandError(self.refusal, {"stage": REJECTED, "field": None})
        answer = self.deployer.submit(req.raw, req.request_id)
        return self._answer(answer)

    def _cmd_rollback(self, req: RollbackRequest) -> dict[str, Any]:
        """cmd/rollback {model, to?}: the previous version (or `to`; else the config's own model) now."""
        if self.deployer is None:
            raise CommandError(self.refusal)
        return self._answer(self.deployer.rollback(req.model, req.to))

    @staticmethod
    def _answer(answer: dict[str, Any]) -> dict[str, Any]:
        fields = {k: v for k, v in answer.items() if k not in ("ok", "reason", "request_id")}
        if not answer.get("ok"):
            fields.setdefault("stage", REJECTED)
            raise CommandError(str(answer.get("reason")), fields)
        return {**fields, "reason": answer.get("reason")}

    def _refused_state(self, req: DeployRequest, reason: str) -> None:
        """Where deployments are refused: the state of a document's model says so (when it names one of
        the config's models; nothing of the document but its names is shown)."""
        extra = req.model_extra or {}
        model, version = extra.get("model"), extra.get("version")
        if self.device.cfg.deploy.enabled and isinstance(model, str) and model in self.device.cfg.models:
            state = DeploymentState(
                model, version if isinstance(version, str) and len(version) <= 128 else None, REJECTED
            )
            state.reason, state.request_id = reason, req.request_id
            state.log()
            self.publish(model, state.payload())
