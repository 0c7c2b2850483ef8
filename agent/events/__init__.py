"""Tracking, zones and lines of a camera turned into MQTT events and retained counts (docs/DESIGN.md).

- settings:  a camera's config -> analytics settings, checked against the model's labels
- camera:    CameraEvents, one per camera with tracking on: the events of its tracks, zones and lines
- regions:   the retained zone and line states
- snapshots: best-detection crops of tracks, sent as JPEG after a track's end
- pictures:  annotated frames and JPEG encoding (these crops, and cmd/snapshot's annotated last frame)
- publisher: where it all goes (Publisher) and the event types
"""

from agent.events.camera import CameraEvents
from agent.events.publisher import EVENT_TYPES, Publisher
from agent.events.settings import analytics_settings, track_floor

__all__ = ["EVENT_TYPES", "CameraEvents", "Publisher", "analytics_settings", "track_floor"]
