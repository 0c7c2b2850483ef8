"""MQTT: the daemon's client (connection, offline queue, refusals, duplicates, command intake), the topic
contract, command validation, the fleet tool and TLS settings.

Callers import the client from here: ``from agent.mqtt import MqttClient, MqttError``.
"""

from agent.mqtt.client import MqttClient
from agent.mqtt.errors import MqttError
from agent.mqtt.link import backoff_delay
from agent.mqtt.password import PasswordFileError, read_password_file

__all__ = ["MqttClient", "MqttError", "PasswordFileError", "backoff_delay", "read_password_file"]
