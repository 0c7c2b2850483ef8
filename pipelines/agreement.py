"""Agreement of a candidate detector with a reference detector on the same frames.

    detection_agreement(fp32_dets, int8_dets)  ->  {"map50": 0.97, "mean_iou": 0.93, "frames": 40}

The reference's detections are the ground truth: mAP at IoU 0.5 (per class AP with all-point
interpolation, averaged over the classes the reference found) says how much of what FP32 reports a
lower precision still reports, in the right place and class, with a sensible score order. Mean IoU of
the matched boxes says how tight the boxes stay. Identical inputs give 1.0 for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipelines.frames import Detections


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a (N, 4) with every box in b (M, 4), x1y1x2y2 -> (N, M) float64."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    ix1 = np.maximum(a[:, None, 0], b[None, :, 0])
    iy1 = np.maximum(a[:, None, 1], b[None, :, 1])
    ix2 = np.minimum(a[:, None, 2], b[None, :, 2])
    iy2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(ix2 - ix1, 0, None) * np.clip(iy2 - iy1, 0, None)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def average_precision(tp: np.ndarray, n_positive: int) -> float:
    """All-point interpolated AP (VOC 2010+) of detections already sorted by descending score."""
    if n_positive == 0:
        return 0.0
    if tp.size == 0:
        return 0.0
    ctp = np.cumsum(tp, dtype=np.float64)
    recall = ctp / n_positive
    precision = ctp / np.arange(1, tp.size + 1, dtype=np.float64)
    r = np.concatenate([[0.0], recall, [1.0]])
    p = np.concatenate([[1.0], precision, [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]  # precision envelope: max precision at recall >= r
    changed = np.nonzero(r[1:] != r[:-1])[0]
    return float(np.sum((r[changed + 1] - r[changed]) * p[changed + 1]))


def detection_agreement(
    reference: Sequence[Detections], candidate: Sequence[Detections], iou_threshold: float = 0.5
) -> dict[str, float | int]:
    """mAP@iou_threshold of `candidate` against `reference` as ground truth, plus mean IoU of matches.

    Matching is greedy by candidate score (highest first, across all frames of a class): each
    candidate box takes the unmatched reference box of its class with the highest IoU, if that IoU
    is >= iou_threshold. Classes only the candidate reports do not enter the mean (as in COCO/VOC);
    their boxes are noise the reference does not know about. No reference boxes anywhere: 1.0 when
    the candidate is empty too, else 0.0.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} frames, candidate has {len(candidate)}")
    frames = len(reference)
    classes = np.unique(np.concatenate([r.class_ids for r in reference] or [np.zeros(0, np.int32)]))
    if classes.size == 0:
        empty = all(len(c) == 0 for c in candidate)
        value = 1.0 if empty else 0.0
        return {"map50": value, "mean_iou": value, "frames": frames}

    aps: list[float] = []
    matched_ious: list[float] = []
    for cls in classes:
        # Per frame: the class's reference boxes, candidate boxes and their IoU matrix.
        scores, frame_of, index_of = [], [], []
        ious: list[np.ndarray] = []
        used: list[np.ndarray] = []
        n_positive = 0
        for f, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
            ref_boxes = ref.boxes[ref.class_ids == cls]
            cand_mask = cand.class_ids == cls
            cand_boxes, cand_scores = cand.boxes[cand_mask], cand.scores[cand_mask]
            n_positive += len(ref_boxes)
            ious.append(iou_matrix(cand_boxes, ref_boxes))
            used.append(np.zeros(len(ref_boxes), dtype=bool))
            scores.append(cand_scores)
            frame_of.append(np.full(len(cand_scores), f, dtype=np.int64))
            index_of.append(np.arange(len(cand_scores)))
        all_scores = np.concatenate(scores)
        order = np.argsort(-all_scores, kind="stable")
        frame_idx = np.concatenate(frame_of)[order]
        box_idx = np.concatenate(index_of)[order]
        tp = np.zeros(order.size, dtype=np.float64)
        for k, (f, i) in enumerate(zip(frame_idx, box_idx, strict=True)):
            row = ious[f][i]
            if row.size == 0:
                continue
            row = np.where(used[f], -1.0, row)
            j = int(np.argmax(row))
            if row[j] >= iou_threshold:
                used[f][j] = True
                tp[k] = 1.0
                matched_ious.append(float(row[j]))
        aps.append(average_precision(tp, n_positive))
    return {
        "map50": float(np.mean(aps)),
        "mean_iou": float(np.mean(matched_ious)) if matched_ious else 0.0,
        "frames": frames,
    }
