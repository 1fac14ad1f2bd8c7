"""The projection model (server/analysis/projection.py) on hand-computed cases."""

from __future__ import annotations

import pytest
from fleetscope.server.analysis.projection import (
    Baseline,
    BusbwPoint,
    BusbwTable,
    CommClass,
    Layout,
    error_summary,
    project,
)


def _base(**kw: object) -> Baseline:
    d: dict = dict(run_id=1, layout=Layout(4), steps=50, step_s=1.5, data_s=0.1, compute_s=1.0, comm_exposed_s=0.3,
                   other_s=0.1, comm_total_s=0.6, flops_per_rank_step=1e12, peak_flops=1e13, tokens_per_s=1000.0,
                   collectives=(CommClass("all_reduce", 4, bytes=1e8 * 10, calls=10, total_s=6.0, exposed_s=3.0),))
    d.update(kw)
    return Baseline(**d)  # type: ignore[arg-type]


def _flat_table(*ns: int, busbw: float = 10e9) -> BusbwTable:
    return BusbwTable([BusbwPoint("all_reduce", n, 1e8, busbw, f"run:{n}") for n in ns])


def test_the_run_own_layout_projects_its_measured_step() -> None:
    out = project(_base(), Layout(4), _flat_table(4))
    assert out["status"] == "ok"
    assert out["step_s"] == pytest.approx(1.5)
    assert sum(out["parts"].values()) == pytest.approx(1.5)
    assert out["mfu"] == pytest.approx(1e12 / 1.5 / 1e13)


def test_doubling_data_parallel_moves_the_all_reduce_by_its_busbw_factor() -> None:
    # ring all_reduce at a flat 10 GB/s busbw: t ∝ 2(n−1)/n, so 4 → 8 ranks is ×(1.75/1.5); the 0.6 s of the
    # step becomes 0.7 s; the run hid 0.3 s behind its (unchanged) compute, so 0.4 s is exposed (> 0.35 = half)
    out = project(_base(), Layout(8), _flat_table(4, 8))
    assert out["status"] == "ok"
    assert out["parts"]["comm_exposed"] == pytest.approx(0.4)
    assert out["step_s"] == pytest.approx(0.1 + 1.0 + 0.4 + 0.1)
    assert out["tokens_per_s"] == pytest.approx(1000 * 2 * 1.5 / 1.6)  # twice the replicas, each a bit slower
    assert out["mfu"] == pytest.approx(1e12 / 1.6 / 1e13)
    assert out["comm_total_s"] == pytest.approx(0.7)
    assert out["basis"]["sizes"] == "interpolated"
    assert out["basis"]["sources"] == ["run:4", "run:8"]
    lo, hi = out["error_band"]["step_s"]
    assert lo <= out["step_s"] <= hi


def test_a_group_size_never_measured_is_extrapolated_with_the_alpha_beta_fit() -> None:
    # at n=2 (factor 1): t = 1 ms + S / 10 GB/s, measured at 1 MB and 100 MB
    pts = [BusbwPoint("all_reduce", 2, s, s / (1e-3 + s / 1e10), "bench:7") for s in (1e6, 1e8)]
    est = BusbwTable(pts).time_s("all_reduce", 8, 1e8)
    assert est is not None and est.how == "extrapolated_world"
    # latency 1 ms × 2(8−1) / 2(2−1) + bandwidth 10 ms × (1.75 / 1)
    assert est.seconds == pytest.approx(7e-3 + 1.75e-2)
    assert est.sources == ("bench:7",)
    assert est.spread == pytest.approx(0.05 * 2)  # two doublings beyond the measured group size


def test_busbw_is_interpolated_in_log_size() -> None:
    t = BusbwTable([BusbwPoint("all_reduce", 4, 1e6, 1e9, "run:1"), BusbwPoint("all_reduce", 4, 1e8, 3e9, "run:2")])
    est = t.time_s("all_reduce", 4, 1e7)  # halfway in log size: busbw 2 GB/s
    assert est is not None and est.how == "interpolated"
    assert est.seconds == pytest.approx(1e7 * 1.5 / 2e9)
    # all_gather without its own measurement reads all_reduce's busbw (the per-link figure) with its own factor
    ag = t.time_s("all_gather", 4, 1e6)
    assert ag is not None and ag.seconds == pytest.approx(1e6 * 0.75 / 1e9)


