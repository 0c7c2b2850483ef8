"""Names that become MQTT topic levels (device ids, groups, models, cameras, zones), topic prefixes, and
host names."""

from __future__ import annotations

import ipaddress
import re

_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # safe inside an MQTT topic level (fullmatch: '$' lets a '\n' by)
MAX_NAME = 128  # device ids, groups, model, camera, zone and line names: topic levels (MQTT topics <= 64 KiB)


def level_problem(name: str) -> str | None:
    if not _NAME.fullmatch(name):
        return "may only hold ASCII letters (A-Z, a-z), digits (0-9), '_', '-' and '.'"
    if len(name) > MAX_NAME:
        return f"at most {MAX_NAME} characters"
    return None


MAX_DISPLAY_NAME = 64  # a camera's, zone's or line's display `name` (Home Assistant's entity names)


def display_name_problem(name: str) -> str | None:
    """Why `name` cannot be a display name (any Unicode text, shown, never a topic level), or None."""
    if not name.strip():
        return "must not be empty"
    if len(name) > MAX_DISPLAY_NAME:
        return f"at most {MAX_DISPLAY_NAME} characters"
    if any(not (c.isprintable() or c == " ") for c in name):
        return "must not contain control characters (tabs, line breaks, ...)"
    return None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a device id or a fleet group (one topic level), or None. A leading '_' is
    reserved for the fleet's shared topics ({prefix}/_all, {prefix}/_group)."""
    problem = level_problem(name)
    if problem is not None:
        return problem
    if name.startswith("_"):
        return "must not start with '_' (reserved for the fleet topics _all and _group)"
    return None


MAX_PREFIX_BYTES = 512


def topic_prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot start this agent's topics (mqtt.prefix, homeassistant.discovery_prefix), or None.
    It may have several levels (site/edge-agent), none of them empty, without wildcards; topics that start
    with '$' ($SYS/...) are the broker's (MQTT 3.1.1 and 5, 4.7.2)."""
    if not prefix:
        return "must be a topic prefix, not empty"
    if prefix.startswith("/") or prefix.endswith("/"):
        return "must be a topic prefix without a leading or trailing '/'"
    if "//" in prefix:
        return "must be a topic prefix without an empty level ('//')"
    if "+" in prefix or "#" in prefix:
        return "must be a topic prefix without the wildcards '+' or '#'"
    if prefix.startswith("$"):
        return "must be a topic prefix not starting with '$' (such topics are the broker's, e.g. $SYS)"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in prefix):
        return "must be a topic prefix without control characters"
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        return f"must be a topic prefix of at most {MAX_PREFIX_BYTES} bytes"
    return None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot name a broker, or None. paho only fails on these once connecting: an empty
    host ended start-up with a traceback, and some (e.g. 'a..b') end its network thread for good."""
    if not host:
        return "must not be empty"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host.removesuffix(".")
    if len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    # The value is not echoed: 'user:password@host' is a plausible mistake.
    return "must be a host name or an IP address, without scheme, port, path or credentials"
