"""NanoDet through real ONNX Runtime on real photos and video."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from engines.runtimes.base import TensorSpec
from engines.runtimes.ort import OrtBackend
from pipelines.frames import Detections
from pipelines.models import ModelAdapter, make_adapter
from pipelines.postprocess import filter_detections, load_labels
from pipelines.preprocess import Letterbox

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "agent" / "assets"
DATA = REPO / "tests" / "data"
# NanoDet-m is a small model: its true positives on these photos score about 0.30-0.70.
THRESHOLD = 0.25


@pytest.fixture(scope="module")
def labels() -> list[str]:
    return load_labels(ASSETS / "coco.names")


@pytest.fixture(scope="module")
def backend() -> Iterator[OrtBackend]:
    with OrtBackend(ASSETS / "nanodet-m-416.onnx") as b:
        yield b


@pytest.fixture(scope="module")
def adapter(backend: OrtBackend, labels: list[str]) -> ModelAdapter:
    return make_adapter("nanodet", backend.input_spec, len(labels))


def _detect(backend: OrtBackend, adapter: ModelAdapter, images: list[np.ndarray]) -> list[Detections]:
    batch, lbs = adapter.preprocess(images)
    return adapter.postprocess(backend.infer(batch), lbs, THRESHOLD)


def _best(dets: Detections, labels: list[str], name: str) -> tuple[float, np.ndarray]:
    idx = [i for i, c in enumerate(dets.class_ids) if labels[c] == name]
    assert idx, f"no {name}: found {[labels[c] for c in dets.class_ids]}"
    i = max(idx, key=lambda j: dets.scores[j])
    return float(dets.scores[i]), dets.boxes[i]


def _assert_inside(dets: Detections, image: np.ndarray) -> None:
    h, w = image.shape[:2]
    b = dets.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= w).all() and (b[:, 3] <= h).all()
    assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()


def test_dog_photo(backend: OrtBackend, adapter: ModelAdapter, labels: list[str]) -> None:
    image = cv2.imread(str(DATA / "dog.jpg"))
    (dets,) = _detect(backend, adapter, [image])
    h, w = image.shape[:2]  # 576 x 768
    assert (
        dets.boxes.dtype == np.float32
        and dets.scores.dtype == np.float32
        and dets.class_ids.dtype == np.int32
    )
    _assert_inside(dets, image)
    assert (np.diff(dets.scores) <= 0).all()  # NMS returns best first

    dog_score, dog = _best(dets, labels, "dog")
    assert dog_score > 0.5
    cx, cy = (dog[0] + dog[2]) / 2, (dog[1] + dog[3]) / 2
    assert cx < w / 2 and cy > h / 2, f"dog box {dog} not in the lower-left"
    assert 100 < dog[2] - dog[0] < 350 and 200 < dog[3] - dog[1] < 450  # a dog-sized box, not the frame

    _, bike = _best(dets, labels, "bicycle")
    assert bike[2] - bike[0] > w / 2  # the bicycle spans the middle of the photo

    _, truck = _best(dets, labels, "truck")
    assert truck[0] > w / 2 and truck[3] < h / 2  # parked in the upper right


def test_person_photo(backend: OrtBackend, adapter: ModelAdapter, labels: list[str]) -> None:
    image = cv2.imread(str(DATA / "person.jpg"))
    (dets,) = _detect(backend, adapter, [image])
    _assert_inside(dets, image)
    score, person = _best(dets, labels, "person")
    assert score > 0.35
    assert person[3] - person[1] > 1.5 * (person[2] - person[0])  # standing: taller than wide
    # The person stands between the dog (left) and the horse (right) in this photo.
    assert 150 < (person[0] + person[2]) / 2 < 300


def test_batch_equals_one_by_one(backend: OrtBackend, adapter: ModelAdapter) -> None:
    images = [cv2.imread(str(DATA / "dog.jpg")), cv2.imread(str(DATA / "person.jpg"))]
    batched = _detect(backend, adapter, images)
    singles = [_detect(backend, adapter, [img])[0] for img in images]
    assert len(batched) == 2
    assert len(batched[0]) != len(batched[1]) or not np.allclose(batched[0].boxes, batched[1].boxes)
    for got, want in zip(batched, singles, strict=True):
        assert len(got) == len(want) > 0
        np.testing.assert_array_equal(got.class_ids, want.class_ids)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)
        np.testing.assert_allclose(got.boxes, want.boxes, atol=1e-3)


def test_street_video(backend: OrtBackend, adapter: ModelAdapter, labels: list[str]) -> None:
    cap = cv2.VideoCapture(str(ASSETS / "bikes.mp4"))
    assert cap.isOpened()
    frames = []
    index = 0
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        if index % 25 == 0:  # one frame a second across the whole clip (scene cuts included)
            frames.append(frame)
        index += 1
    cap.release()
    assert len(frames) == 10 and frames[0].shape == (272, 640, 3)

    wanted = np.zeros(len(labels), bool)
    wanted[[labels.index("car"), labels.index("person")]] = True
    hits = 0
    for i in range(0, len(frames), 4):  # batches of up to 4, as the scheduler would send them
        for frame, dets in zip(frames[i : i + 4], _detect(backend, adapter, frames[i : i + 4]), strict=True):
            _assert_inside(dets, frame)
            hits += len(filter_detections(dets, wanted, 0.35)) > 0
    # Cars and pedestrians are in about half the clip's frames (PROVENANCE.md).
    assert hits >= 5, f"car/person found in only {hits} of {len(frames)} frames"


def _one_hot_sides(sides: list[int], bins: int = 11) -> np.ndarray:
    """GFL logits whose softmax puts (numerically) all mass on bin `k` for each side l, t, r, b."""
    logits = np.zeros((4, bins), np.float32)
    logits[np.arange(4), sides] = 60.0
    return logits.reshape(-1)


def test_nanodet_decode_geometry() -> None:
    """Synthetic head outputs with a known answer: pairing by N, stride, cell centre, GFL distances."""
    adapter = make_adapter("nanodet", TensorSpec("x", (1, 3, 416, 416), np.dtype(np.float32)), 3)
    maps = {
        s: (np.zeros((2, (416 // s) ** 2, 3), np.float32), np.zeros((2, (416 // s) ** 2, 44), np.float32))
        for s in (8, 16, 32)
    }
    # Image 0: stride 16, row 5, col 7 (anchor 5 * 26 + 7), class 2 at 0.8; sides 2, 3, 4, 1 bins.
    maps[16][0][0, 5 * 26 + 7, 2] = 0.8
    maps[16][1][0, 5 * 26 + 7] = _one_hot_sides([2, 3, 4, 1])
    # Image 0: a stride-8 anchor below the threshold.
    maps[8][0][0, 100, 0] = 0.2
    # Image 1: stride 32, row 12, col 0 (anchor 156), class 1 at 0.6; sides 1, 2, 3, 0 bins.
    maps[32][0][1, 12 * 13 + 0, 1] = 0.6
    maps[32][1][1, 12 * 13 + 0] = _one_hot_sides([1, 2, 3, 0])
    # Names and order that say nothing: the adapter must pair maps by N.
    outputs = {
        "z": maps[32][1],
        "y": maps[8][0],
        "x": maps[16][1],
        "w": maps[32][0],
        "v": maps[8][1],
        "u": maps[16][0],
    }
    lbs = [Letterbox(1.0, 0.0, 0.0, 416, 416), Letterbox(0.5, 0.0, 0.0, 832, 832)]
    first, second = adapter.postprocess(outputs, lbs, score_threshold=0.3)

    # Centre (7.5 * 16, 5.5 * 16) = (120, 88); distances 32, 48, 64, 16.
    np.testing.assert_allclose(first.boxes, [[88, 40, 184, 104]], atol=1e-3)
    np.testing.assert_array_equal(first.class_ids, [2])
    np.testing.assert_allclose(first.scores, [0.8])
    # Centre (0.5 * 32, 12.5 * 32) = (16, 400); distances 32, 64, 96, 0; then x2 back to the 832 source.
    np.testing.assert_allclose(second.boxes, [[0, 672, 224, 800]], atol=1e-3)
    np.testing.assert_array_equal(second.class_ids, [1])


def test_nanodet_preprocess_is_bgr_mean_std(adapter: ModelAdapter) -> None:
    image = np.empty((416, 416, 3), np.uint8)
    image[:] = (110, 120, 130)  # B, G, R
    batch, lbs = adapter.preprocess([image])
    assert batch.shape == (1, 3, 416, 416) and lbs[0].scale == 1.0
    expected = [(110 - 103.53) / 57.375, (120 - 116.28) / 57.12, (130 - 123.675) / 58.395]
    np.testing.assert_allclose(batch[0, :, 200, 200], expected, rtol=1e-5)
