"""Grouped statistics over numpy arrays (pure): the sort-based per-group medians used by compaction
(per-step cross-rank rollups) and by the straggler rollup fold."""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["grouped_median", "grouped_medians"]


def grouped_median(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` per group id (0..n_groups-1), ignoring NaN; NaN where a group has none."""
    if not len(values):  # groups with no rows at all (a step known only from its collectives)
        return np.full(n_groups, np.nan)
    order = np.lexsort((values, gid))  # NaN sorts last within each group
    v = values[order]
    counts = np.bincount(gid, minlength=n_groups)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    valid = np.bincount(gid, weights=~np.isnan(values), minlength=n_groups).astype(np.int64)
    lo = starts + np.maximum(valid - 1, 0) // 2
    hi = np.where(valid > 0, starts + valid // 2, lo)
    out = np.where(valid > 0, (v[np.minimum(lo, len(v) - 1)] + v[np.minimum(hi, len(v) - 1)]) / 2, np.nan)
    return out


def grouped_medians(cols: list[np.ndarray], gid: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Per-group medians (NaN ignored) of several columns whose rows are sorted by group."""
    n_groups = len(counts)
    if n_groups and len(gid) and (counts == counts[0]).all() and counts[0] > 0:
        k = int(counts[0])
        stacked = np.stack(cols).reshape(len(cols), n_groups, k)
        if not np.isnan(stacked).any():
            return list(np.median(stacked, axis=2))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return list(np.nanmedian(stacked, axis=2))
    return [grouped_median(c, gid, n_groups) for c in cols]
