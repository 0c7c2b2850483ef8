"""Schema errors as config messages: one line per problem, `FILE: key.path: message`, never quoting a value
that may be a secret."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import ValidationError

from agent.config.errors import show
from agent.config.strict import BOOL_WORDS

MAX_LINES = 50  # problems shown of one file; then "... and N more"


def _num(v: Any) -> str:
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:g}"
    return str(v)


def _kind(v: Any) -> str:
    """What a wrong value is, in YAML's words; never the value itself (it may be a secret)."""
    if v is None:
        return "empty (null)"
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return "a list"
    return type(v).__name__


def _number_text(v: str) -> bool:
    try:
        return len(v) <= 64 and math.isfinite(float(v))
    except ValueError:
        return False


def _wrong(what: str, e: Any) -> str:
    """'must be <what>', and what the value is where that helps: a quoted number or boolean is a string
    (strict types), a list is not a number. Numbers may be shown, strings never are."""
    v = e.get("input")
    if isinstance(v, str):
        text = v.strip()
        quoted = (what in ("a number", "an integer") and _number_text(text)) or (
            what == "true or false" and text.lower() in (*BOOL_WORDS, "y", "n", "1", "0")
        )
        if quoted:
            return f"must be {what}, not a string (write it without quotes)"
        return (
            f"must be {what}"
            if what in ("a number", "an integer", "true or false")
            else f"must be {what}, not a string"
        )
    if what == "an integer" and isinstance(v, float):
        return f"must be an integer, got {v:g}"
    kind = _kind(v)
    if kind == "a number" and what in ("a number", "an integer"):
        return f"must be {what}"
    return f"must be {what}, not {kind}"


def _finite(e: Any) -> str:
    v = e.get("input")
    if isinstance(v, float) and math.isnan(v):
        return "must be a finite number, not NaN"
    return "must be a finite number, not infinity"


_MESSAGES = {
    "extra_forbidden": lambda e: "unknown key",
    "missing": lambda e: "required key is missing",
    "greater_than": lambda e: f"must be > {_num(e['ctx']['gt'])}",
    "greater_than_equal": lambda e: f"must be >= {_num(e['ctx']['ge'])}",
    "less_than": lambda e: f"must be < {_num(e['ctx']['lt'])}",
    "less_than_equal": lambda e: f"must be <= {_num(e['ctx']['le'])}",
    "literal_error": lambda e: f"must be one of {e['ctx']['expected']}",
    "int_parsing": lambda e: "must be an integer",
    "int_type": lambda e: _wrong("an integer", e),
    "int_from_float": lambda e: "must be an integer",
    "float_parsing": lambda e: "must be a number",
    "float_type": lambda e: _wrong("a number", e),
    "finite_number": _finite,
    "bool_parsing": lambda e: "must be true or false",
    "bool_type": lambda e: _wrong("true or false", e),
    "string_type": lambda e: _wrong("a string", e),
    "path_type": lambda e: _wrong("a path (a string)", e),
    "dict_type": lambda e: _wrong("a mapping", e),
    "model_type": lambda e: _wrong("a mapping", e),
    "model_attributes_type": lambda e: _wrong("a mapping", e),
    "list_type": lambda e: _wrong("a list", e),
    "tuple_type": lambda e: _wrong("a list", e),
    "string_pattern_mismatch": lambda e: f"must match {e['ctx']['pattern']}",
    "too_long": lambda e: f"at most {e['ctx']['max_length']} entries",
    "too_short": lambda e: f"at least {e['ctx']['min_length']} entries",
}
# Lines of AgentConfig._cross carry their own key path.
_OWN_KEY = re.compile(r"(models|cameras)[.:]")


def joined(lines: list[str], source: str) -> str:
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"{source}: ... and {len(lines) - MAX_LINES} more"]
    return "\n".join(show(line, 1000) for line in lines)


def format_errors(
    exc: ValidationError, source: str, failed: list[tuple[Any, ...]] | None = None
) -> list[str]:
    """One line per problem, `FILE: key.path: message`. Errors under a key in `failed` are left out: that
    value already has its line (an unset ${VAR}) and the schema only saw its text."""
    lines = []
    for err in exc.errors(include_url=False, include_input=True):
        loc = tuple(err["loc"])
        if any(loc[: len(f)] == f for f in failed or ()):
            continue
        where = show(".".join(str(p) for p in loc))
        fmt = _MESSAGES.get(err["type"])
        msg = fmt(err) if fmt is not None else str(err["msg"]).removeprefix("Value error, ")
        for line in msg.splitlines():
            if not where and _OWN_KEY.match(line):
                lines.append(f"{source}: {line}")
            elif line.startswith(("models.", "cameras.")) and ":" in line:
                lines.append(f"{source}: {line}")  # cross-field errors carry their own key path
            else:
                lines.append(f"{source}: {where}: {line}" if where else f"{source}: {line}")
    return lines


def _key_of(line: str, source: str) -> str | None:
    """The key path a `FILE: key.path: message` line names, or None."""
    if not line.startswith(f"{source}: "):
        return None
    key, sep, _ = line[len(source) + 2 :].partition(": ")
    return key if sep and " " not in key else None


def _longest(key: str, found: dict[str, Any]) -> tuple[str, Any] | None:
    """The longest prefix of `key` (whole levels) that `found` holds, with its value."""
    parts = key.split(".")
    while parts:
        at = ".".join(parts)
        if at in found:
            return at, found[at]
        parts.pop()
    return None


def placed(
    lines: list[str],
    source: str,
    key_lines: dict[str, int],
    used: dict[str, list[str]] | None = None,
    taken: dict[str, str] | None = None,
) -> list[str]:
    """Each `FILE: key.path: message` line with where it comes from: the line of the key in the file, the
    variable a value came from (its name, never its value), and `(from camera_defaults)` where a camera's
    value was merged in from there (agent.config.defaults; such a line that camera_defaults' own key already
    reports is left out)."""
    taken = taken or {}
    keys = (_key_of(line, source) for line in lines)
    own = {key for key in keys if key and key.startswith("camera_defaults.")}
    out = []
    for line in lines:
        key = _key_of(line, source)
        if key is None:
            out.append(line)
            continue
        notes = []
        where = key
        inherited = _longest(key, taken)
        if inherited is not None:
            where = inherited[1] + key[len(inherited[0]) :]
            if where in own:
                continue  # the same value's problem, reported once at camera_defaults
        at = _longest(where, key_lines)
        if at is not None:
            notes.append(f"line {at[1]}")
        if inherited is not None:
            notes.append("from camera_defaults")
        names = _longest(key, used or {}) or _longest(where, used or {})
        if names is not None and names[1]:
            notes.append("the value of " + ", ".join(f"${{{n}}}" for n in names[1]))
        out.append(f"{line} ({'; '.join(notes)})" if notes else line)
    return out
