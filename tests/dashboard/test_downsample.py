"""Server-side reductions: spikes and end points survive, and every reduction reports its factor."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.server.downsample import mean_buckets, minmax_series, reduce_matrix, sum_buckets


def test_short_series_is_returned_raw_with_factor_one() -> None:
    x = np.arange(50)
    r = minmax_series(x, np.sin(x), max_points=100)
    assert r.factor == 1 and np.array_equal(r.x, x)


def test_minmax_keeps_every_spike_dip_and_both_ends() -> None:
    rng = np.random.default_rng(0)
    y = rng.normal(1.0, 0.01, 100_000)
    y[12_345] = 9.0  # one spike
    y[77_777] = -5.0  # one dip
    r = minmax_series(np.arange(y.size), y, max_points=1000)
    assert len(r.x) <= 1000 and r.factor >= 100 and r.n_source == y.size
    assert 12_345 in r.x and 77_777 in r.x
    assert r.x[0] == 0 and r.x[-1] == y.size - 1
    assert r.y.max() == 9.0 and r.y.min() == -5.0
    assert np.all(np.diff(r.x) > 0)  # in order


def test_minmax_ignores_unmeasured_points() -> None:
    y = np.full(5000, np.nan)
    y[::7] = 1.0
    y[700] = 3.0
    r = minmax_series(np.arange(5000), y, max_points=100)
    assert np.nanmax(r.y) == 3.0


def test_mean_buckets_of_components_still_add_up_to_the_mean_total() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.random(1000), rng.random(1000)
    x, out, f = mean_buckets(np.arange(1000), {"a": a, "b": b}, max_points=100)
    assert f == 10 and len(x) == 100
    assert np.allclose(out["a"] + out["b"], (a + b).reshape(100, 10).mean(axis=1))


def test_sum_buckets_keeps_totals() -> None:
    v = np.arange(1000, dtype=float)
    _, out, f = sum_buckets(np.arange(1000), {"t": v}, max_points=7)
    assert f == 143 and out["t"].sum() == v.sum()


@pytest.mark.parametrize("how,fn", [("max", np.max), ("mean", np.mean), ("min", np.min)])
def test_matrix_reduction_by_blocks(how: str, fn: object) -> None:
    rng = np.random.default_rng(2)
    m = rng.random((1024, 5000))
    red = reduce_matrix(m, max_rows=256, max_cols=400, how=how)
    assert red.values.shape == (256, 385) and red.row_factor == 4 and red.col_factor == 13 and red.aggregated
    assert np.isclose(red.values[3, 7], fn(m[12:16, 91:104]))  # type: ignore[operator]
    assert red.row_lo[3] == 12 and red.row_hi[3] == 15 and red.col_hi[-1] == 4999


def test_matrix_reduction_keeps_a_single_slow_rank_visible_with_max() -> None:
    m = np.ones((1024, 3000))
    m[517, :] = 1.3
    red = reduce_matrix(m, max_rows=256, max_cols=300, how="max")
    assert np.all(red.values[517 // 4] == 1.3) and np.all(np.delete(red.values, 517 // 4, axis=0) == 1.0)


def test_small_matrix_is_not_reduced_and_all_nan_blocks_stay_nan() -> None:
    m = np.full((4, 10), np.nan)
    m[0, 0] = 1
    red = reduce_matrix(m, max_rows=2, max_cols=5)
    assert red.values.shape == (2, 5) and red.values[0, 0] == 1 and np.isnan(red.values[1, 4])
    assert not reduce_matrix(np.ones((3, 3))).aggregated
