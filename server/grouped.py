"""Grouped statistics over numpy arrays (pure): the sort-based per-group medians used by compaction
(per-step cross-rank rollups) and by the straggler rollup fold."""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["grouped_median", "grouped_medians", "unique_rows", "grouped_argmax"]


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


def _small_space(n: int) -> float:
    return max(4.0 * n, 65536.0)


def _dense(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each row's index into them) of an int column — counted, not sorted,
    when its range is small (ids, ranks, codes, sizes)."""
    col = col.astype(np.int64, copy=False)
    if len(col) == 0:
        return col[:0], np.empty(0, dtype=np.int64)
    lo, hi = int(col.min()), int(col.max())
    if lo == hi:  # one value (the run of a partition's pass, a world size)
        return np.array([lo], dtype=np.int64), np.zeros(len(col), dtype=np.int64)
    if hi - lo < _small_space(len(col)):
        present = np.bincount(col - lo, minlength=hi - lo + 1) > 0
        return np.flatnonzero(present) + lo, (np.cumsum(present) - 1)[col - lo]
    values = getattr(np, "unique_values", None)  # hashed, O(n) (numpy >= 2)
    if values is not None:
        u = np.sort(values(col))
        if len(u) <= 4096:  # few distinct values over a wide range (hashed codes): look each row up
            return u, np.searchsorted(u, col)
    u, inv = np.unique(col, return_inverse=True)
    return u, inv.reshape(-1)


def unique_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(np.stack(cols, 1), axis=0, return_inverse=True)`` for int columns: the distinct
    rows (sorted) and each row's index into them, by counting where the key space is small (no sort).
    A column of small range enters the key as its offset from the minimum; a wide one (hashed codes)
    through its distinct values."""
    n = len(cols[0])
    if n == 0:
        return np.empty((0, len(cols)), dtype=np.int64), np.empty(0, dtype=np.int64)
    parts: list[tuple[np.ndarray, int, int, np.ndarray | None]] = []  # (digit, base, offset, values)
    for c in cols:
        c = c.astype(np.int64, copy=False)
        lo, hi = int(c.min()), int(c.max())
        if hi - lo < _small_space(n):
            parts.append((c - lo, hi - lo + 1, lo, None))
        else:
            u, i = _dense(c)
            parts.append((i, len(u), 0, u))
    space = float(np.prod([float(base) for _, base, _, _ in parts]))
    if space >= 2.0**62:  # pragma: no cover - more combinations than int64 keys: sort the rows themselves
        stacked = np.stack([c.astype(np.int64) for c in cols], axis=1)
        rows, inv = np.unique(stacked, axis=0, return_inverse=True)
        return rows, inv.reshape(-1)
    key = np.zeros(n, dtype=np.int64)
    for digit, base, _, _ in parts:
        key = key * base + digit
    if space <= _small_space(n):
        present = np.bincount(key, minlength=int(space)) > 0
        uk = np.flatnonzero(present)
        inv = (np.cumsum(present) - 1)[key]
    else:
        uk, inv = np.unique(key, return_inverse=True)
        inv = inv.reshape(-1)
    rows = np.empty((len(uk), len(cols)), dtype=np.int64)
    rem = uk.copy()
    for j in range(len(cols) - 1, -1, -1):
        _, base, lo, values = parts[j]
        digit = rem % base
        rows[:, j] = values[digit] if values is not None else digit + lo
        rem //= base
    return rows, inv


def grouped_argmax(values: np.ndarray, gid: np.ndarray, *, last: bool = False) -> np.ndarray:
    """Row index of each group's largest value (no NaN in ``values``), groups in ascending id order;
    ties go to the first row (``last``: the last row). Rows sorted by ``gid`` in groups of one size
    (every rank reported) are read as a matrix; otherwise one sort."""
    n = len(values)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    sizes = np.diff(np.r_[starts, n])
    if (sizes == sizes[0]).all() and (len(starts) == 1 or (gid[starts[1:]] > gid[starts[:-1]]).all()):
        k = int(sizes[0])
        m = values.reshape(len(starts), k)
        pos = k - 1 - np.argmax(m[:, ::-1], axis=1) if last else np.argmax(m, axis=1)
        return starts + pos
    if last:
        order = np.lexsort((values, gid))
        ends = np.r_[np.flatnonzero(np.diff(gid[order])), n - 1]
        return order[ends]
    order = np.lexsort((-values, gid))
    firsts = np.flatnonzero(np.r_[True, gid[order][1:] != gid[order][:-1]])
    return order[firsts]
