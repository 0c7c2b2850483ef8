"""NVDEC decoding (pipelines.sources.nvdec) on a real GPU: bit-exact luma, the reader contract, bad input.

Marked gpu (CI has no GPU); on the GPU box, with PyNvVideoCodec installed (the `[nvdec]` extra):
    PYTHONPATH=.:tests python3 -m pytest --noconftest -o addopts= -m gpu tests/test_nvdec_gpu.py

Ground truth: tools/h264_pcm.py writes lossless (I_PCM) H.264, so the decoder must return exactly the
luma that was written; for the bundled (lossy) clip the CPU decoder's luma is the reference. H.264
decoding is bit-exact by specification, so both comparisons are exact.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from pipelines.sources import CameraReader, FrameSlot, SourceSpec
from tools.h264_pcm import encode_pcm, expected_planes

pytestmark = pytest.mark.gpu
CLIP = Path(__file__).resolve().parents[1] / "agent" / "assets" / "bikes.mp4"


@pytest.fixture(scope="module")
def nvc():  # type: ignore[no-untyped-def]
    from pipelines.sources.nvdec import import_nvc, nvdec_unavailable

    why = nvdec_unavailable()
    if why:
        pytest.skip(why)
    return import_nvc()


def _clip(count: int, size: tuple[int, int] | None = None) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(CLIP))
    frames = []
    while len(frames) < count:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.resize(frame, size) if size else frame)
    cap.release()
    return frames


def _luma(picture) -> np.ndarray:  # type: ignore[no-untyped-def]
    host = np.empty((picture.height * 3 // 2, picture.width), np.uint8)
    import cupy as cp

    picture.event.synchronize()
    mem = cp.cuda.UnownedMemory(picture.ptr, host.nbytes, picture)
    cp.cuda.MemoryPointer(mem, 0).copy_to_host(host.ctypes.data, host.nbytes)
    return host[: picture.height]


def _decode_file(path: Path) -> tuple[list[np.ndarray], object]:
    from pipelines.sources.nvdec import NvdecDecoder

    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    dec = NvdecDecoder("h264")
    out = []
    try:
        while True:
            ok, packet = cap.read()
            if not ok:
                break
            key = bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME))
            out += [_luma(p) for p in dec.decode(packet, key)]
        out += [_luma(p) for p in dec.flush()]
    finally:
        cap.release()
        dec.close()
    return out, dec.stats


@pytest.mark.parametrize("size", [(640, 272), (1920, 1080), (1282, 722)])
def test_nvdec_luma_is_the_written_luma(nvc, tmp_path: Path, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    frames = _clip(12, size)
    path = tmp_path / "pcm.h264"
    path.write_bytes(encode_pcm(frames))
    lumas, stats = _decode_file(path)
    assert len(lumas) == len(frames), stats
    for i, (frame, luma) in enumerate(zip(frames, lumas, strict=True)):
        expected = expected_planes(frame)[0]
        assert luma.shape == expected.shape
        assert np.array_equal(luma, expected), (
            f"frame {i}: {np.count_nonzero(luma != expected)} samples differ"
        )


def test_resolution_change_mid_stream_reconfigures(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    small, big = _clip(4), _clip(4, (1920, 1080))
    frames = small + big + small
    path = tmp_path / "mixed.h264"
    path.write_bytes(encode_pcm(frames))
    lumas, _ = _decode_file(path)
    assert [luma.shape for luma in lumas] == [f.shape[:2] for f in frames]
    assert all(np.array_equal(luma, expected_planes(f)[0]) for luma, f in zip(lumas, frames, strict=True))


def test_bundled_clip_luma_equals_the_cpu_decoder(nvc) -> None:  # type: ignore[no-untyped-def]
    lumas, stats = _decode_file(CLIP)
    ref = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG)
    assert ref.set(cv2.CAP_PROP_CONVERT_RGB, 0)
    cpu = []
    while True:
        ok, plane = ref.read()
        if not ok:
            break
        cpu.append(plane)
    assert len(lumas) == len(cpu) > 200, stats
    equal = sum(np.array_equal(a, b) for a, b in zip(lumas, cpu, strict=True))
    assert equal == len(cpu)


def test_corrupt_packets_are_counted_and_decoding_resumes(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pipelines.sources.nvdec import NvdecDecoder

    frames = _clip(40)
    path = tmp_path / "pcm.h264"
    path.write_bytes(encode_pcm(frames))
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    dec = NvdecDecoder("h264")
    rng = np.random.default_rng(3)
    good = []
    for i in range(len(frames)):
        ok, packet = cap.read()
        assert ok
        if 10 <= i < 14:
            packet = rng.integers(0, 256, 4000, dtype=np.uint8)  # garbage instead of four frames
        for p in dec.decode(packet, bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME))):
            good.append(_luma(p))
    good += [_luma(p) for p in dec.flush()]
    dec.close()
    tail = [expected_planes(f)[0] for f in frames[14:]]
    # Every frame after the garbage decodes exactly (each is an IDR); the garbage cost at most its own four.
    assert len(good) >= len(frames) - 4
    assert all(np.array_equal(a, b) for a, b in zip(good[-len(tail) :], tail, strict=True))


def _device_free() -> int:
    from engines.cuda.buffers import cuda_call, import_cudart

    rt = import_cudart()
    free, _total = cuda_call(rt, "cudaMemGetInfo", rt.cudaMemGetInfo())
    return int(free)


def test_reader_delivers_device_frames_and_reconnects_reuse_the_session_exactly(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A server that closes every second: every reconnect keeps the one NVDEC session (low latency) and
    restarts at a key frame; every picture after any number of reconnects is exactly a written one."""
    from test_annexb_rtsp import serve

    from pipelines.sources.nvdec import DeviceNv12, NvdecStage

    frames = _clip(5, (1920, 1080))
    path = tmp_path / "short.h264"
    path.write_bytes(encode_pcm(frames))  # lossless, every frame an IDR
    expected = [expected_planes(f)[0] for f in frames]
    stage = NvdecStage()
    slot = FrameSlot()
    lumas: list[np.ndarray] = []
    with serve(path, fps=25, close_after=1.0) as (url, _proc):
        spec = SourceSpec(camera="c", url=url, backoff_initial_s=0.01, backoff_max_s=0.02)
        reader = CameraReader(spec, slot, stage=stage, mode="nvdec")
        reader.start()
        try:
            deadline = time.monotonic() + 60
            while (reader.reconnects < 6 or len(lumas) < 40) and time.monotonic() < deadline:
                frame = slot.get(timeout=0.5)
                if frame is not None:
                    assert isinstance(frame.image, DeviceNv12) and frame.image.shape == (1080, 1920, 3)
                    lumas.append(_luma(frame.image).copy())
            assert reader.reconnects >= 6, reader.stats()
        finally:
            assert reader.stop(timeout=10)
    assert stage.totals().sessions == 1 and reader.sessions_open == 0
    assert all(any(np.array_equal(luma, e) for e in expected) for luma in lumas)
    print(f"{reader.reconnects} reconnects, 1 session, {len(lumas)} pictures exact")


