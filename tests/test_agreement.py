"""pipelines.agreement on constructed cases: the numbers are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.agreement import average_precision, detection_agreement, iou_matrix
from pipelines.frames import Detections


def dets(boxes: list[list[float]], scores: list[float], classes: list[int]) -> Detections:
    return Detections(
        np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32), np.array(classes, np.int32)
    )


REF = [
    dets([[0, 0, 10, 10], [20, 20, 40, 40]], [0.9, 0.8], [0, 1]),
    dets([[5, 5, 25, 25]], [0.7], [0]),
    Detections.empty(),
]


def test_iou_matrix_values() -> None:
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 0]], np.float32)
    b = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]], np.float32)
    m = iou_matrix(a, b)
    assert m.shape == (2, 3)
    np.testing.assert_allclose(m[0], [1.0, 50 / 150, 0.0])
    np.testing.assert_allclose(m[1], [0.0, 0.0, 0.0])  # degenerate box: no division by zero
    assert iou_matrix(np.zeros((0, 4)), b).shape == (0, 3)


def test_identical_is_one() -> None:
    r = detection_agreement(REF, REF)
    assert r == {"map50": 1.0, "mean_iou": 1.0, "frames": 3}


def test_shifted_boxes_keep_map_and_lower_iou() -> None:
    # Shift every box by 1 px: IoU of a 10x10 box shifted by 1 in x = 90/110; still above 0.5.
    shifted = [Detections(d.boxes + np.array([1, 0, 1, 0], np.float32), d.scores, d.class_ids) for d in REF]
    r = detection_agreement(REF, shifted)
    assert r["map50"] == 1.0
    expected = np.mean([90 / 110, 380 / 420, 380 / 420])
    assert r["mean_iou"] == pytest.approx(expected)
    # Shifted so far that IoU < 0.5: nothing matches.
    far = [Detections(d.boxes + 8, d.scores, d.class_ids) for d in REF]
    r = detection_agreement(REF, far)
    assert r["map50"] == 0.0 and r["mean_iou"] == 0.0


def test_missing_box_lowers_recall() -> None:
    cand = [REF[0], Detections.empty(), Detections.empty()]  # class 0 loses one of its two boxes
    r = detection_agreement(REF, cand)
    # class 0: one TP out of 2 positives -> AP 0.5; class 1: AP 1.0
    assert r["map50"] == pytest.approx(0.75)
    assert r["mean_iou"] == 1.0


def test_wrong_class_is_a_miss() -> None:
    cand = [dets([[0, 0, 10, 10], [20, 20, 40, 40]], [0.9, 0.8], [0, 2]), REF[1], REF[2]]
    r = detection_agreement(REF, cand)
    # class 1's only box came back as class 2: AP(1) = 0; class 2 is not in the reference
    assert r["map50"] == pytest.approx(0.5)


def test_extra_boxes_cost_precision_by_rank() -> None:
    # A false positive of class 0 ranked above the true ones: P = 0/1, 1/2, 2/3 at recall 0, .5, 1
    extra_high = [
        dets([[0, 0, 10, 10], [20, 20, 40, 40], [100, 100, 120, 120]], [0.9, 0.8, 0.95], [0, 1, 0]),
        REF[1],
        REF[2],
    ]
    r = detection_agreement(REF, extra_high)
    assert r["map50"] == pytest.approx((2 / 3 + 1.0) / 2)
    # The same false positive ranked last costs nothing (all-point interpolation).
    extra_low = [dets([[100, 100, 120, 120]], [0.1], [0]), Detections.empty(), Detections.empty()]
    cand = [
        Detections(
            np.concatenate([REF[0].boxes, extra_low[0].boxes]),
            np.concatenate([REF[0].scores, extra_low[0].scores]),
            np.concatenate([REF[0].class_ids, extra_low[0].class_ids]),
        ),
        REF[1],
        REF[2],
    ]
    assert detection_agreement(REF, cand)["map50"] == 1.0


def test_duplicate_candidate_matches_once() -> None:
    ref = [dets([[0, 0, 10, 10]], [0.9], [0])]
    cand = [dets([[0, 0, 10, 10], [0, 0, 10, 10]], [0.9, 0.8], [0, 0])]
    r = detection_agreement(ref, cand)
    assert r["map50"] == 1.0  # the duplicate is a FP after full recall
    assert r["mean_iou"] == 1.0


def test_empty_reference() -> None:
    empty = [Detections.empty(), Detections.empty()]
    assert detection_agreement(empty, empty)["map50"] == 1.0
    assert detection_agreement(empty, [REF[1], Detections.empty()])["map50"] == 0.0


def test_frame_count_mismatch() -> None:
    with pytest.raises(ValueError, match="frames"):
        detection_agreement(REF, REF[:2])


def test_average_precision_all_point() -> None:
    # TP, FP, TP with 2 positives: envelope P = 1 at R .5, 2/3 at R 1 -> AP = .5 + .5 * 2/3
    assert average_precision(np.array([1.0, 0.0, 1.0]), 2) == pytest.approx(0.5 + 1 / 3)
    assert average_precision(np.array([]), 3) == 0.0
