"""Zones' time-based inertia (``inertia_s``, issue 36: 7): a flicker across a zone's edge shorter than
``inertia_s`` is no enter at any frame rate, a real entry is; the frames count (``inertia``) still holds
too. Compiled kernel and numpy code alike; the config key and its reload impact."""

from __future__ import annotations

import numpy as np
import pytest

from agent.config import AgentConfig
from agent.config.analytics import ZoneConfig
from agent.config.impact import Impact, keys
from pipelines.analytics import AnalyticsSettings, CameraAnalytics
from pipelines.frames import Detections
from pipelines.regions import RegionSpec
from pipelines.tracking import TrackerParams

SIZE = (1000, 1000)
ZONE = ((0.5, 0.0), (1.0, 0.0), (1.0, 1.0), (0.5, 1.0))  # the right half


def enters(fps: float, inside_s: float, inertia: int, inertia_s: float, compiled: bool) -> int:
    """A person standing left of the zone's edge for 1 s, stepping inside for ``inside_s``, back out for
    1 s: the zone_enter events counted."""
    spec = RegionSpec("zone", "z", ZONE, inertia=inertia, inertia_s=inertia_s)
    an = CameraAnalytics(AnalyticsSettings(TrackerParams(), 0.4, 2.0, (spec,)), 1, compiled=compiled)
    n = 0
    frames = round((2.0 + inside_s) * fps)
    for f in range(frames):
        t = f / fps
        x = 520.0 if 1.0 <= t < 1.0 + inside_s else 480.0  # bottom centre either side of x = 500
        box = np.array([[x - 40, 300, x + 40, 600]], np.float32)
        a = an.process(Detections(box, np.array([0.9], np.float32), np.zeros(1, np.int32)), t, t, f, SIZE)
        n += sum(tr.kind == "zone_enter" for tr in a.transitions)
    return n


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("fps", [10.0, 25.0, 50.0])
def test_a_flicker_shorter_than_inertia_s_is_no_enter_at_any_rate(fps: float, compiled: bool) -> None:
    # Boxes step 40 px a frame at most: the Kalman estimate follows within a frame or two of each step.
    assert enters(fps, 0.06, 1, 0.3, compiled) == 0
    assert enters(fps, 0.8, 1, 0.3, compiled) == 1


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_frames_alone_count_a_flicker_at_a_high_rate(compiled: bool) -> None:
    """The old default (2 frames, no time) counts a 0.1 s flicker at 50 fps: why inertia is time now."""
    assert enters(50.0, 0.1, 2, 0.0, compiled) == 1
    assert enters(50.0, 0.1, 1, 0.3, compiled) == 0


def test_config_key_defaults_bounds_and_impact() -> None:
    zone = ZoneConfig(polygon=[(0, 0), (1, 0), (1, 1)])
    assert (zone.inertia, zone.inertia_s) == (1, 0.1)
    old = ZoneConfig(polygon=[(0, 0), (1, 0), (1, 1)], inertia=2, inertia_s=0)  # the old frames-only way
    assert (old.inertia, old.inertia_s) == (2, 0.0)
    with pytest.raises(ValueError, match="inertia_s"):
        ZoneConfig(polygon=[(0, 0), (1, 0), (1, 1)], inertia_s=-1)
    found = {k.path: k.impact for k in keys(AgentConfig)}
    assert found["cameras.*.zones.*.inertia_s"] is Impact.ANALYTICS  # changed in place by SIGHUP
    assert found["cameras.*.tracking.low_score"] is Impact.ANALYTICS
