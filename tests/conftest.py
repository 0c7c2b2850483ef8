"""Shared fixtures: real servers (RTSP, mosquitto, the OCI registry) live in their own plugin modules."""

pytest_plugins = ["fixtures_rtsp", "fixtures_mqtt", "fixtures_agent", "fixtures_registry"]
