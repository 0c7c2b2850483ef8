"""Percentiles of the bench's samples, as bench.json reports them."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np


def pct(
    values: array[float] | list[float], quantiles: Sequence[int] = (50, 95, 99)
) -> dict[str, float | int | None]:
    """`p<q>` for each quantile, the mean and the count, rounded to 3 decimals (None where empty)."""
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {**{f"p{q}": None for q in quantiles}, "mean": None, "n": 0}
    qs = np.percentile(a, list(quantiles))
    return {
        **{f"p{q}": round(float(v), 3) for q, v in zip(quantiles, qs, strict=True)},
        "mean": round(float(a.mean()), 3),
        "n": int(a.size),
    }
