"""The MQTT package's error type."""

from __future__ import annotations


class MqttError(ValueError):
    """Configuration or usage error of the MQTT client (the message never contains secrets)."""
