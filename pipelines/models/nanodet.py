"""NanoDet (GFL head) decoding: per-level class scores + 4 x bins box distributions.

Layout (see shared/models/PROVENANCE.md): for each stride s, a score map [B, N, nc] (already
sigmoided) and a box map [B, N, 4 * bins] where N = ceil(H/s) * ceil(W/s), anchors row-major.
Each box side is a softmax over the bins; its expected value x s is the distance from the cell
centre ((col + 0.5) * s, (row + 0.5) * s) to the left/top/right/bottom edge.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pipelines.models.base import Candidates, ModelAdapter

if TYPE_CHECKING:
    from pipelines.models.graph import GraphBuilder, GraphHeads

_CANDIDATE_STRIDES = (4, 8, 16, 32, 64, 128)


class NanoDetAdapter(ModelAdapter):
    fmt = "nanodet"
    # The TF.js-converted NanoDet-m takes BGR, mean/std in 0-255 units, no /255 (PROVENANCE.md).
    mean = np.array([103.53, 116.28, 123.675], dtype=np.float32)
    std = np.array([57.375, 57.12, 58.395], dtype=np.float32)
    scale = 1.0
    swap_rb = False
    pad_value = 0  # upstream NanoDet letterboxes with a black border (warpAffine default), not 114

    def _levels(self, outputs: dict[str, np.ndarray]) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """Pair score and box maps by N (not by name or order) and find each level's stride.

        Returns (stride, grid_w, scores [B, N, nc], box_dist [B, N, 4 * bins]) per level.
        """
        by_n: dict[int, dict[str, np.ndarray]] = {}
        for name, arr in outputs.items():
            if arr.ndim != 3:
                raise ValueError(f"nanodet: output {name!r} has shape {arr.shape}, expected [B, N, C]")
            kind = "scores" if arr.shape[2] == self.num_classes else "boxes"
            slot = by_n.setdefault(arr.shape[1], {})
            if kind in slot:
                raise ValueError(
                    f"nanodet: two {kind} outputs with N={arr.shape[1]} (is num_classes={self.num_classes} "
                    f"right?); output shapes: { {k: v.shape for k, v in outputs.items()} }"
                )
            slot[kind] = arr

        h, w = self.input_hw
        levels = []
        for n, slot in sorted(by_n.items(), reverse=True):
            if set(slot) != {"scores", "boxes"}:
                raise ValueError(
                    f"nanodet: N={n} needs a score map (last dim {self.num_classes}) and a box map; "
                    f"got {sorted(slot)}; output shapes: { {k: v.shape for k, v in outputs.items()} }"
                )
            if slot["boxes"].shape[2] % 4:
                raise ValueError(
                    f"nanodet: box map with N={n} has {slot['boxes'].shape[2]} channels, not 4 x bins"
                )
            stride = next(
                (s for s in _CANDIDATE_STRIDES if math.ceil(h / s) * math.ceil(w / s) == n),
                None,
            )
            if stride is None:
                raise ValueError(f"nanodet: N={n} matches no stride for a {h}x{w} input")
            levels.append((stride, math.ceil(w / stride), slot["scores"], slot["boxes"]))
        return levels

    def _decode(self, outputs: dict[str, np.ndarray], batch: int, score_threshold: float) -> list[Candidates]:
        img_idx, boxes, scores, class_ids = [], [], [], []
        for stride, grid_w, score_map, box_map in self._levels(outputs):
            # Reject first; only survivors get the best class, the softmax and box maths. One flat compare
            # + flatnonzero: a max over the 80 classes of every anchor (a reduce along a short last axis)
            # cost 3x more, np.nonzero on the 3-D mask 8x more (measured at 416x416).
            n, nc = score_map.shape[1], score_map.shape[2]
            hits = np.flatnonzero(score_map.reshape(-1) >= score_threshold)
            if hits.size == 0:
                continue
            cells = np.unique(hits // nc)  # (batch item, anchor) with any class over the threshold
            rows = score_map.reshape(-1, nc)[cells]  # (K, nc)
            b, a = np.divmod(cells, n)
            bins = box_map.shape[2] // 4
            logits = box_map[b, a].reshape(-1, 4, bins)  # (K, 4, bins), a gathered copy
            logits -= logits.max(axis=2, keepdims=True)  # numerically safe softmax
            np.exp(logits, out=logits)
            proj = np.arange(bins, dtype=np.float32)
            dist = (logits @ proj) / logits.sum(axis=2) * np.float32(stride)  # (K, 4): l, t, r, b
            cx = ((a % grid_w).astype(np.float32) + 0.5) * stride
            cy = ((a // grid_w).astype(np.float32) + 0.5) * stride
            boxes.append(np.stack([cx - dist[:, 0], cy - dist[:, 1], cx + dist[:, 2], cy + dist[:, 3]], 1))
            ids = rows.argmax(axis=1)
            scores.append(rows[np.arange(ids.size), ids])
            class_ids.append(ids.astype(np.int32))
            img_idx.append(b)
        if not img_idx:
            return [(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))] * batch
        return self._split_by_image(
            np.concatenate(img_idx),
            np.concatenate(boxes).astype(np.float32, copy=False),
            np.concatenate(scores).astype(np.float32, copy=False),
            np.concatenate(class_ids),
            batch,
        )

    def graph_heads(self, g: GraphBuilder, shapes: dict[str, tuple[int, ...]]) -> GraphHeads:
        """(boxes x1y1x2y2, scores, anchors) from the GFL heads, as `_decode` computes them."""
        from pipelines.models.graph import GraphHeads

        # `_levels` pairs score and box maps and finds each level's stride; zeros of the right shapes suffice.
        dummies = {name: np.zeros((1, *shape[1:]), np.float32) for name, shape in shapes.items()}
        names = {id(arr): name for name, arr in dummies.items()}
        box_parts, score_parts, anchors = [], [], 0
        for stride, grid_w, score_map, box_map in self._levels(dummies):
            n, bins = box_map.shape[1], box_map.shape[2] // 4
            anchors += n
            shape = g.const(np.array([-1, n, 4, bins], np.int64), "shape")
            dist = g.op("Reshape", [names[id(box_map)], shape])
            dist = g.op("Softmax", [dist], axis=-1)
            proj = g.const((np.arange(bins, dtype=np.float32) * np.float32(stride)).reshape(bins, 1), "proj")
            flat = g.const(np.array([-1, n, 4], np.int64), "s")
            dist = g.op("Reshape", [g.op("MatMul", [dist, proj]), flat])
            a = np.arange(n)
            centre = np.stack([(a % grid_w + 0.5) * stride, (a // grid_w + 0.5) * stride], 1)
            centre = centre.astype(np.float32)
            sign = g.const(np.array([-1, -1, 1, 1], np.float32), "sign")
            corners = g.const(np.concatenate([centre, centre], 1)[None], "centre")  # (1, n, 4): cx cy cx cy
            box_parts.append(g.op("Add", [corners, g.op("Mul", [dist, sign])]))
            score_parts.append(names[id(score_map)])
        return GraphHeads(g.op("Concat", box_parts, axis=1), g.op("Concat", score_parts, axis=1), anchors)
