"""`mqtt`: the broker, credentials (the password a SecretStr, never in a repr), TLS, topics and commands."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from agent.config.errors import ConfigError
from agent.config.files import file_problem
from agent.config.names import host_problem, name_problem, topic_prefix_problem
from agent.config.strict import BOOL_WORDS, ConfigPath, EnvText, Secret, StrictModel, raise_problem
from agent.mqtt.password import PasswordFileError, read_password_file
from agent.mqtt.tls import TlsFileError, TlsOptions, client_context


class MqttTlsConfig(StrictModel):
    """`mqtt.tls` as a mapping (`tls: true` is `tls: {}`); paths resolve against the config's folder."""

    ca_file: ConfigPath | None = Field(
        None, description="PEM CA certificate(s) trusted, not the system store"
    )
    cert_file: ConfigPath | None = Field(
        None, description="PEM client certificate (require_certificate brokers)"
    )
    key_file: ConfigPath | None = Field(None, description="the client certificate's unencrypted PEM key")
    # DANGEROUS: no certificate and no host name verification (see agent.mqtt.tls.TlsOptions). Only ever on
    # when this key is written; nothing falls back to it.
    insecure: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> MqttTlsConfig:
        self.options()  # the rules live in TlsOptions, shared with the client
        return self

    def options(self) -> TlsOptions:
        return TlsOptions(self.ca_file, self.cert_file, self.key_file, self.insecure)


def _mqtt_string_problem(text: str) -> str | None:
    """Why `text` does not fit an MQTT string (a 16-bit length in bytes), or None."""
    if len(text.encode("utf-8", "surrogatepass")) > 65535:
        return "at most 65535 bytes (an MQTT string)"
    return None


class MqttConfig(StrictModel):
    enabled: bool = True
    host: str = "localhost"
    port: int = Field(1883, ge=1, le=65535)
    tls: MqttTlsConfig | None = None
    username: str | None = None
    password: Secret | None = None
    password_file: ConfigPath | None = None
    qos: int = Field(0, ge=0, le=2)
    prefix: str = "edge-agent"
    # 65535: the MQTT keep-alive field is 16 bits (paho's thread died packing a larger one).
    keepalive: int = Field(30, ge=5, le=65535)
    # Messages kept while the broker is away (the oldest go first). At most a million: each is a topic and a
    # JSON body in this process's memory (a few hundred bytes to a few KB; snapshots are never queued).
    offline_queue: int = Field(1000, ge=1, le=1_000_000, description="1..1000000 messages kept offline")
    # Retry waits double from reconnect_min_s up to reconnect_max_s, each cut at random by up to half
    # (jitter: agents that lost the same broker do not come back in lock-step). A broker that is back
    # is found within reconnect_max_s plus the connect itself: the default keeps that within 5 s.
    reconnect_min_s: float = Field(1.0, gt=0, le=60)
    reconnect_max_s: float = Field(4.0, gt=0, le=300)
    # MQTT commands this agent accepts (cmd/<action>); others are answered "disabled". (noqa: pydantic copies
    # a field's default; ruff cannot tell StrictModel is pydantic across modules.)
    # deploy and rollback (agent.deploy) act only where deploy.enabled; leave them out to keep them off MQTT.
    commands: list[Literal["rebuild", "reload", "snapshot", "deploy", "rollback"]] = [  # noqa: RUF012
        "rebuild",
        "reload",
        "snapshot",
        "deploy",
        "rollback",
    ]
    # Fleet groups: the agent also takes commands on {prefix}/_group/<name>/cmd/+ (and always {prefix}/_all).
    groups: list[str] = Field(default_factory=list, max_length=32)
    # Also take {prefix}/_any/cmd/+ and {prefix}/_group/<g>/any/cmd/+ through MQTT shared subscriptions
    # ($share/...): each such command goes to one agent of the fleet / group. Off: not every broker has them.
    shared_subscriptions: bool = False
    # MQTT 5 (default) lets the broker say why it refuses a publish (an ACL); 3.1.1 for brokers without it.
    protocol: Literal["5", "3.1.1"] = "5"

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol(cls, v: object) -> object:
        # YAML reads `protocol: 5` as an integer and `protocol: 3.1.1` as a string.
        return "5" if v == 5 and not isinstance(v, bool) else v

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"entry {i + 1}: {problem}")
        if len(set(v)) != len(v):
            raise ValueError("names must be unique")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        raise_problem(topic_prefix_problem(v))
        return v

    @field_validator("username")
    @classmethod
    def _username(cls, v: str | None) -> str | None:
        raise_problem(None if v is None else _mqtt_string_problem(v))
        return v

    @field_validator("password")
    @classmethod
    def _password(cls, v: SecretStr | None) -> SecretStr | None:
        raise_problem(None if v is None else _mqtt_string_problem(v.get_secret_value()))
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        raise_problem(host_problem(v))
        return v

    @field_validator("tls", mode="before")
    @classmethod
    def _tls_forms(cls, v: Any) -> Any:
        # `tls: true` (system CA store, verified) and `tls: false` keep working next to the mapping.
        if v is None or isinstance(v, (dict, MqttTlsConfig)):
            return v
        if isinstance(v, EnvText) and v.strip().lower() in BOOL_WORDS:  # tls: ${MQTT_TLS}
            v = BOOL_WORDS[v.strip().lower()]
        if isinstance(v, bool):
            return {} if v else None
        raise ValueError("must be true, false or a mapping of ca_file, cert_file, key_file, insecure")

    @model_validator(mode="after")
    def _credentials(self) -> MqttConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give password or password_file, not both")
        if self.username is None and (self.password is not None or self.password_file is not None):
            raise ValueError("a password needs a username (MQTT sends no password without one)")
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("reconnect_min_s must be <= reconnect_max_s")
        return self

    def read_password(self) -> str | None:
        """The password from `password` or `password_file` (read by agent.mqtt.password, as the fleet tool
        reads its own); ConfigError naming mqtt.password_file."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is None:
            return None
        try:
            return read_password_file(self.password_file)
        except PasswordFileError as exc:
            raise ConfigError(_password_file_line(exc)) from None
        except ValueError:  # a NUL in the path: a config file cannot hold one, a caller could
            raise ConfigError(f"mqtt.password_file: {self.password_file}: not a valid path") from None


def _password_file_line(exc: PasswordFileError) -> str:
    # The config's wording, older than the shared reader: an OS error is 'cannot read PATH: why'.
    reason = exc.problem.removeprefix("cannot read (")
    if reason != exc.problem and reason.endswith(")"):
        return f"mqtt.password_file: cannot read {exc.path}: {reason[:-1]}"
    return f"mqtt.password_file: {exc.path}: {exc.problem}"


def mqtt_file_problems(mqtt: MqttConfig) -> list[str]:
    """Password and TLS files must be usable at load: --check-config and a reload catch them, not the
    connection attempt later. Lines name the key and the path, never what a file holds."""
    if not mqtt.enabled:
        return []
    problems = []
    try:
        mqtt.read_password()
    except ConfigError as exc:
        problems.append(str(exc))
    if mqtt.tls is not None:
        unusable = False
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(mqtt.tls, key)
            # A FIFO or a device would block the reading below; the rest is told by client_context.
            if path is not None and file_problem(path) == "is not a regular file":
                problems.append(f"mqtt.tls.{key}: {path}: is not a regular file")
                unusable = True
        if not unusable:
            try:
                client_context(mqtt.tls.options())
            except TlsFileError as exc:
                problems.append(f"mqtt.tls.{exc}")
    return problems
