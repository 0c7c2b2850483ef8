"""What a telemetry field declaration says (``Field``), how to find a field's values in a payload (``walk``),
the Prometheus metrics the declarations make (``metric_specs``) and README's table of them (``readme_table``).
The declarations themselves are in agent.telemetry.fields."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Kind(Enum):
    """What a field is to Prometheus (``prometheus``: the metric type)."""

    GAUGE = "gauge"
    TOTAL = "counter"  # a total since its source started; each update adds the increase (a drop: a restart)
    INCREMENT = "counter, per window"  # what the last telemetry window added
    INFO = "gauge, info"  # 1, with the field's value as the last label (``Field.info``)
    HISTOGRAM = "histogram"  # counts that ride beside the payload on its section (StageRows.histograms)
    PAYLOAD = ""  # in the MQTT payload only

    @property
    def prometheus(self) -> str:
        return self.value.split(",")[0]


class Shards(Enum):
    """How the sharded supervisor makes one payload of its shards' reports (agent.telemetry.shards)."""

    OWNER = "owner"  # from the one shard that runs the camera (model): the shards' rows merged
    SUM = "sum"  # summed over the shards and the supervisor
    MEAN = "mean"  # the mean of the shards that report one
    COUNT = "count"  # how many processes reported (the shards and the supervisor)
    WINDOW = "window"  # every shard drains its stage window into the supervisor's, which summarises them
    SUPERVISOR = "supervisor"  # the supervisor's own: its MQTT client, NVML, its shard processes


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a field the payload leaves out when its source has no value


# Prometheus wants base units; a field kept in ms or MiB in the payload is converted on the way.
_TO_BASE: dict[str, Callable[[float], float]] = {"ms": lambda v: v / 1000.0, "MiB": lambda v: v * 2**20}


@dataclass(frozen=True)
class Field:
    """One telemetry field: ``path`` in the payload (``{name}``: every key there, which becomes the label
    ``name``), its ``unit``, how ``shards`` combine it, ``help`` (the metric's HELP and README's text), and
    the Prometheus ``metric`` it feeds (without namespace and ``_total``; several fields may feed one, each
    with its ``const`` labels). ``value`` turns a value that is not a number into one (a list: its length);
    ``default`` is what the payload says when the source gives nothing; ``digits`` rounds a combination of
    shards; ``forget``: a series missing from an update is removed (a zone a reload took away)."""

    path: str
    kind: Kind
    unit: str
    shards: Shards
    help: str
    metric: str = ""
    const: tuple[tuple[str, str], ...] = ()
    info: str = ""
    value: Callable[[Any], float] | None = None
    default: Any = UNSET
    digits: int | None = None
    forget: bool = False

    def __post_init__(self) -> None:
        if (self.kind is Kind.PAYLOAD) != (not self.metric):
            raise ValueError(f"telemetry field {self.path}: a metric exactly when it is not payload-only")
        if (self.kind is Kind.INFO) != bool(self.info):
            raise ValueError(f"telemetry field {self.path}: an info label exactly when it is an info metric")
        if self.metric.endswith("_total"):
            raise ValueError(f"telemetry field {self.path}: {self.metric}: counters get _total themselves")

    @property
    def keys(self) -> tuple[str, ...]:
        """The names of the path's ``{wildcards}``, in order."""
        return tuple(s[1:-1] for s in self.path.split(".") if s.startswith("{"))

    @property
    def labels(self) -> tuple[str, ...]:
        """The metric's label names: the wildcards, the constant labels, the info label."""
        return (*self.keys, *(k for k, _ in self.const), *((self.info,) if self.info else ()))

    def sample(self, raw: Any) -> float | None:
        """The metric's value of a payload value (converted to base units); None where there is none."""
        v = self.value(raw) if self.value is not None else raw
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:  # NaN: no sample
            return None
        return _TO_BASE.get(self.unit, _same)(v)


def _same(v: float) -> float:
    return v


Keys = tuple[str, ...]  # the keys a path's wildcards took


def walk(path: str, payload: Mapping[str, Any]) -> Iterator[tuple[Keys, Any]]:
    """(the keys the path's wildcards took, the value) of every place ``path`` names in ``payload``. A
    wildcard takes a mapping's keys, a list's rows by their own value of that name (``shards.{shard}``:
    each row's ``shard``), and a bare value as the key "" (a backend given as one name)."""

    def go(node: Any, segments: Sequence[str], keys: Keys) -> Iterator[tuple[Keys, Any]]:
        if not segments:
            yield keys, node
            return
        seg, rest = segments[0], segments[1:]
        if seg.startswith("{"):
            if isinstance(node, Mapping):
                items: Iterable[tuple[Any, Any]] = node.items()
            elif isinstance(node, list):
                items = [(row.get(seg[1:-1]), row) for row in node if isinstance(row, Mapping)]
            elif node:
                items = [("", node)]
            else:
                return
            for key, child in items:
                yield from go(child, rest, (*keys, str(key)))
        elif isinstance(node, Mapping) and seg in node:
            yield from go(node[seg], rest, keys)

    yield from go(payload, path.split("."), ())


@dataclass(frozen=True)
class MetricSpec:
    """One Prometheus metric and the fields that feed it."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    fields: tuple[Field, ...]

    @property
    def per_camera(self) -> bool:
        """Its series go when their camera goes (Metrics.update)."""
        return bool(self.labels) and self.labels[0] == "camera"

    @property
    def forget(self) -> bool:
        return any(f.forget for f in self.fields)


def metric_specs(fields: Iterable[Field]) -> dict[str, MetricSpec]:
    """{name: MetricSpec} in the order the fields name them; fields feeding one metric must agree on its
    kind, label names and help."""
    out: dict[str, MetricSpec] = {}
    for f in fields:
        if f.kind is Kind.PAYLOAD:
            continue
        seen = out.get(f.metric)
        if seen is None:
            out[f.metric] = MetricSpec(f.metric, f.kind, f.labels, f.help, (f,))
            continue
        if (seen.kind, seen.labels, seen.help) != (f.kind, f.labels, f.help):
            raise ValueError(f"telemetry fields {seen.fields[0].path} and {f.path} feed {f.metric} unlike")
        out[f.metric] = MetricSpec(seen.name, seen.kind, seen.labels, seen.help, (*seen.fields, f))
    return out


def exposed_name(f: Field, namespace: str) -> str:
    """The metric's name on /metrics (counters end in ``_total``)."""
    return f"{namespace}_{f.metric}" + ("_total" if f.kind.prometheus == "counter" else "")


def readme_table(fields: Iterable[Field], namespace: str = "edge_agent") -> str:
    """README's telemetry table (section "Telemetry fields"): one row per field."""
    rows = [
        "| field | unit | shards | Prometheus | type | labels | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in fields:
        metric = f"`{exposed_name(f, namespace)}`" if f.metric else ""
        labels = [*(f"`{k}`" for k in f.keys), *(f'`{k}="{v}"`' for k, v in f.const)] if f.metric else []
        labels += [f"`{f.info}` (the value)"] if f.info else []
        cells = [f"`{f.path}`", f.unit, f.shards.value, metric, f.kind.prometheus, ", ".join(labels), f.help]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