def test_native_latency_reconnects_leave_no_session_or_memory_behind(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """At native latency each connection gets its own session (pictures held back belong to it): 30
    sessions come and go on their closer threads; device memory stays flat, none is left open."""
    from test_annexb_rtsp import serve

    from pipelines.sources.nvdec import NvdecStage

    path = tmp_path / "short.h264"
    path.write_bytes(encode_pcm(_clip(5, (1920, 1080))))
    stage = NvdecStage(latency="native")
    slot = FrameSlot()
    baseline = None
    with serve(path, fps=25, close_after=0.3) as (url, _proc):
        spec = SourceSpec(camera="n", url=url, backoff_initial_s=0.01, backoff_max_s=0.02)
        reader = CameraReader(spec, slot, stage=stage, mode="nvdec")
        reader.start()
        try:
            deadline = time.monotonic() + 120
            while reader.reconnects < 40 and time.monotonic() < deadline:
                slot.get(timeout=0.05)
                if reader.reconnects >= 10 and baseline is None:
                    gc.collect()
                    baseline = _device_free()
            assert reader.reconnects >= 40, reader.stats()
        finally:
            assert reader.stop(timeout=10)
    gc.collect()
    assert reader.sessions_open == 0 and stage.totals().sessions >= 30
    assert baseline is not None and abs(_device_free() - baseline) < 64 << 20


@pytest.mark.parametrize("kind", ["mp4", "annexb"])
def test_nvdec_file_camera_loops_in_one_session(nvc, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 23: an NVDEC file camera stopped after its first pass and stayed "streaming". It loops now:
    one session, no reconnect, `loops` counted, and the pictures of later passes are the clip's own."""
    from pipelines.sources.nvdec import DeviceNv12, NvdecStage

    path = CLIP
    if kind == "annexb":
        path = tmp_path / "clip.h264"
        cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
        with path.open("wb") as f:
            while (got := cap.read())[0]:
                f.write(got[1].tobytes())
        cap.release()
    reference = _clip(250)

    class Keep(FrameSlot):
        def __init__(self) -> None:
            super().__init__()
            self.kept: list = []

        def put(self, frame) -> None:  # type: ignore[no-untyped-def, override]
            if frame.frame_id % 97 == 0:
                self.kept.append(frame)
            super().put(frame)

    slot = Keep()
    stage = NvdecStage()
    reader = CameraReader(
        SourceSpec("f", url=str(path), realtime=False, loop=True), slot, stage=stage, mode="nvdec"
    )
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while reader.loops < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        assert reader.stop(timeout=10)
    assert reader.loops >= 3 and reader.reconnects == 0 and reader.last_error is None, reader.stats()
    assert stage.totals().sessions == 1 and reader.frames_in >= 750
    for frame in slot.kept:
        assert isinstance(frame.image, DeviceNv12)
        got, want = frame.image.download().astype(int), reference[frame.frame_id % 250].astype(int)
        assert np.abs(got - want).mean() < 2.0, frame.frame_id  # same picture (NV12 round trip aside)


def test_unsupported_codec_auto_falls_back_and_nvdec_fails_naming_it(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pipelines.sources.nvdec import NvdecStage

    path = tmp_path / "mjpeg.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 25, (320, 240))
    for frame in _clip(10, (320, 240)):
        writer.write(frame)
    writer.release()
    spec = SourceSpec(camera="m", url=str(path), realtime=False, loop=True)
    auto = CameraReader(spec, FrameSlot(), stage=NvdecStage(), mode="auto")
    auto.start()
    try:
        frame = auto.slot.get(timeout=20)
        assert frame is not None and isinstance(frame.image, np.ndarray)  # CPU-decoded picture
        assert auto.decoder == "cpu" and "mjpg" in (auto.decoder_reason or "").lower()
    finally:
        auto.stop()
    states: list[tuple[str, str | None]] = []
    strict = CameraReader(
        spec, FrameSlot(), lambda c, s, r: states.append((s, r)), stage=NvdecStage(), mode="nvdec"
    )
    strict.start()
    strict.join(20)
    assert states[-1][0] == "failed"
    assert "nvdec" in (states[-1][1] or "") and "mjpg" in (states[-1][1] or "").lower()


def _clip_env(name: str) -> Path:
    import os

    value = os.environ.get(name)
    if not value or not Path(value).is_file():
        pytest.skip(f"set {name} to a clip made by tools/make_clip.py (needs PyAV, not on the GPU box)")
    return Path(value)


def test_h265_luma_equals_the_cpu_decoder(nvc) -> None:  # type: ignore[no-untyped-def]
    from pipelines.sources.nvdec import NvdecDecoder

    path = _clip_env("EDGE_AGENT_HEVC_CLIP")
    cap = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    dec = NvdecDecoder("hevc")
    lumas = []
    while True:
        ok, packet = cap.read()
        if not ok:
            break
        lumas += [_luma(p) for p in dec.decode(packet, bool(cap.get(cv2.CAP_PROP_LRF_HAS_KEY_FRAME)))]
    lumas += [_luma(p) for p in dec.flush()]
    dec.close()
    ref = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    assert ref.set(cv2.CAP_PROP_CONVERT_RGB, 0)
    cpu = []
    while True:
        ok, plane = ref.read()
        if not ok:
            break
        cpu.append(plane)
    assert len(lumas) == len(cpu) > 0
    assert sum(np.array_equal(a, b) for a, b in zip(lumas, cpu, strict=True)) == len(cpu)


def test_frozen_camera_is_reported_within_the_read_timeout_and_reconnects(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal

    from test_annexb_rtsp import serve

    from pipelines.sources.nvdec import DeviceNv12, NvdecStage

    path = tmp_path / "clip.h264"
    cap = cv2.VideoCapture(str(CLIP), cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    data = bytearray()
    while True:
        ok, packet = cap.read()
        if not ok:
            break
        data += packet.tobytes()
    path.write_bytes(bytes(data))
    states: list[tuple[float, str]] = []
    with serve(path, fps=25) as (url, proc):
        spec = SourceSpec(camera="r", url=url, read_timeout_s=1.0, backoff_initial_s=0.2, backoff_max_s=0.5)
        reader = CameraReader(
            spec,
            FrameSlot(),
            lambda c, s, r: states.append((time.monotonic(), s)),
            stage=NvdecStage(),
            mode="nvdec",
        )
        reader.start()
        try:
            frame = reader.slot.get(timeout=20)
            assert frame is not None and isinstance(frame.image, DeviceNv12)
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            deadline = stopped + 10
            while time.monotonic() < deadline and not any(
                s == "reconnecting" for t, s in states if t > stopped
            ):
                time.sleep(0.05)
            reported = next(t for t, s in states if t > stopped and s == "reconnecting")
            assert reported - stopped < 1.0 + 3.0  # read timeout + slack for a loaded machine
            os.kill(proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and states[-1][1] != "streaming":
                time.sleep(0.05)
            assert states[-1][1] == "streaming"
            assert reader.slot.get(timeout=5) is not None
            print(f"frozen camera reported after {reported - stopped:.2f} s")
        finally:
            reader.stop()
    assert reader.sessions_open == 0


def test_caps_refuse_what_nvdec_cannot_decode_naming_it(nvc) -> None:  # type: ignore[no-untyped-def]
    from pipelines.sources.nvdec import stream_unsupported

    assert stream_unsupported(nvc, "h264", 1920, 1080, "420", 8) is None
    assert stream_unsupported(nvc, "hevc", 3840, 2160, "420", 10) is None
    eight_k = stream_unsupported(nvc, "h264", 7680, 4320, "420", 8)
    assert eight_k is not None and "7680x4320" in eight_k
    four_four_four = stream_unsupported(nvc, "h264", 1920, 1080, "444", 8)
    assert four_four_four is not None and "444" in four_four_four
    mjpeg = stream_unsupported(nvc, "mjpg", 1280, 720, "422", 8)
    assert mjpeg is not None and "mjpg" in mjpeg
    print(f"\n{eight_k}\n{four_four_four}\n{mjpeg}")


def test_decoder_creation_out_of_device_memory_fails_that_camera_only(nvc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Camera A streams; then the device memory is taken (PyTorch allocations) and camera B opens: B goes to
    `failed` naming the NVDEC session it could not create, A keeps delivering device frames. (Before the
    free-memory check, PyNvVideoCodec's caps query crashed the whole process here.)"""
    torch = pytest.importorskip("torch")
    from pipelines.sources.nvdec import DeviceNv12, NvdecStage

    # The bundled clip, paced (10 s a pass; a loop keeps the session).
    spec_a = SourceSpec(camera="a", url=str(CLIP), realtime=True, loop=True)
    spec_b = SourceSpec(camera="b", url=str(CLIP), realtime=True, loop=True)
    a = CameraReader(spec_a, FrameSlot(), stage=NvdecStage(), mode="nvdec")
    states: list[tuple[str, str | None]] = []
    b = CameraReader(
        spec_b, FrameSlot(), lambda c, s, r: states.append((s, r)), stage=NvdecStage(), mode="nvdec"
    )
    hog: list[object] = []
    a.start()
    try:
        assert isinstance(a.slot.get(timeout=20).image, DeviceNv12)  # type: ignore[union-attr]
        # Leave ~400 MiB: short for another session (and the driver's headroom), enough for camera A.
        for chunk in (1 << 30, 16 << 20):
            while _device_free() - (400 << 20) > chunk:
                hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        print(f"device memory left: {_device_free() >> 20} MiB")
        b.start()
        b.join(30)
        assert not b.is_alive() and states and states[-1][0] == "failed", states
        reason = states[-1][1] or ""
        print(f"camera b: {reason}")
        assert "NVDEC session for h264 640x272 could not be created: out of device memory" in reason
        got = [a.slot.get(timeout=5) for _ in range(10)]  # A: still streaming on the GPU
        assert all(f is not None and isinstance(f.image, DeviceNv12) for f in got), a.stats()
    finally:
        hog.clear()
        torch.cuda.empty_cache()
        a.stop()
        b.stop()


@pytest.mark.parametrize("latency", ["low", "native"])
def test_reader_latency_modes_deliver_every_picture_in_order(nvc, tmp_path: Path, latency: str) -> None:  # type: ignore[no-untyped-def]
    """Native latency (the decoder holds pictures back) still delivers every picture, in order, each stamped
    no later than the moment it reached the slot."""
    from pipelines.sources.nvdec import NvdecStage

    frames = _clip(12, (640, 272))
    path = tmp_path / "c.h264"
    path.write_bytes(encode_pcm(frames))

    class Collect(FrameSlot):
        def __init__(self) -> None:
            super().__init__()
            self.all: list = []

        def put(self, frame) -> None:  # type: ignore[no-untyped-def, override]
            frame.stamp("queued_test")
            self.all.append(frame)
            super().put(frame)

    slot = Collect()
    reader = CameraReader(
        SourceSpec(camera="l", url=str(path), realtime=False),
        slot,
        stage=NvdecStage(latency=latency),
        mode="nvdec",
    )
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while len(slot.all) < 12 and time.monotonic() < deadline:  # the file's pictures, then "ended"
            time.sleep(0.05)
    finally:
        reader.stop()
    lumas = [f.image.download() for f in slot.all[:12]]
    assert len(lumas) == 12, len(lumas)
    want = [cv2.cvtColor(cv2.cvtColor(f, cv2.COLOR_BGR2YUV_I420), cv2.COLOR_YUV2BGR_I420) for f in frames]
    assert all(np.abs(a.astype(int) - b.astype(int)).mean() < 2.0 for a, b in zip(lumas, want, strict=True))
    assert all(f.stamps["captured"] <= f.stamps["queued_test"] for f in slot.all[:12])
    assert [f.frame_id for f in slot.all[:12]] == list(range(12))
