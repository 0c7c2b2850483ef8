"""The camera reader: one thread per camera, one loop for every source kind and every decoder.

    reader = open_reader(spec, slot, on_state, decoder="auto")   # the stage a camera's `decoder` asks for
    reader.start(); ...; reader.stop()                           # (pipelines/sources/decoder_choice.py)

The loop (``CameraReader.run``); only the decode stage (pipelines/sources/stages.py, nvdec.py) differs
between decoders:

    open a Capture (pictures, or packets for a decoder of our own) -> stage.start (session)
      -> [ pace (files: absolute schedule) -> read -> stage.decode -> fps limit -> hand over to the slot ]
      -> the connection ends: stalled (no picture for read_timeout_s), stream ended, read/decode error
      -> teardown on a closer thread -> reconnecting, backoff with full jitter -> open again

States go to ``on_state(camera, state, reason)``:

    starting -> streaming -> reconnecting -> streaming ... ; reconnecting -> failed (after max_failures)
    streaming -> ended (a file with loop: false played to its end)

Files loop seamlessly (no reconnect, no warning; ``loops`` counts the passes), paced on an absolute
schedule at the file's rate (or ``fps`` where the file has none), so they deliver at their rate without
drift. A stall is seen in the loop (a read that returned after the read timeout, packets that give no
picture) or, when the thread is stuck in a call that never returns, by the stall watch (watch.py).

Isolation: nothing a reader does holds a lock or the GIL that another camera needs across a slow call.
OpenCV releases the GIL in open and read, and its process-wide FFmpeg open lock is off (spec.py), so
cameras open in parallel; state changes take this reader's own lock only; teardown (capture release, an
NVDEC session's end) runs on a short-lived thread of its own (teardown.py), so a reconnect starts at once
and a slow release delays nobody's frames.

Credentials never leave this package: every log line, ``last_error`` and exception text goes through
:func:`pipelines.urls.mask_url` and the reader's own scrubber, which also knows the raw password.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import numpy as np

from pipelines.frames import DeviceImage, Frame
from pipelines.sources.capture import Capture, OpenError
from pipelines.sources.pacing import RateLimit, Schedule, backoff_s, file_period
from pipelines.sources.slot import FrameSlot
from pipelines.sources.spec import SourceSpec, resolve
from pipelines.sources.stages import (
    DecodeStage,
    DecodeStats,
    Picture,
    PictureStage,
    SessionError,
    StageUnusable,
    StreamError,
)
from pipelines.sources.teardown import Teardowns
from pipelines.sources.watch import WATCH
from pipelines.urls import scrubber

log = logging.getLogger("pipelines.sources")

StateCallback = Callable[[str, str, str | None], None]


class CameraReader(threading.Thread):
    """Reads one camera into its :class:`FrameSlot` until :meth:`stop`.

    ``mode`` is the configured decoder (cpu, nvdec, auto); :attr:`decoder` is what decodes now (the stage's
    name: cpu, nvdec, pipeline), :attr:`decoder_reason` why a camera configured for NVDEC does not use it.
    """

    def __init__(
        self,
        spec: SourceSpec,
        slot: FrameSlot | None = None,
        on_state: StateCallback | None = None,
        *,
        stage: DecodeStage | None = None,
        mode: str = "cpu",
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name=f"reader-{spec.camera}", daemon=True)
        self.spec = spec
        self.slot = slot if slot is not None else FrameSlot()
        self.on_state = on_state
        self.stage: DecodeStage = stage or PictureStage("pipeline" if spec.pipeline is not None else "cpu")
        self.mode = mode
        self.decoder_reason: str | None = None
        self._target = resolve(spec)
        self._scrub = scrubber(spec.raw)  # for every message logged or kept: no URL, no password
        self._rng = rng or random.Random()
        self._stopping = threading.Event()
        self._state_lock = threading.RLock()  # this camera's own: the reader and the stall watch
        self._reported: tuple[str, str | None] | None = None
        self._teardowns = Teardowns(spec.camera, self._scrub)
        self._next_id = 0
        self._stall: str | None = None  # set by the stall watch: the current connection is dead
        self.deadline = 0.0  # the stall watch's: by when the next picture must come (0.0: not watched)
        self.state: str = "starting"
        self.reason: str | None = None
        self.frames_read = 0  # pictures from the source, including those the fps limit dropped
        self.frames_in = 0  # frames put into the slot
        self.reconnects = 0  # open attempts after the first one
        self.loops = 0  # times a file started again from its first frame
        self.last_error: str | None = None
        self.last_open_s: float | None = None  # how long the last successful open took
        self.started_at: float | None = None  # time.monotonic() when the thread started
        self.streaming_at: float | None = None  # time.monotonic() of the first frame handed over
        self.demux_cpu_s = 0.0  # this thread's CPU in reads (packets: FFmpeg's demux)
        self.decode_cpu_s = 0.0  # this thread's CPU in stage.decode()

    # -- public ----------------------------------------------------------------------------------------
    @property
    def decoder(self) -> str:
        return self.stage.name

    def request_stop(self) -> None:
        """Ask the reader to finish without waiting (to stop many cameras in parallel, then join them)."""
        self._stopping.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the reader to finish and wait for it and its teardowns; True when all have ended.

        A read in progress ends within the read timeout, an open in progress within the open timeout; the
        reader releases its capture itself (releasing from another thread while it reads would be unsafe).
        """
        self._stopping.set()
        if timeout is None:
            timeout = max(self.spec.read_timeout_s, self.spec.open_timeout_s) + 1.0
        deadline = time.monotonic() + timeout
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        return self._teardowns.join(deadline) and not self.is_alive()

    @property
    def display(self) -> str:
        return self._scrub(self.spec.display)

    @property
    def sessions_open(self) -> int:
        """Live decoder sessions of this camera (NVDEC: 0 or 1 once teardowns finished)."""
        return int(getattr(self.stage, "sessions_open", 0))

    def decode_totals(self) -> DecodeStats:
        """Packets, pictures, errors, Decode() time over this camera's sessions; this thread's CPU."""
        out = self.stage.totals()
        out.demux_cpu_s, out.decode_cpu_s = self.demux_cpu_s, self.decode_cpu_s
        return out

    @property
    def decode_errors(self) -> int:
        """Packets the decoder rejected (corrupt bitstream), over all sessions."""
        return self.stage.totals().errors

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state,
            "reason": self.reason,
            "frames_read": self.frames_read,
            "frames_in": self.frames_in,
            "dropped": self.slot.dropped,
            "reconnects": self.reconnects,
            "loops": self.loops,
            "last_error": self.last_error,
            "decoder": self.decoder,
            "decoder_reason": self.decoder_reason,
            "decode_errors": self.decode_errors,
        }

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        self.started_at = time.monotonic()
        self._set_state("starting", None)
        WATCH.add(self)
        failures = 0  # consecutive attempts that delivered no frame
        try:
            while not self._stopping.is_set():
                delivered, error, final = self._connection()
                if final is not None:
                    self._finish(final, error)
                    return
                if self._stopping.is_set():
                    break
                failures = 0 if delivered else failures + 1
                self.last_error = error
                if self.spec.max_failures is not None and failures >= self.spec.max_failures:
                    self._finish("failed", f"{error} ({failures} attempt{'s' if failures > 1 else ''})")
                    return
                self._set_state("reconnecting", error)
                wait = backoff_s(failures, self.spec.backoff_initial_s, self.spec.backoff_max_s, self._rng)
                if self._stopping.wait(wait):
                    break
                self.reconnects += 1
        except Exception as exc:  # a bug must not kill the thread silently or leak a URL in a traceback
            self._finish("failed", self._scrub(f"reader crashed: {type(exc).__name__}: {exc}"))
            log.error("camera %s: %s", self.spec.camera, self.last_error)
        finally:
            self.deadline = 0.0
            WATCH.discard(self)
            self._teardowns.now(self.stage.end(final=True))
            log.debug("camera %s: reader ended", self.spec.camera)

    def _connection(self) -> tuple[int, str, str | None]:
        """One connection: (frames delivered, why it ended, final state or None to reconnect)."""
        capture, error = self._open()
        if capture is None:
            return 0, error, None
        outcome: tuple[int, str, str | None] = (0, "stopped", None)
        try:
            capture, outcome = self._start(capture)
            if capture is not None:
                outcome = self._stream(capture)
            return outcome
        finally:
            self.deadline = 0.0  # between connections nothing is due: the run loop reports why it ended
            closers = (self.stage.end(final=False), capture.release if capture is not None else None)
            if self._stopping.is_set() or outcome[2] is not None:
                self._teardowns.now(*closers)  # the reader ends: joining it must cover its teardown
            else:
                self._teardowns.later(*closers)

    def _start(self, capture: Capture) -> tuple[Capture | None, tuple[int, str, str | None]]:
        """The decode stage's session for this connection; for ``auto`` a stream NVDEC cannot take is
        reopened as pictures at once (no backoff, no reconnecting state). (capture to stream from or None,
        the outcome when there is none)."""
        try:
            self.stage.start(capture)
        except StageUnusable as exc:
            if self.mode != "auto":
                capture.release()
                return None, (0, self._scrub(f"decoder {self.mode}: {exc}"), "failed")
            capture.release()
            self._fall_back(self._scrub(str(exc)))
            reopened, error = self._open()
            if reopened is None:
                return None, (0, error, None)
            self.stage.start(reopened)
            return reopened, (0, "stopped", None)
        except SessionError as exc:  # out of device memory, too many sessions: this camera only
            capture.release()
            return None, (0, self._scrub(str(exc)), "failed")
        return capture, (0, "stopped", None)

    def _open(self) -> tuple[Capture | None, str]:
        packets = self.stage.packets and self._target.ffmpeg  # NVDEC on V4L2: the stage refuses it
        capture = Capture(self.spec, self._target, packets=packets, scrub=self._scrub)
        try:
            info = capture.open()
        except OpenError as exc:
            return None, str(exc)
        self.last_open_s = info.open_s
        log.debug("camera %s: opened %s in %.3f s", self.spec.camera, self.display, info.open_s)
        return capture, ""

    def _stream(self, capture: Capture) -> tuple[int, str, str | None]:
        """Read until the connection ends or stop; (frames delivered, why it ended, final state or None)."""
        spec, stage = self.spec, self.stage
        schedule = self._schedule(capture)
        limit = RateLimit(spec.fps)
        delivered = 0
        units = 0  # read since the file (re)started: a loop point is not an unreadable file
        with self._state_lock:
            self._stall = None
        # The first picture may take longer than the next ones: a stream joined mid-GOP decodes from its next
        # key frame (some cameras send one every few seconds).
        self._arm(time.monotonic(), schedule, first=True)
        while not self._stopping.is_set():
            if schedule is not None and self._stopping.wait(schedule.wait_s()):
                break
            c0 = time.thread_time()
            unit = capture.read()
            c1 = time.thread_time()
            self.demux_cpu_s += c1 - c0
            if self._stall is not None:
                return delivered, self._stall, None
            if unit is None:
                if not capture.ended or not units:
                    return delivered, self._lost(capture, units), None
                if not spec.loop:
                    delivered += self._deliver(stage.flush(), limit if stage.decodes_all else None, delivered)
                    return delivered, self._scrub(f"end of file: {self.display}"), "ended"
                # Seamless: the decoder goes on into the next pass (a key frame with the same parameters).
                if not capture.rewind():
                    return delivered, capture.error, None
                if schedule is not None:
                    schedule.give_back()
                self.loops += 1
                units = 0
                continue
            units += 1
            if unit.arrived > self.deadline:
                # FFmpeg's interrupt fired and it hands out what its decoder still held: a dead stream.
                return delivered, self._stall_message(), None
            if not stage.decodes_all and not limit.take(unit.arrived):
                self.frames_read += 1  # not even retrieved: no colour conversion or copy for dropped frames
                self._arm(unit.arrived, schedule)
                continue
            try:
                pictures = stage.decode(unit)
            except StreamError as exc:
                return delivered, self._scrub(str(exc)), None
            self.decode_cpu_s += time.thread_time() - c1
            if pictures:
                self._arm(time.monotonic(), schedule)
            delivered += self._deliver(pictures, limit if stage.decodes_all else None, delivered)
        return delivered, "stopped", None

    def _deliver(self, pictures: list[Picture], limit: RateLimit | None, before: int) -> int:
        n = 0
        for image, captured, wall in pictures:
            self.frames_read += 1
            if limit is not None and not limit.take(captured):
                continue  # decoded (later pictures need it) but not delivered
            n += 1
            self._hand_over(image, wall, captured, before + n == 1)
        return n

    def _schedule(self, capture: Capture) -> Schedule | None:
        if self._target.kind != "file" or not self.spec.realtime:
            return None
        return Schedule(file_period(capture.info.fps if capture.info else None, self.spec.fps))

    def _lost(self, capture: Capture, units: int) -> str:
        if capture.ended:
            return self._scrub(f"cannot read: {self.display}")  # a file that gives nothing, not even once
        if time.monotonic() > self.deadline:
            return self._stall_message()
        return capture.error

    # -- stalls ----------------------------------------------------------------------------------------
    def _arm(self, now: float, schedule: Schedule | None, first: bool = False) -> None:
        """A picture came (or the connection opened): the next one is due within the read timeout of now,
        or of the moment a file's schedule asks for it; the first one within the open timeout too."""
        due = max(now, schedule.due) if schedule is not None else now
        allowed = self.spec.read_timeout_s
        if first:
            allowed = max(allowed, self.spec.open_timeout_s)
        self.deadline = due + allowed

    def stalled(self, now: float) -> None:
        """From the stall watch: no picture by the deadline. Report it now, whatever the thread is stuck in;
        the loop ends the connection when the thread comes back."""
        with self._state_lock:
            if not self.deadline or now <= self.deadline or self._stall is not None:
                return
            self.deadline = 0.0
            self._stall = self._stall_message()
            if self.state == "streaming":
                self.last_error = self._stall
                self._set_state("reconnecting", self._stall)

    def _stall_message(self) -> str:
        return self._scrub(f"no frame for {self.spec.read_timeout_s:g} s: {self.display}")

    # -- helpers ---------------------------------------------------------------------------------------
    def _hand_over(
        self, image: np.ndarray | DeviceImage, ts_wall: float, captured: float, first: bool
    ) -> None:
        """One frame into the slot (the newest wins there); the first of a connection makes it streaming."""
        frame = Frame(self.spec.camera, self._next_id, image, ts_wall)
        frame.stamps["captured"] = captured  # monotonic, as Frame.stamp
        self._next_id += 1
        self.frames_in += 1
        if first:
            with self._state_lock:
                if self._stall is None:
                    self._set_state("streaming", None)
                    if self.streaming_at is None:
                        self.streaming_at = time.monotonic()
        self.slot.put(frame)

    def _fall_back(self, reason: str) -> None:
        log.warning("camera %s: decoding on the CPU: %s", self.spec.camera, reason)
        self._teardowns.later(self.stage.end(final=True))
        self.stage, self.decoder_reason = PictureStage("cpu"), reason

    def _finish(self, state: str, reason: str) -> None:
        if state == "failed":
            self.last_error = reason
        self._set_state(state, reason)

    def _set_state(self, state: str, reason: str | None) -> None:
        reason = None if reason is None else self._scrub(reason)
        with self._state_lock:
            self.state, self.reason = state, reason
            if self._reported == (state, reason):
                return
            self._reported = (state, reason)
            level = logging.WARNING if state in ("reconnecting", "failed") else logging.INFO
            log.log(level, "camera %s: %s%s", self.spec.camera, state, f" ({reason})" if reason else "")
            if self.on_state is not None:
                try:
                    self.on_state(self.spec.camera, state, reason)
                except Exception:  # a broken subscriber must not stop the camera
                    log.exception("camera %s: on_state callback failed", self.spec.camera)
