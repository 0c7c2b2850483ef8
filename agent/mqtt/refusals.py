"""Broker refusals: MQTT 5 PUBACK/SUBACK reason codes (e.g. an ACL that is too tight), counted and reported.

A refusal comes back on paho's network thread with only a message id: the topic of every QoS>=1 publish
and the filters of every SUBSCRIBE are kept by id until the broker answers.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import paho.mqtt.client as paho

from agent.mqtt.link import reason_name

log = logging.getLogger("agent.mqtt")

_MID_TRACK = 1024  # QoS>=1 publishes whose topic is kept until the broker acknowledges (or refuses) them
_SUB_TRACK = 64  # SUBSCRIBEs whose filters are kept until the broker answers
_REPORTED_MAX = 256  # distinct refused topics logged; later ones are only counted


class Refusals:
    """Counted, kept for stats()/telemetry (`refused`, `last_refused`), logged once per topic.

    `broker` is 'host:port', `needs` the topics the agent needs (said in the log line)."""

    def __init__(self, broker: str, needs: str) -> None:
        self._broker, self._needs = broker, needs
        # Own lock, never held while calling paho (paho calls on_publish holding its callback mutex).
        self._mid_lock = threading.Lock()
        self._mid_topics: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._early: dict[int, str] = {}  # refused before track() recorded the mid
        self._sub_filters: dict[int, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self._count = 0
        self._last: str | None = None

    def track(self, mid: int, topic: str) -> None:
        """A QoS>=1 publish handed to paho: its acknowledgement may say it was refused."""
        with self._mid_lock:
            early = self._early.pop(mid, None)
            if early is None:
                self._mid_topics[mid] = topic
                self._mid_topics.move_to_end(mid)
                while len(self._mid_topics) > _MID_TRACK:
                    self._mid_topics.popitem(last=False)
        if early is not None:
            self.refused(f"publish to {topic}", early)

    def track_subscription(self, mid: int, filters: tuple[str, ...]) -> None:
        with self._mid_lock:
            self._sub_filters[mid] = filters
            # A connection lost before the SUBACK leaves its entry: a broker restarting often must not
            # grow this (the subscriptions of the next connection get mids of their own).
            while len(self._sub_filters) > _SUB_TRACK:
                self._sub_filters.pop(next(iter(self._sub_filters)))

    def on_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason_code: Any, properties: Any
    ) -> None:
        refused = getattr(reason_code, "is_failure", False)
        with self._mid_lock:
            topic = self._mid_topics.pop(mid, None)
            if topic is None and refused:  # acknowledged before track() recorded the mid: it reports it
                self._early[mid] = reason_name(reason_code)
                if len(self._early) > _MID_TRACK:
                    self._early.pop(next(iter(self._early)))
                return
        if refused and topic is not None:
            self.refused(f"publish to {topic}", reason_name(reason_code))

    def on_subscribe(
        self, client: paho.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        with self._mid_lock:
            filters = self._sub_filters.pop(mid, ())
        for topic_filter, code in zip(filters, reason_codes, strict=False):
            if getattr(code, "is_failure", False):
                what = "commands there will not arrive" if "/cmd/" in topic_filter else "not watched"
                self.refused(f"subscription to {topic_filter}", f"{reason_name(code)}; {what}")

    def refused(self, what: str, reason: str) -> None:
        line = f"{what}: {reason}"
        with self._lock:
            self._count += 1
            self._last = line
            first = what not in self._reported and len(self._reported) < _REPORTED_MAX
            if first:
                self._reported.add(what)
        if first:
            log.error(
                "MQTT broker %s refused the %s (the agent needs %s, see the broker ACL)",
                self._broker,
                line,
                self._needs,
            )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"refused": self._count, "last_refused": self._last}
