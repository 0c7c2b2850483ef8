"""A real mosquitto per test, and a collecting subscriber (pytest plugin, loaded by conftest)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None
)

Message = tuple[str, bytes, bool]  # topic, payload, retain


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class Broker:
    """mosquitto on 127.0.0.1:port with its own conf; start/stop/kill/start again on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, allow_anonymous: bool = True) -> None:
        if MOSQUITTO is None:
            raise RuntimeError("mosquitto is not installed")
        self.workdir = workdir
        self.port = port or free_port()
        self.conf = workdir / f"mosquitto-{self.port}.conf"
        self.log = workdir / f"mosquitto-{self.port}.log"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            f"allow_anonymous {'true' if allow_anonymous else 'false'}\n"
            "persistence false\n"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 5.0) -> None:
        if self.running:
            return
        # A stale broker (or anything) on our port would make every assertion about "our" broker lie.
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} already accepts connections before mosquitto started")
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=logf, stderr=logf)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {self.log_tail()}")
            if port_open(self.port):
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout} s: {self.log_tail()}")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def publish(port: int, topic: str, raw: bytes, retain: bool = False) -> None:
    """One QoS 1 message from a client of its own (connect, publish, wait for the ack, disconnect)."""
    c = paho.Client(CallbackAPIVersion.VERSION2)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.publish(topic, raw, qos=1, retain=retain).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()


def retain(port: int, items: list[tuple[str, bytes]]) -> None:
    """Retained QoS 1 messages, each acknowledged, from one client of its own."""
    c = paho.Client(CallbackAPIVersion.VERSION2)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        for topic, body in items:
            c.publish(topic, body, qos=1, retain=True).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()


class Subscriber:
    """A paho client that collects (topic, payload, retain) of ``topic_filter`` (thread-safe); over TLS
    with ``tls_context``, authenticated with ``username``/``password``."""

    def __init__(
        self,
        port: int,
        topic_filter: str,
        qos: int = 1,
        tls_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.messages: list[Message] = []
        self._cond = threading.Condition()
        self._subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        if tls_context is not None:
            self.client.tls_set_context(tls_context)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()
        self.client.subscribe(topic_filter, qos=qos)
        if not self._subscribed.wait(5):
            self.close()
            raise RuntimeError(f"no SUBACK for {topic_filter}")

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        with self._cond:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))
            self._cond.notify_all()

    def snapshot(self) -> list[Message]:
        with self._cond:
            return list(self.messages)

    def wait_for(self, predicate: Callable[[list[Message]], bool], timeout: float = 10.0) -> list[Message]:
        """Wait until ``predicate(messages)`` holds; return the messages, or fail the test with them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.messages):
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"timed out after {timeout} s; got {self.messages!r}")
                self._cond.wait(left)
            return list(self.messages)

    def publish(self, topic: str, payload: bytes | str, qos: int = 1) -> None:
        self.client.publish(topic, payload, qos=qos).wait_for_publish(5)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def mqtt_broker(tmp_path: Path) -> Iterator[Broker]:
    """A started mosquitto on a free port; always killed at teardown."""
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = Broker(tmp_path)
    try:
        broker.start()
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def mqtt_broker_stopped(tmp_path: Path) -> Iterator[Broker]:
    """A broker on a reserved free port, not yet started (for "broker down at start"); always killed."""
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = Broker(tmp_path)
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def mqtt_subscribe() -> Iterator[Callable[..., Subscriber]]:
    """Factory: ``mqtt_subscribe(port, filter, **options)`` -> Subscriber, all closed at teardown."""
    subs: list[Subscriber] = []

    def make(port: int, topic_filter: str, qos: int = 1, **options: Any) -> Subscriber:
        sub = Subscriber(port, topic_filter, qos, **options)
        subs.append(sub)
        return sub

    try:
        yield make
    finally:
        for s in subs:
            s.close()


_CLIENT_HOOKS = ("birth", "offline", "quiet", "commands", "answer", "shard")


def mqtt_client(topics: Any, **kw: Any) -> Any:
    """An MqttClient as the daemon makes it, for an `mqtt` section of the fields in `kw` (validated as the
    config does; `tls` may also be a TlsOptions); the owner's hooks (birth, offline, quiet, commands,
    answer, shard) pass through."""
    import dataclasses

    from agent.config import MqttConfig
    from agent.mqtt import MqttClient
    from agent.mqtt.tls import TlsOptions

    hooks = {k: kw.pop(k) for k in _CLIENT_HOOKS if k in kw}
    if isinstance(kw.get("tls"), TlsOptions):
        kw["tls"] = dataclasses.asdict(kw["tls"])
    return MqttClient(MqttConfig.model_validate(kw), topics, **hooks)
