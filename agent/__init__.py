"""edge-agent: daemon wiring, config, CLI, MQTT, telemetry, systemd."""

__version__ = "0.1.0"
