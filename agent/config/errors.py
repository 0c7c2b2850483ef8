"""ConfigError, and text as a config message may show it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path. `config`: the config as far as
    it could be read where only values outside the schema failed (an unset variable, a missing file named
    in it), so a caller can check the rest (agent.preflight) and report every problem at once."""

    def __init__(self, message: str, config: Any = None) -> None:
        super().__init__(message)
        self.config = config


def show(text: str, limit: int = 200) -> str:
    """Text as it may be printed: control characters escaped (a key can hold anything), cut short."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit] + "..."
