"""Analytics rules over zones and lines: what a rule declares, the registry, and the event types it gives.

A rule declares the region it works on (zone or line), the event types it emits, its per-(track, region)
state columns (pipelines.state.StateTable) and where the event's own fields go. Everything downstream
follows from the registry: the events code publishes every rule's transitions through one path
(agent.events), the event types counted in telemetry and Prometheus are ``event_types()``, Home Assistant
discovery adds the entities a zone rule declares (agent.homeassistant).

Two rules are built in and run by the compiled steps (pipelines/kernels/regions.pyx) or their numpy
reference: zone occupancy (pipelines.zones: ``zone_enter``, ``zone_leave``) and line crossing
(pipelines.lines: ``line_cross``). Every module of this package holds ``ZoneRule``s: rules that run after
the occupancy step, in numpy on both paths, on the zones' state table (occupancy's columns and their own),
turned on per zone by one key of the zone's config (None or absent: off). A new one is a module here plus
its key in agent/config/analytics.py ``ZoneConfig``.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np
from numpy.typing import DTypeLike

from pipelines.regions import RegionSpec, Transition
from pipelines.state import StateTable


class Rule:
    """A rule's declaration (class attributes; see the module docstring)."""

    name: ClassVar[str]
    region: ClassVar[str]  # "zone" | "line": the events name it with this key, their index is into its specs
    events: ClassVar[tuple[str, ...]]  # the event types its transitions have
    columns: ClassVar[Mapping[str, DTypeLike]] = {}  # its per-(track, region) state
    lead: ClassVar[tuple[str, ...]] = ()  # event fields that come right after the region's name
    moves: ClassVar[bool] = False  # its events change the zones a track is in (an object update is due)
    # The event by which a track enters a region (events.objects: in_zones announces the object then).
    enters: ClassVar[str | None] = None


class Occupancy(Rule):
    """Tracks in zones (pipelines.zones, compiled or numpy)."""

    name = "occupancy"
    region = "zone"
    events = ("zone_enter", "zone_leave")
    columns: ClassVar[Mapping[str, DTypeLike]] = {
        "inside": np.bool_,  # in the zone (after inertia)
        "entered_at": np.float64,  # frame time (wall clock of its capture) of the enter
        "visited": np.bool_,  # ever in it (the object's "entered_zones")
        "streak": np.int16,  # frames in a row the raw test disagreed with `inside`
        "since": np.float64,  # frame time (wall clock) of the streak's first frame (zones' inertia_s)
    }
    moves = True
    enters = "zone_enter"


class Crossing(Rule):
    """Tracks crossing lines (pipelines.lines, compiled or numpy)."""

    name = "crossing"
    region = "line"
    events = ("line_cross",)
    columns: ClassVar[Mapping[str, DTypeLike]] = {"side": np.int8}  # -1 left, +1 right, 0 not yet known
    lead = ("direction",)


@dataclass(frozen=True)
class StateEntity:
    """A Home Assistant sensor a zone rule adds to each zone where it is on: object id
    ``{camera}_zone_{zone}_{suffix}``, name ``{camera} {zone} {name}``, reading the number at ``path`` in the
    zone's retained state."""

    suffix: str
    name: str
    path: tuple[str, ...]
    unit: str | None = None
    state_class: str | None = None


class ZoneRule(Rule, ABC):
    """A rule run after the occupancy step on the zones of one camera (one instance per ``Zones``)."""

    region = "zone"
    key: ClassVar[str]  # the zone config key that turns it on, and its value per zone (RegionSpec.params)
    entities: ClassVar[tuple[StateEntity, ...]] = ()

    def __init__(self, specs: Sequence[RegionSpec]) -> None:
        self.specs = tuple(specs)
        self.values = [s.param(self.key) for s in self.specs]  # None where off

    @classmethod
    def wanted(cls, specs: Sequence[RegionSpec]) -> bool:
        """Whether any of these zones turns it on."""
        return any(s.param(cls.key) is not None for s in specs)

    @abstractmethod
    def step(
        self, state: StateTable, table: np.ndarray, active: np.ndarray, ts: float, out: list[Transition]
    ) -> bool:
        """One frame after the occupancy step (``state`` up to date, ``table`` the tracker's, ``active`` the
        tracks confirmed and seen in it, ``ts`` its time): transitions appended to ``out``; True when what
        ``fields`` reports changed."""

    def carry(self, old: ZoneRule, before: Sequence[int | None]) -> None:
        """Take over ``old``'s per-zone values where zone j was ``old``'s ``before[j]`` (same spec)."""

    def clear(self) -> None:
        """Every track gone (a reset)."""

    def fields(self, j: int) -> dict[str, Any]:
        """What it adds to zone j's retained state and after its own events (nothing where off)."""
        return {}


@cache
def registered() -> tuple[type[Rule], ...]:
    """Every rule: the built-in ones, then this package's modules' zone rules (by module name). Two rules
    with one event type, state column or config key are refused (their events or state would mix)."""
    found: list[type[Rule]] = [Occupancy, Crossing]
    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        module = importlib.import_module(f"{__name__}.{mod}")
        found += [
            v
            for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, ZoneRule) and v.__module__ == module.__name__
        ]
    for what, names in (
        ("event type", [t for r in found for t in r.events]),
        ("zone state column", [c for r in found if r.region == "zone" for c in r.columns]),
        ("zone config key", [r.key for r in found if issubclass(r, ZoneRule)]),
    ):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise TypeError(f"pipelines.rules: {what} {twice[0]!r} declared by two rules")
    return tuple(found)


def zone_rules() -> tuple[type[ZoneRule], ...]:
    return tuple(r for r in registered() if issubclass(r, ZoneRule))


def event_types() -> tuple[str, ...]:
    """The event types of every rule (zone and line events), in registration order."""
    return tuple(t for r in registered() for t in r.events)


def rule_of(event_type: str) -> type[Rule]:
    """The rule whose events have this type (KeyError for another)."""
    return _by_event()[event_type]


@cache
def _by_event() -> dict[str, type[Rule]]:
    return {t: r for r in registered() for t in r.events}


def zone_params(zone: object) -> tuple[tuple[str, Any], ...]:
    """The zone rules' keys set on ``zone`` (a zone's config), for ``RegionSpec.params``."""
    return tuple((r.key, v) for r in zone_rules() if (v := getattr(zone, r.key, None)) is not None)
