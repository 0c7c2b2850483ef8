"""Home Assistant MQTT discovery: the retained entity configs that point HA at the topics the agent
publishes anyway (the config -> entities, and the value templates that read its payloads).

discovery  the entities of a config, their discovery topics and payloads, what a reload or a start clears
templates  the Jinja value templates, checked against HA's own rules in tests/test_discovery.py
"""
