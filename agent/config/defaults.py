"""`camera_defaults:`: keys merged into every camera before the schema sees it, so 100 cameras need not
repeat one block. Sections (tracking, events, zones, ...) merge key by key, a camera's own keys win at every
level; a list (classes, a polygon, labels) is one value: a camera's own list replaces the default's whole.
The merged cameras are what runs and what a reload compares, so a change of camera_defaults plans as the
same change written in each camera would.
"""

from __future__ import annotations

from typing import Any

from pydantic import create_model
from pydantic.fields import FieldInfo

from agent.config.camera import CameraConfig
from agent.config.env import MAX_NODES
from agent.config.errors import ConfigError
from agent.config.strict import StrictModel

# A camera's own: its source and what tells it apart (its display name, its shard).
OWN_KEYS = ("url", "pipeline", "name", "shard")


def _optional(info: FieldInfo) -> tuple[Any, FieldInfo]:
    """A camera field as a default: the same type, constraints and reload class, absent unless written."""
    field = FieldInfo.merge_field_infos(info, default=None)
    field.default_factory = None
    annotation: Any = info.annotation
    return annotation | None, field


# Each key as the camera's (its checks, its reload class), every one optional; a camera's own keys refused.
CameraDefaults: type[StrictModel] = create_model(  # type: ignore[call-overload]
    "CameraDefaults",
    __base__=StrictModel,
    __doc__="camera_defaults: any camera key but its own (OWN_KEYS); see agent.config.defaults.",
    **{name: _optional(info) for name, info in CameraConfig.model_fields.items() if name not in OWN_KEYS},
)


def _count(value: Any) -> int:
    """How many values `value` holds (itself included)."""
    if isinstance(value, dict):
        return 1 + sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


def _taken(loc: tuple[Any, ...], taken: dict[str, str]) -> bool:
    """Whether the value at `loc` came from camera_defaults (it, or a section around it, was merged in)."""
    return any(".".join(map(str, loc[:n])) in taken for n in range(len(loc), 2, -1))


def _merge(default: Any, own: Any, at: str, taken: dict[str, str], rel: str) -> Any:
    """`own` with what `default` adds; `taken`: camera key path -> its camera_defaults key path."""
    if not isinstance(own, dict) or not isinstance(default, dict):
        return own
    out = dict(own)
    for key, value in default.items():
        path, dpath = f"{at}.{key}", f"{rel}.{key}"
        if key not in out:
            out[key] = value
            taken[path] = dpath
        else:
            out[key] = _merge(value, out[key], path, taken, dpath)
    return out


def apply_camera_defaults(
    data: dict[Any, Any], failed: list[tuple[Any, ...]]
) -> tuple[dict[Any, Any], dict[str, str], list[str]]:
    """`data` with camera_defaults merged into each camera (camera_defaults itself kept for the schema to
    check), the camera key paths whose value came from it (-> the camera_defaults path) and the problems
    found here (a camera's own key written as a default); ConfigError where the merge would make too many
values. `failed` (unset variables) grows by the cameras'
    copies of such values."""
    defaults = data.get("camera_defaults")
    cameras = data.get("cameras")
    if not isinstance(defaults, dict):
        return data, {}, []
    problems = [
        f"camera_defaults.{key}: a camera's own key (its source, display name or shard), not a default"
        for key in defaults
        if key in OWN_KEYS
    ]
    merged_from = {k: v for k, v in defaults.items() if k not in OWN_KEYS}
    data = {**data, "camera_defaults": merged_from}
    if not isinstance(cameras, dict):
        return data, {}, problems
    # The merge shares the defaults' values among the cameras; the schema checks each copy (as with aliases).
    if len(cameras) * _count(merged_from) > MAX_NODES:
        raise ConfigError(f"camera_defaults: too many values once merged into {len(cameras)} cameras")
    taken: dict[str, str] = {}
    out = {}
    for name, cam in cameras.items():
        out[name] = _merge(merged_from, cam, f"cameras.{name}", taken, "camera_defaults")
        for loc in list(failed):
            if loc[:1] == ("camera_defaults",) and _taken(("cameras", name, *loc[1:]), taken):
                failed.append(("cameras", name, *loc[1:]))
    return {**data, "cameras": out}, taken, problems
