"""Home Assistant value templates (Jinja) that turn the agent's own payloads into entity states.

Each renders '' or 'None' for a payload that is not the expected JSON, so HA keeps or clears the state
instead of showing garbage; checked against HA's own rules in tests/test_discovery.py.
"""

from __future__ import annotations

import json

# Status -> availability. Only "offline" (graceful stop, or the broker's last will after kill -9) means
# the agent is gone; degraded/rebuilding (and any state added later) mean it runs. A payload that is not
# the status JSON renders '' and HA leaves availability as it was.
AVAILABILITY_TEMPLATE = (
    "{{ ('offline' if value_json.state == 'offline' else 'online')"
    " if value_json is defined and value_json.state is defined else '' }}"
)
STREAMING_TEMPLATE = (
    "{{ ('ON' if value_json.state == 'streaming' else 'OFF')"
    " if value_json is defined and value_json.state is defined else '' }}"
)
# "state" is an attribute name HA blocks (MQTT_ATTRIBUTES_BLOCKED), hence camera_state.
STREAMING_ATTRIBUTES_TEMPLATE = (
    "{{ {'camera_state': value_json.state, 'fps_in': value_json.fps_in | default(none),"
    " 'reconnects': value_json.reconnects | default(none),"
    " 'last_error': value_json.last_error | default(none)} | tojson"
    " if value_json is defined and value_json.state is defined else '{}' }}"
)
# 'None' is HA's PAYLOAD_NONE: the sensor becomes unknown instead of keeping a stale number.
FPS_TEMPLATE = (
    "{{ value_json.fps_out if value_json is defined and value_json.fps_out is number else 'None' }}"
)
LATENCY_TEMPLATE = (
    "{{ value_json.latency_ms.total | round | int"
    " if value_json is defined and value_json.latency_ms is mapping"
    " and value_json.latency_ms.total is number else 'None' }}"
)


OCCUPANCY_TEMPLATE = (
    "{{ ('ON' if value_json.occupied else 'OFF')"
    " if value_json is defined and value_json.occupied is defined else '' }}"
)


def zone_count_template(label: str) -> str:
    """Tracks with ``label`` in a zone, from its retained state (0 where the label is not there)."""
    literal = json.dumps(label, ensure_ascii=False)
    return (
        f"{{{{ (value_json.counts[{literal}] if {literal} in value_json.counts else 0)"
        " if value_json is defined and value_json.counts is mapping else 'None' }}"
    )


def line_template(direction: str) -> str:
    """A line's total crossings in ``direction`` (in | out), from its retained state."""
    literal = json.dumps(direction)
    return (
        f"{{{{ value_json.counts[{literal}] if value_json is defined and value_json.counts is mapping"
        f" and value_json.counts[{literal}] is number else 'None' }}}}"
    )


def state_field_template(path: tuple[str, ...]) -> str:
    """The number at ``path`` in a retained state (a zone rule's field, pipelines.rules.StateEntity)."""
    refs = ["value_json" + "".join(f"[{json.dumps(k)}]" for k in path[: i + 1]) for i in range(len(path))]
    checks = " and ".join([*(f"{r} is mapping" for r in refs[:-1]), f"{refs[-1]} is number"])
    return f"{{{{ {refs[-1]} if value_json is defined and {checks} else 'None' }}}}"


def detected_template(label: str) -> str:
    """ON while one detections payload has a detection with ``label``, else OFF ('' for a foreign payload)."""
    literal = json.dumps(label, ensure_ascii=False)  # a safe Jinja string literal (see count_template)
    return (
        f"{{{{ ('ON' if value_json.detections | selectattr('label', 'equalto', {literal}) | list | length > 0"
        " else 'OFF') if value_json is defined and value_json.detections is defined else '' }}"
    )


def count_template(label: str) -> str:
    """Number of detections with ``label`` in one detections payload."""
    # A JSON string is a valid Jinja string literal: Jinja unescapes \\, \" and \uXXXX the same way, so a
    # label with quotes, backslashes or braces cannot break out of the literal.
    literal = json.dumps(label, ensure_ascii=False)
    return (
        f"{{{{ value_json.detections | selectattr('label', 'equalto', {literal}) | list | length"
        " if value_json is defined and value_json.detections is defined else 'None' }}"
    )
