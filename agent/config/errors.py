"""ConfigError, and text as a config message may show it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


def show(text: str, limit: int = 200) -> str:
    """Text as it may be printed: control characters escaped (a key can hold anything), cut short."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit] + "..."
