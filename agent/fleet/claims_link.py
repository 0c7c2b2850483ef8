"""The build claims' own paho client, made from the agent's `mqtt` settings (agent.mqtt.settings): the same
broker, protocol, TLS and credentials as the agent's client, under another client id. Nothing here logs:
a failure is one ClaimsUnavailable line naming host and port (and a file's path), never a credential."""

from __future__ import annotations

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.fleet.claim_record import ClaimsUnavailable
from agent.mqtt.settings import MqttSettings
from agent.mqtt.tls import TlsFileError, client_context


def claims_client(settings: MqttSettings, client_id: str) -> paho.Client:
    """A paho client (callback API 2, clean session) for `settings`; ClaimsUnavailable where its TLS files
    or password file cannot be used."""
    s, where = settings, f"MQTT broker {settings.host}:{settings.port}"
    if s.protocol == "5":  # the broker then says why it refuses a claim (an ACL): 0x87
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    else:
        v3 = paho.MQTTv311
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True, protocol=v3)
    c.suppress_exceptions = True  # a bug in a callback must not end the network thread
    try:
        if s.username is not None:
            c.username_pw_set(s.username, s.read_password())
        if s.tls is not None:
            opts = s.tls.options()
            c.tls_set_context(client_context(opts))
            c.tls_insecure_set(opts.insecure)
    except (TlsFileError, ValueError) as exc:  # ConfigError (a password file) is a ValueError
        raise ClaimsUnavailable(f"{where}: {exc}") from None
    c.reconnect_delay_set(min_delay=s.reconnect_min_s, max_delay=s.reconnect_max_s)  # type: ignore[arg-type]
    return c
