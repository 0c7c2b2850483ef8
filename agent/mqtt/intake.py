"""Command intake: what the client subscribes to, and where each incoming message goes.

Our commands ({prefix}/{device}/cmd/+), the fleet's ({prefix}/_all, {prefix}/_group/<g>; with shared
subscriptions also the "any one agent" topics), the owner's watches, and our own status topic (other
instances with our device id, agent.mqtt.duplicates). Commands are screened and run by the CommandRouter
(agent.mqtt.commands) and answered on our own result topic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from agent.mqtt.commands import Answer, CommandRouter
from agent.mqtt.outbox import Send
from agent.mqtt.topics import Topics

log = logging.getLogger("agent.mqtt")

Watch = Callable[[str, bytes], None]


class Intake:
    """Subscriptions and dispatch. A shard's intake takes no commands and does not watch its status: the
    supervisor's client owns the device's command intake. `own_status(raw, retained)` gets what arrives on
    our status topic; `send` publishes directly (clearing a retained command)."""

    def __init__(
        self,
        topics: Topics,
        *,
        groups: tuple[str, ...],
        shared: bool,
        shard: bool,
        router: CommandRouter,
        answer: Callable[[Answer], None],
        own_status: Callable[[bytes, bool], None],
        send: Send,
    ) -> None:
        self.topics, self.groups, self.shared, self.shard = topics, groups, shared, shard
        self._fleet_filters = () if shard else topics.fleet_filters(groups, shared=shared)
        self.router, self._answer, self._own_status, self._send = router, answer, own_status, send
        # Shared by the daemon across reconnections to another broker: see watch().
        self.watches: dict[str, Watch] = {}

    def filters(self) -> tuple[str, ...]:
        """Everything to subscribe to, in one SUBSCRIBE so that one SUBACK says which the broker refused."""
        if self.shard:
            return tuple(self.watches)
        return (self.topics.cmd_filter, *self._fleet_filters, *self.watches, self.topics.status)

    def subscribe(self, client: paho.Client, protocol: str) -> tuple[int, tuple[str, ...]] | None:
        """Subscribe to filters(); (message id, filters) to match the SUBACK, None when nothing was sent."""
        filters = self.filters()
        if not filters:
            return None
        if protocol == "5":
            # noLocal: our own status publishes do not come back to us. retainAsPublished on the command
            # filters: a broker clears the retain flag of what it forwards to a live subscription unless asked
            # to keep it, so a command published retained while we are connected would run like any other
            # (and stay retained). With the flag kept it is seen, ignored and deleted (on_message).
            commands = {self.topics.cmd_filter, *self._fleet_filters}
            subs: list[tuple[str, Any]] = [
                (f, SubscribeOptions(qos=1, noLocal=f == self.topics.status, retainAsPublished=f in commands))
                for f in filters
            ]
        else:
            # MQTT 3.1.1 has no such option: the flag is seen only on the retained messages sent at subscribe
            # (each connect), which are deleted; one published retained while we are connected runs once.
            subs = [(f, 1) for f in filters]
        result, mid = client.subscribe(subs)
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
            log.warning("MQTT subscribe to %s failed: %s", ", ".join(filters), paho.error_string(result))
            return None
        return mid, filters

    def on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        try:
            if msg.topic == self.topics.status:
                self._own_status(bytes(msg.payload), bool(msg.retain))
                return
            action = self.topics.action_of(msg.topic)
            shared = False
            if action is None:
                action = self.topics.fleet_action_of(msg.topic, self.groups, self.shared)
                shared = action is not None
            if action is None:
                for topic_filter, callback in self.watches.items():
                    if paho.topic_matches_sub(topic_filter, msg.topic):
                        callback(msg.topic, bytes(msg.payload))
                return
            raw = bytes(msg.payload)
            why = self.router.screen(action, raw, bool(msg.retain), shared=shared)
            if why == "retained" and not shared:  # a shared topic is not ours to clear
                self._send(msg.topic, b"", 1, True)  # an empty retained message deletes it at the broker
            if why is None:
                self.router.submit(action, raw, self._answer)
        except Exception:
            log.exception("MQTT command on %s failed", msg.topic)
