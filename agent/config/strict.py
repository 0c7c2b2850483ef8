"""Strict values: the base of every config section.

The schema is strict: a string is not a number ("5"), nor a boolean ("yes", "true"), and a number is not a
string. Two things still take a field's type (StrictModel._take_field_types): a value that a ${VAR}
substitution made (the environment only has strings) and a whole float for an integer field (1e5, which
YAML reads as a float). Paths and secrets are written as strings (ConfigPath, Secret).
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, SecretStr, Strict, model_validator


class EnvText(str):
    """A string that a ${VAR} substitution produced (see StrictModel._take_field_types)."""


BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
_INT_TEXT = re.compile(r"[-+]?[0-9]{1,30}")


def raise_problem(problem: str | None) -> None:
    """A field validator's end: the problem a `*_problem` check found becomes the ValueError pydantic reports
    for the field (None: the value stands)."""
    if problem is not None:
        raise ValueError(problem)


def _scalar_kinds(ann: Any) -> set[type]:
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _scalar_kinds(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_kinds(a) for a in typing.get_args(ann)))
    return {ann} if ann in (bool, int, float) else set()


def _list_item(ann: Any) -> Any:
    """The item type of a list field (list[int], list[int] | None), else None."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _list_item(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        items = [i for i in (_list_item(a) for a in typing.get_args(ann)) if i is not None]
        return items[0] if len(items) == 1 else None
    return typing.get_args(ann)[0] if origin is list else None


def _only_int(ann: Any) -> bool:
    """An integer field (int, int | None): not one that also takes a word (pipeline.shards: int | 'auto')."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _only_int(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or _only_int(a) for a in typing.get_args(ann))
    return ann is int


def _settle(ann: Any, v: Any) -> Any:
    kinds = _scalar_kinds(ann)
    if isinstance(v, EnvText) and kinds:
        text = v.strip()
        if bool in kinds and text.lower() in BOOL_WORDS:
            return BOOL_WORDS[text.lower()]
        if int in kinds and _INT_TEXT.fullmatch(text):
            return int(text)
        if float in kinds and len(text) <= 64:
            try:
                return float(text)
            except ValueError:
                pass
        return str(v)
    if type(v) is float and _only_int(ann) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        item = _list_item(ann)
        if item is not None and _scalar_kinds(item):
            return [_settle(item, x) for x in v]
    return v


def _path_text(v: Any) -> Any:
    if isinstance(v, str) and not v.strip():
        raise ValueError("must not be empty")
    return v


# A path is written as a string (strict mode would only take a Path object); "" would be the current folder.
ConfigPath = Annotated[Path, Strict(False), BeforeValidator(_path_text)]
Secret = Annotated[SecretStr, Strict(False)]


class StrictModel(BaseModel):
    # allow_inf_nan=False: .nan and .inf are refused as "must be a finite number" before any range check
    # (NaN compares false with everything: it failed as "must be <= 1" on fields that take 0.5).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _take_field_types(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: _settle(fields[k].annotation, v) if k in fields else v for k, v in data.items()}
