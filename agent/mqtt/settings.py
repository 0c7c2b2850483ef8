"""What the client reads of its settings. The config's `mqtt` section (agent.config.MqttConfig, validated
there) has every one of these; the client takes any object that does, so this package names no config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agent.mqtt.tls import TlsOptions


class TlsSettings(Protocol):
    def options(self) -> TlsOptions: ...


class MqttSettings(Protocol):
    """The broker, credentials, TLS, queue and subscriptions of one client (read-only here)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def keepalive(self) -> int: ...
    @property
    def protocol(self) -> str: ...  # "5" | "3.1.1"
    @property
    def tls(self) -> TlsSettings | None: ...
    @property
    def username(self) -> str | None: ...
    @property
    def qos(self) -> int: ...
    @property
    def offline_queue(self) -> int: ...
    @property
    def reconnect_min_s(self) -> float: ...
    @property
    def reconnect_max_s(self) -> float: ...
    @property
    def groups(self) -> Sequence[str]: ...
    @property
    def shared_subscriptions(self) -> bool: ...

    def read_password(self) -> str | None:
        """The password (None: none); a settings error where it cannot be read."""
