"""Server-side reductions of large series and matrices for charts — never silent.

Every function returns how much it aggregated, so the chart can say so. Rules (docs/dashboard.md):

- a line series longer than ``max_points`` keeps, per bucket of consecutive points, its minimum
  and its maximum in their original order, plus the first and the last point of the series
  (spikes and the ends survive);
- stacked components are averaged per bucket (means of parts still add up to the mean total);
- a ranks × steps matrix is reduced to at most ``max_rows`` × ``max_cols`` cells by max, mean or
  min over each cell's block (NaN = not measured is ignored; an all-NaN block stays NaN).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Reduced", "minmax_series", "mean_buckets", "sum_buckets", "MatrixReduction", "reduce_matrix"]


@dataclass(frozen=True)
class Reduced:
    """A reduced series: ``x``, ``y`` and ``factor`` source points per bucket (1 = raw)."""

    x: np.ndarray
    y: np.ndarray
    factor: int
    n_source: int


def _edges(n: int, buckets: int) -> np.ndarray:
    return np.linspace(0, n, buckets + 1).round().astype(np.int64)


def minmax_series(x: np.ndarray, y: np.ndarray, max_points: int = 1000) -> Reduced:
    """Min/max per bucket (in x order) so that at most ``max_points`` points remain."""
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n <= max_points:
        return Reduced(x, y, 1, n)
    buckets = max(1, (max_points - 2) // 2)
    edges = _edges(n, buckets)
    keep = [0, n - 1]
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        seg = y[a:b]
        ok = ~np.isnan(seg)
        if not ok.any():
            continue
        idx = np.flatnonzero(ok)
        keep.append(a + idx[np.argmin(seg[ok])])
        keep.append(a + idx[np.argmax(seg[ok])])
    sel = np.unique(np.asarray(keep, dtype=np.int64))
    return Reduced(x[sel], y[sel], int(np.ceil(n / buckets)), n)


def _bucket_reduce(x: np.ndarray, ys: dict[str, np.ndarray], max_points: int, how: str) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    x = np.asarray(x)
    n = len(x)
    if n <= max_points:
        return x, {k: np.asarray(v, dtype=np.float64) for k, v in ys.items()}, 1
    edges = _edges(n, max_points)
    starts = edges[:-1]
    out: dict[str, np.ndarray] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k, v in ys.items():
            v = np.asarray(v, dtype=np.float64)
            if how == "mean":
                out[k] = np.array([np.nanmean(v[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)])
            else:
                out[k] = np.array(
                    [np.nansum(v[a:b]) if np.any(~np.isnan(v[a:b])) else np.nan
                     for a, b in zip(edges[:-1], edges[1:], strict=True)]
                )
    return x[starts], out, int(np.ceil(n / max_points))


def mean_buckets(x: np.ndarray, ys: dict[str, np.ndarray], max_points: int = 600) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Mean of each series per bucket of consecutive x; returns (bucket start x, means, factor)."""
    return _bucket_reduce(x, ys, max_points, "mean")


def sum_buckets(x: np.ndarray, ys: dict[str, np.ndarray], max_points: int = 600) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Sum of each series per bucket of consecutive x (for counts such as tokens per modality)."""
    return _bucket_reduce(x, ys, max_points, "sum")


@dataclass(frozen=True)
class MatrixReduction:
    """A reduced matrix: ``values[row_bucket, col_bucket]`` with the source index range of each bucket."""

    values: np.ndarray
    row_lo: np.ndarray  # first source row of each row bucket
    row_hi: np.ndarray  # last source row (inclusive)
    col_lo: np.ndarray
    col_hi: np.ndarray
    row_factor: int
    col_factor: int
    how: str

    @property
    def aggregated(self) -> bool:
        return self.row_factor > 1 or self.col_factor > 1


def reduce_matrix(mat: np.ndarray, max_rows: int = 256, max_cols: int = 400, how: str = "max") -> MatrixReduction:
    """Reduce ``mat[rows, cols]`` by ``how`` (max, mean, min) over blocks of equal size."""
    if how not in ("max", "mean", "min"):
        raise ValueError(f"how must be max, mean or min, got {how!r}")
    mat = np.asarray(mat)
    if mat.dtype not in (np.float32, np.float64):  # float32 stays float32: a large matrix is not doubled
        mat = mat.astype(np.float64)
    r, c = mat.shape
    fr = max(1, int(np.ceil(r / max_rows))) if r else 1
    fc = max(1, int(np.ceil(c / max_cols))) if c else 1
    nr, nc = (int(np.ceil(r / fr)), int(np.ceil(c / fc)))
    if fr == 1 and fc == 1:
        vals = mat.copy()
    else:
        padded = np.full((nr * fr, nc * fc), np.nan, dtype=mat.dtype)
        padded[:r, :c] = mat
        blocks = padded.reshape(nr, fr, nc, fc)
        # annotated: the three numpy reductions' overloads do not unify into one callable type
        reducers: dict[str, Callable[..., np.ndarray]] = {"max": np.nanmax, "mean": np.nanmean, "min": np.nanmin}
        fn = reducers[how]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            vals = fn(blocks, axis=(1, 3))
    row_lo = np.arange(nr) * fr
    col_lo = np.arange(nc) * fc
    return MatrixReduction(
        values=vals,
        row_lo=row_lo,
        row_hi=np.minimum(row_lo + fr, r) - 1,
        col_lo=col_lo,
        col_hi=np.minimum(col_lo + fc, c) - 1,
        row_factor=fr,
        col_factor=fc,
        how=how,
    )
