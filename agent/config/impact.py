"""What a change of each config key needs on a reload (SIGHUP), declared next to the key in the schema:

    decoder: Annotated[Literal["auto", "cpu", "nvdec"], Impact.CAMERA] = "auto"

A field of a nested section takes the class of the field that holds it unless it declares its own
(`zones` is ANALYTICS, so every key of a zone is; `telemetry` declares nothing, its two keys do).
agent.config.reload plans from these declarations; `undeclared` names any key without a class (a test keeps it
empty) and `impact_table` writes README's table of what a reload changes.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo


class Impact(Enum):
    AGENT = "agent"  # kept until the agent restarts: a reload reports it and keeps the old value
    CONNECTION = "connection"  # a new MQTT connection; the old one is closed gracefully
    MODEL = "model"  # the model is reopened, its cameras restart
    CAMERA = "camera"  # the camera restarts: its reader is rebuilt
    ROUTE = "route"  # the running camera's route (class mask, score floor); the reader keeps streaming
    ANALYTICS = "analytics"  # the running camera's tracking, zones, lines, events in place
    PLACEMENT = "placement"  # which shard runs the camera: the supervisor moves it there
    LIVE = "live"  # read where it is used: in effect at once

    @property
    def needs(self) -> str:
        """What a change of a key of this class does, as README's table says it."""
        return _NEEDS[self]


_NEEDS = {
    Impact.AGENT: "needs a restart: the reload says so and keeps the old value",
    Impact.CONNECTION: "a new MQTT connection; the old status topic is left `offline`",
    Impact.MODEL: "the model reopens (ONNX Runtime serves at once, an engine builds in the background as at "
    "start); its cameras restart",
    Impact.CAMERA: "the camera restarts (its reader is rebuilt)",
    Impact.ROUTE: "on the running camera; its reader keeps streaming",
    Impact.ANALYTICS: "in place, the reader keeps streaming; unchanged zones and lines keep their counts",
    Impact.PLACEMENT: "with shards: the camera moves to that shard",
    Impact.LIVE: "at once",
}


def declared(info: FieldInfo) -> Impact | None:
    """The class a field declares itself (Annotated metadata), or None."""
    found = [m for m in info.metadata if isinstance(m, Impact)]
    if len(found) > 1:
        raise TypeError(f"a field declares {len(found)} reload impacts: {found}")
    return found[0] if found else None


# ---- the schema's declarations ---------------------------------------------------------------------------
def _models_in(ann: Any) -> list[type[BaseModel]]:
    """The config sections a field's type holds (a section, a dict or list of them, optional)."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _models_in(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType, dict, list, tuple):
        return [m for a in typing.get_args(ann) for m in _models_in(a)]
    return [ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def _entries(ann: Any) -> str:
    """`*.` for each dict or list level around a field's sections (a zone's keys are `zones.*.polygon`)."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _entries(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return max((_entries(a) for a in typing.get_args(ann)), key=len)
    if origin in (dict, list):
        return "*." + _entries(typing.get_args(ann)[-1])
    return ""


def _is_section(ann: Any) -> bool:
    """A field that holds exactly one section (no dict, list or None around it)."""
    return isinstance(ann, type) and issubclass(ann, BaseModel)


class Key(NamedTuple):
    path: str  # `cameras.*.zones.*.polygon`: `*` for a dict's (or list's) entries
    impact: Impact | None  # declared here or inherited; None: neither
    own: bool  # declared by this field
    field: FieldInfo


def keys(model: type[BaseModel], prefix: str = "", inherited: Impact | None = None) -> Iterator[Key]:
    """Every key of `model`, nested sections walked, with its class."""
    for name, info in model.model_fields.items():
        path = prefix + name
        own = declared(info)
        impact = own if own is not None else inherited
        yield Key(path, impact, own is not None, info)
        for section in _models_in(info.annotation):
            yield from keys(section, f"{path}.{_entries(info.annotation)}", impact)


def undeclared(model: type[BaseModel], members: tuple[str, ...] = ()) -> list[str]:
    """Keys without a class. A field may leave it to its fields only where it holds one section (a key
    of a dict of sections, or of an optional one, comes and goes: that change needs a class), or where the
    planner handles its entries (`members`: the top level's cameras)."""
    return [
        k.path
        for k in keys(model)
        if k.impact is None and k.path not in members and not _is_section(k.field.annotation)
    ]


def impact_table(model: type[BaseModel]) -> str:
    """README's table: the keys that declare a class, by class (nested keys that inherit are not listed)."""
    by_class: dict[Impact, list[str]] = {}
    for key in keys(model):
        # camera_defaults' keys repeat the cameras' declarations: a change plans as in each camera it reaches.
        if key.own and key.impact is not None and not key.path.startswith("camera_defaults."):
            by_class.setdefault(key.impact, []).append(key.path)
    lines = ["| a change of | takes effect |", "|---|---|"]
    for impact in Impact:
        names = ", ".join(f"`{_shown(k)}`" for k in by_class.get(impact, []))
        if names:
            lines.append(f"| {names} | {impact.needs} |")
    return "\n".join(lines)


def _shown(key: str) -> str:
    """A key as README writes it: a dict's names by the dict's initial (`cameras.C.zones.Z.polygon`)."""
    parts = key.split(".")
    return ".".join(p if p != "*" else parts[i - 1][0].upper() for i, p in enumerate(parts))


# ---- what differs between two configs --------------------------------------------------------------------
@dataclass(frozen=True)
class Change:
    """One difference between two configs: where it is and the class of the key that declares for it."""

    key: tuple[str, ...]  # where the values differ: ("cameras", "gate", "zones", "door", "inertia")
    declared_at: tuple[str, ...]  # the key whose declaration applies: ("cameras", "gate", "zones")
    impact: Impact

    @property
    def name(self) -> str:
        return ".".join(self.declared_at)


Rule = tuple[tuple[str, ...], Impact]  # the declaring key and its class


def changes(
    old: BaseModel,
    new: BaseModel,
    at: tuple[str, ...] = (),
    inherited: Rule | None = None,
    skip: tuple[str, ...] = (),
) -> list[Change]:
    """Every difference between two sections of one type, each with its class (declared or inherited);
    `skip`: fields the caller compares itself."""
    if type(old) is not type(new):
        raise TypeError(f"{'.'.join(at)}: cannot compare {type(old).__name__} with {type(new).__name__}")
    out: list[Change] = []
    for name, info in type(new).model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        if a == b or name in skip:
            continue
        key = (*at, name)
        own = declared(info)
        out += _value_changes(a, b, key, (key, own) if own is not None else inherited)
    return out


def _value_changes(a: Any, b: Any, key: tuple[str, ...], rule: Rule | None) -> list[Change]:
    if isinstance(a, BaseModel) and type(a) is type(b):
        return changes(a, b, key, rule)
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():  # the same names: which differ
        out: list[Change] = []
        for k in a:
            if a[k] != b[k]:
                out += _value_changes(a[k], b[k], (*key, k), rule)
        return out
    if rule is None:
        raise TypeError(f"{'.'.join(key)}: no reload impact declared (agent.config.impact)")
    return [Change(key, rule[0], rule[1])]
