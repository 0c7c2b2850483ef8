"""${VAR} and ${VAR:-default} in config values, and the limits on a loaded document's size."""

from __future__ import annotations

import re
from typing import Any

from agent.config.errors import ConfigError, show
from agent.config.strict import EnvText

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
MAX_NODES = 100_000  # YAML aliases can make a small file expand exponentially ("billion laughs")
MAX_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "must not contain a NUL character"
    if _SURROGATE.search(text):
        return "is not valid Unicode text (a lone surrogate)"
    return None


def _substitute(text: str, env: dict[str, str]) -> tuple[str, list[str]]:
    """`text` with its variables replaced, and the names of those neither set nor defaulted (left as
    they were)."""
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        missing.append(name)
        return m.group(0)

    return _ENV.sub(sub, text), missing


def expand_env(
    data: Any,
    source: str,
    env: dict[str, str],
    problems: list[str],
    failed: list[tuple[Any, ...]],
    used: dict[str, list[str]] | None = None,
) -> Any:
    """`data` with ${VAR} and ${VAR:-default} replaced in every string. A problem (an unset variable, a
    string no program can take) is added to `problems` and its key path to `failed`; `used` gets the
    variables each substituted value came from ("cameras.gate.fps" -> ["FPS"]), for the schema's messages.
    The file as a whole (too many values, nested too deeply) raises."""
    budget = [MAX_NODES]

    def walk(node: Any, loc: tuple[Any, ...], path: str) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(f"{source}: too many values (over {MAX_NODES}; YAML aliases expanding?)")
        if len(loc) > MAX_DEPTH:
            raise ConfigError(f"{source}: {show(path, 80)}: nested too deeply")
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                key_path = f"{path}.{k}" if path else str(k)
                problem = _text_problem(k) if isinstance(k, str) else None
                if problem is not None:
                    problems.append(f"{source}: {show(key_path)}: the key {problem}")
                    failed.append((*loc, k))
                out[k] = walk(v, (*loc, k), key_path)
            return out
        if isinstance(node, list):
            return [walk(v, (*loc, i), f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, str):
            return node
        text: str = node
        if "${" in node:
            text, missing = _substitute(node, env)
            for name in dict.fromkeys(missing):
                problems.append(f"{source}: {show(path)}: environment variable {name} is not set")
            if missing:
                failed.append(loc)
                return node
            if text != node:
                text = EnvText(text)
            if used is not None:
                used[".".join(str(p) for p in loc)] = [m.group(1) for m in _ENV.finditer(node)]
        problem = _text_problem(text)
        if problem is not None:
            problems.append(f"{source}: {show(path)}: {problem}")
            failed.append(loc)
        return text

    return walk(data, (), "")
