"""Where a model's results go (the worker calls each sink in order, on its delivery thread): MQTT detections
and snapshots, the telemetry windows, the console, frames for an engine build's gate, and last the count
of results that passed every sink (the watchdog's progress). Also the MQTT outlet of a camera's events.

MQTT goes through the owner's client as it is at each call (``MqttOut``): a reload may replace it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from agent.events import pictures
from agent.lifecycle.calibration import FrameTap
from agent.mqtt import MqttClient
from agent.mqtt.commands import CommandError
from agent.mqtt.topics import Topics, payload
from agent.results import ConsoleSink, detection_fields
from agent.runtime.cameras import CameraRuntime
from agent.runtime.protocol import Mirror
from agent.telemetry import StageWindow
from pipelines.frames import host_image, stage_latencies_ms
from pipelines.scheduler import Result, Sink

ON_CHANGE_KEEPALIVE_S = 10.0  # publish.detections on_change: a message at least this often anyway


class MqttOut(Protocol):
    """The owner of the MQTT client in use now (a runtime's outlet): read at each publish, never kept."""

    @property
    def mqtt(self) -> MqttClient | None: ...

    @property
    def topics(self) -> Topics: ...


class EventOut:
    """agent.events.Publisher over the owner's MQTT client as it is at each call (a reload may swap it).
    `mirror(topic, body, state)`: a shard's copy of each message to its supervisor (agent.shards.link)."""

    def __init__(self, out: MqttOut, mirror: Mirror | None = None) -> None:
        self._out = out
        self._mirror = mirror

    @property
    def topics(self) -> Topics:
        return self._out.topics

    def publish(self, topic: str, body: bytes, *, state: bool, qos: int) -> None:
        client = self._out.mqtt
        if client is None:
            return
        if state:
            client.publish(topic, body, qos=qos, retain=True, kind="state")
        elif qos or client.connected:  # QoS 0 (snapshots) only while connected: never queued offline
            client.publish(topic, body, qos=qos, kind="event")
        if self._mirror is not None and (state or qos):  # not snapshots: nothing to close there
            self._mirror(topic, body, state)

    def connected(self) -> bool:
        client = self._out.mqtt
        return client is not None and client.connected


def detections_due(cam: CameraRuntime, result: Result) -> bool:
    """cameras.C.publish.detections: every_frame, off, or on_change (the labels, or the track ids, in
    the picture differ from the last message's; and at least every ON_CHANGE_KEEPALIVE_S)."""
    mode = cam.cfg.publish.detections
    if mode == "every_frame":
        return True
    if mode == "off":
        return False
    d = result.detections
    ids = result.analysis.track_ids if result.analysis is not None else None
    key = np.sort(d.class_ids.astype(np.int64) if ids is None else ids * 4096 + d.class_ids)
    signature = key.tobytes()
    now = time.monotonic()
    if signature == cam.last_signature and now - cam.last_published < ON_CHANGE_KEEPALIVE_S:
        return False
    cam.last_signature, cam.last_published = signature, now
    return True


class ResultSinks:
    """The sinks of every model's worker, and what they keep: the last result per camera (snapshots, a
    reference, no copy), the stage latency window, a frame tap and a results count per model."""

    def __init__(
        self,
        out: MqttOut,
        cameras: Mapping[str, CameraRuntime],
        labels: dict[str, list[str]],
        console: bool,
    ) -> None:
        self._out = out
        self._cameras = cameras
        self._labels = labels
        self.console_on = console
        self._console = ConsoleSink(labels)
        self.stages = StageWindow()
        self.taps: dict[str, FrameTap] = {}  # per model: frames for the gate, from the running pipeline
        self.results_out: dict[str, int] = {}  # per model: results that passed every sink (watchdog)
        self._last_result: dict[str, Result] = {}  # per camera
        self._last_snapshot: dict[str, float] = {}

    def for_model(self, name: str) -> list[Sink]:
        """A model's sinks, in order; its frame tap is made here."""
        self.taps[name] = FrameTap()
        self.results_out.setdefault(name, 0)
        sinks: list[Sink] = [self._publish, self._telemetry, self._console_line, self.taps[name]]
        return [*sinks, self._progress]  # last: a result counts as progress once every sink took it

    def forget_model(self, name: str) -> None:
        for d in (self.taps, self.results_out):
            d.pop(name, None)

    def forget_camera(self, name: str) -> None:
        """A removed camera: its last result (a whole frame) and snapshot time are not kept."""
        self._last_result.pop(name, None)
        self._last_snapshot.pop(name, None)

    # ---- the sinks -------------------------------------------------------------------------------------
    def _publish(self, result: Result) -> None:
        result.frame.stamp("published")
        self._last_result[result.frame.camera] = result
        client = self._out.mqtt
        if client is None:
            return
        self._snapshot_on_detection(result)
        cam = self._cameras.get(result.frame.camera)
        if cam is not None and not detections_due(cam, result):
            return
        fields = detection_fields(result, self._labels.get(result.model, []))
        body = payload("detections", **fields)
        client.publish(self._out.topics.detections(result.frame.camera), body, kind="event")

    def _telemetry(self, result: Result) -> None:
        lat = stage_latencies_ms(result.frame)
        if result.gpu_ms is not None:
            lat["gpu"] = result.gpu_ms  # the batch's device time, for each of its frames
        self.stages.add_many(lat)
        cam = self._cameras.get(result.frame.camera)
        if cam is not None:
            cam.fps_out.tick()
            cam.last_capture_ts = result.frame.ts_capture
            cam.detections_out += len(result.detections)
            cam.ages_ms.append((time.time() - result.frame.ts_capture) * 1000.0)

    def _console_line(self, result: Result) -> None:
        if self.console_on:
            self._console(result)

    def _progress(self, result: Result) -> None:
        # One writer per model (its worker thread); the supervisor only reads.
        self.results_out[result.model] = self.results_out.get(result.model, 0) + 1

    # ---- snapshots -------------------------------------------------------------------------------------
    def snapshot(self, camera: str) -> dict:
        """cmd/snapshot {camera}: the annotated last frame as JPEG on cameras/<camera>/snapshot."""
        if camera not in self._cameras:
            known = sorted(self._cameras)
            raise CommandError(f"field 'camera': unknown camera {camera!r} (known: {known})")
        result = self._last_result.get(camera)
        if result is None:
            raise CommandError(f"camera {camera}: no processed frame yet")
        size = self._publish_snapshot(result)
        return {"camera": camera, "frame_id": result.frame.frame_id, "bytes": size}

    def _publish_snapshot(self, result: Result) -> int:
        cam = self._cameras.get(result.frame.camera)
        quality = cam.cfg.snapshot.quality if cam is not None else 80
        image = pictures.annotate(
            host_image(result.frame.image), result.detections, self._labels.get(result.model, [])
        )
        data = pictures.jpeg(image, quality)
        client = self._out.mqtt
        if client is not None and client.connected:  # never queued offline: JPEGs would fill memory
            client.publish(self._out.topics.snapshot(result.frame.camera), data, qos=0, kind="event")
        return len(data)

    def _snapshot_on_detection(self, result: Result) -> None:
        cam = self._cameras.get(result.frame.camera)
        if cam is None or not cam.cfg.snapshot.on_detection or not len(result.detections):
            return
        now = time.monotonic()
        if now - self._last_snapshot.get(cam.name, -1e9) < cam.cfg.snapshot.min_interval_s:
            return
        self._last_snapshot[cam.name] = now
        self._publish_snapshot(result)
