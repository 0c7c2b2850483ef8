"""The strict YAML loader: duplicate keys found with their lines, YAML 1.2 exponent floats read as numbers,
and every YAML problem a ConfigError naming the file and the line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from agent.config.errors import ConfigError, show

_MERGE = "tag:yaml.org,2002:merge"
_INDEX = re.compile(r"\[([0-9]+)\]")
MAX_KEYS = 100_000  # key lines kept for messages (a bound on what a document of aliases can make)
# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: no dot or no exponent sign (1e5, 2.5e-3, 1.5E3).
# With strict types a string is not a number: `offline_queue: 1e5` would be refused as text.
_FLOAT_12 = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+")


class _Loader(yaml.SafeLoader):
    """SafeLoader that finds duplicate keys (YAML forbids them; PyYAML silently keeps the last one) and
    reads YAML 1.2 exponent floats as numbers."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, str, list[int]]] = []  # (first line, key path, lines)
        # "cameras.gate.fps" -> the line of its key (1-based), for the schema's messages; at most MAX_KEYS.
        self.key_lines: dict[str, int] = {}

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self._find_duplicates(node)
        return self.construct_document(node)

    def _key(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return None  # a list or a mapping as a key: the constructor refuses it
        try:
            key = self.construct_object(node)
            hash(key)
        except Exception:  # a value its tag's constructor refuses (!!int x): construct_document says so
            return ("unreadable", node.tag, node.value)
        return key

    def _find_duplicates(self, root: yaml.Node) -> None:
        # Iterative, and each node once: aliases may share one node many times (see MAX_NODES).
        seen: set[int] = set()
        todo: list[tuple[yaml.Node, str]] = [(root, "")]
        while todo:
            node, path = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                todo += [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
            elif isinstance(node, yaml.MappingNode):
                lines: dict[Any, list[int]] = {}
                names: dict[Any, str] = {}
                for key_node, value_node in node.value:
                    if key_node.tag == _MERGE:  # '<<: *base': keys written here override the merged ones
                        todo.append((value_node, path))
                        continue
                    key = self._key(key_node)
                    name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                    todo.append((value_node, f"{path}.{name}" if path else name))
                    if len(self.key_lines) < MAX_KEYS:
                        at = key_path(f"{path}.{name}" if path else name)
                        self.key_lines.setdefault(at, key_node.start_mark.line + 1)
                    if key is not None:
                        lines.setdefault(key, []).append(key_node.start_mark.line + 1)
                        names.setdefault(key, name)
                for key, where in lines.items():
                    if len(where) > 1:
                        name = names[key]
                        self.duplicates.append((where[0], f"{path}.{name}" if path else name, where))


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


def key_path(path: str) -> str:
    """A key path as the schema's messages write it: list items by index ("polygon.2", not "polygon[2]")."""
    return _INDEX.sub(r".\1", path)


def _lines(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"


def read_yaml(text: str, path: Path) -> tuple[Any, list[str], dict[str, int]]:
    """The document in `text` (read from `path`), one line per duplicate key (reported with the schema's
    problems) and the line of each key ("cameras.gate.fps"; list items by index: "polygon.2"); ConfigError
    naming the file and the line where it is not YAML."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # the reader refuses control characters here
        data = loader.get_single_data()
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        why = (
            f"character #x{exc.character:04x} is not allowed"
            if isinstance(exc.character, int)
            else exc.reason
        )
        raise ConfigError(f"{path}: invalid YAML (line {line}): {why}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {show(str(why))}{_flow_hint(text, mark)}") from None
    except (ValueError, OverflowError, TypeError, AttributeError, KeyError, IndexError) as exc:
        # A value PyYAML's constructors refuse without a YAMLError: 2024-13-45, 10**5000, !!timestamp x.
        digits = isinstance(exc, ValueError) and "digits" in str(exc)
        why = "an integer of more than 4300 digits" if digits else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, AttributeError):  # PyYAML's !!timestamp on a value that is not one
            why = "a value does not fit its !!tag"
        raise ConfigError(f"{path}: invalid YAML: a value cannot be read ({why})"[:300]) from None
    finally:
        if loader is not None:
            loader.dispose()
    duplicates = [
        f"{path}: {show(key)}: duplicate key on lines {_lines(lines)} (YAML keeps only the last)"
        for _, key, lines in sorted(loader.duplicates)
    ]
    return data, duplicates, loader.key_lines


def _flow_hint(text: str, mark: Any) -> str:
    """A ${VAR} unquoted inside { } or [ ]: YAML ends a plain value at '{' or '}' there, so it cannot be
    read; quoting it is the fix."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    if "${" in line and ("{" in line.replace("${", "") or "[" in line):
        return ' (a ${VAR} inside { } or [ ] must be quoted: key: "${VAR:-default}", or use block style)'
    return ""