def test_pipelining_adds_the_schedule_bubble_and_splits_the_work() -> None:
    base = _base(layout=Layout(2), step_s=1.2, comm_exposed_s=0.0, comm_total_s=0.0, collectives=())
    out = project(base, Layout(4, pp=2, micro_batches=4), BusbwTable([]))
    assert out["status"] == "ok"
    # per-rank work halves (0.5 s); bubble = (pp−1)/m of it = 0.125 s; data and other as measured
    assert out["parts"]["compute"] == pytest.approx(0.5)
    assert out["parts"]["bubble"] == pytest.approx(0.125)
    assert out["step_s"] == pytest.approx(0.1 + 0.5 + 0.125 + 0.1)
    assert out["tokens_per_s"] == pytest.approx(1000 * 1.2 / 0.825)  # same number of replicas
    assert out["mfu"] == pytest.approx(0.5e12 / 0.825 / 1e13)


def test_a_measured_bubble_is_scaled_by_the_schedule() -> None:
    # pp=2, m=4: the model's bubble is 1.0 × 1/4 = 0.25 s; the run measured 0.2 s (inside exposed comm);
    # with m=8 the model halves → 0.1 s
    base = _base(layout=Layout(4, pp=2, micro_batches=4), step_s=1.4, comm_exposed_s=0.2, comm_total_s=0.2,
                 bubble_s=0.2, collectives=(CommClass("send", 2, 1e6, 10, 2.0, 2.0),))
    out = project(base, Layout(4, pp=2, micro_batches=8), BusbwTable([]))
    assert out["parts"]["bubble"] == pytest.approx(0.1)
    assert out["parts"]["comm_exposed"] == pytest.approx(0.0)
    assert out["step_s"] == pytest.approx(0.1 + 1.0 + 0.1 + 0.1)


def test_straggler_wait_is_held_and_taken_out_of_exposed_comm() -> None:
    # 0.3 s exposed of which 0.1 s is waiting for a straggler: 0.2 s of exposure is the collectives'
    out = project(_base(straggler_wait_s=0.1), Layout(8), _flat_table(4, 8))
    assert out["parts"]["straggler_wait"] == pytest.approx(0.1)
    assert out["parts"]["comm_exposed"] == pytest.approx(0.4 * 0.2 / 0.3)


def test_smaller_buckets_mean_more_calls_of_a_smaller_size() -> None:
    t = BusbwTable([BusbwPoint("all_reduce", 4, 1e6, 1e9, "run:1"), BusbwPoint("all_reduce", 4, 1e8, 3e9, "run:1")])
    out = project(_base(), Layout(4, bucket_bytes=1e7), t)
    # 10× the calls, each at 2 GB/s instead of 3 GB/s: 0.6 s × 10 × (1e7/2e9) / (1e8/3e9) = 0.9 s
    row = out["basis"]["collectives"][0]
    assert row["to_seconds"] == pytest.approx(0.9)
    assert out["parts"]["comm_exposed"] == pytest.approx(0.9 - 0.3)


def test_what_is_missing_is_said_not_guessed() -> None:
    few = project(_base(steps=1), Layout(8), _flat_table(4, 8))
    assert few["status"] == "insufficient_data" and few["step_s"] is None
    assert any("steady steps" in m for m in few["missing"])
    nodata = project(_base(), Layout(8), BusbwTable([]))
    assert nodata["status"] == "insufficient_data"
    assert nodata["missing"] == ["bus bandwidth of all_reduce on this cluster (no run or bench measured it)"]
    nocoll = project(_base(collectives=()), Layout(8), _flat_table(4, 8))
    assert any("collectives" in m for m in nocoll["missing"])
    nomb = project(_base(), Layout(8, pp=2), _flat_table(4, 8))
    assert any("micro_batches" in m for m in nomb["missing"])


def test_layouts_are_validated() -> None:
    with pytest.raises(ValueError, match="not a multiple of tp·pp"):
        Layout(6, tp=4)
    with pytest.raises(ValueError, match="micro_batches"):
        Layout(4, pp=2, micro_batches=0)


def test_track_record_widens_the_band_and_summarises_by_ratio() -> None:
    narrow = project(_base(), Layout(8), _flat_table(4, 8))
    wide = project(_base(), Layout(8), _flat_table(4, 8), track_record=0.2)
    assert wide["error_band"]["relative"] > narrow["error_band"]["relative"]
    assert wide["error_band"]["relative"] >= 0.2
    s = error_summary([{"world_size": 8, "from_world_size": 4, "error": 0.1},
                       {"world_size": 8, "from_world_size": 4, "error": -0.3},
                       {"world_size": 16, "from_world_size": 4, "error": 0.05}])
    assert s["n"] == 3 and s["worst_abs_error"] == pytest.approx(0.3)
    assert s["by_ratio"]["2"]["median_abs_error"] == pytest.approx(0.2)
    assert s["by_ratio"]["4"]["n"] == 1
