"""The one aggregate loader (``store.aggregates``) against numpy over the step frames it summarises,
and the figures cache in ``run_stats`` (reused at the same counters, recomputed after new steps)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from analysis_util import load
from fleetscope.server import reports
from fleetscope.server.analysis.figures import FIGURES_VERSION
from fleetscope.server.store import aggregates, steps
from fleetscope.server.store import runs as run_store
from sqlalchemy import text

from fleetscope.synthetic import RunSpec


def test_aggregates_of_many_runs_equal_numpy_over_each_frame(live_server: Any) -> None:
    ids = [load(live_server, RunSpec(name=f"a{i}", family="vla-7b", world_size=4 * (i + 1), steps=9 + i, seed=i,
                                     straggler={1: 1.2}))
           for i in range(3)]
    eng = live_server.state.engine
    aggs = aggregates.load_aggregates(eng, [*ids, 99_999])
    assert set(aggs) == set(ids)
    for rid in ids:
        f = steps.load_steps(eng, rid)
        a = aggs[rid]
        assert a.n == len(f) == f["step"].size
        for name in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s",
                     "flops_per_dev_s", "tokens_per_s_raw"):
            assert getattr(a, name) == pytest.approx(float(np.nanmedian(f[name])), rel=1e-9), name
        assert a.step_s_max_p95 == pytest.approx(float(np.percentile(f["step_s_max"], 95)), rel=1e-9)
        wait = np.clip(np.nan_to_num(f["work_s_max"] - f["work_s"]), 0, None)
        assert a.sum_wait_s == pytest.approx(float(wait.sum()), rel=1e-9)
        assert a.sum_wait_in_comm_s == pytest.approx(float(np.minimum(wait, f["comm_exposed_s"]).sum()), rel=1e-9)
        assert a.sum_tokens == pytest.approx(float(np.nansum(f["tokens"])))
        assert a.skew_max == pytest.approx(float(np.max(f["work_s_max"] / f["work_s"])), rel=1e-9)


def test_figures_are_kept_in_run_stats_and_recomputed_when_the_run_grows(live_server: Any) -> None:
    spec = RunSpec(name="grow", family="vit-h", world_size=4, steps=20, seed=3)
    from dash_util import load as load_range

    rid = load_range(live_server, spec, step_hi=8)
    eng = live_server.state.engine
    run = run_store.get_run(eng, rid)
    assert run is not None
    assert reports.figures(eng, [run])[rid].steps == 8
    with eng.connect() as c:
        rs, stats = c.execute(text("SELECT rank_steps, stats FROM run_stats WHERE run_id = :id"), {"id": rid}).one()
    assert rs == run.rank_steps and stats["steps"] == 8 and stats["v"] == FIGURES_VERSION
    reports.clear_caches()
    assert reports.figures(eng, [run])[rid].steps == 8  # from run_stats: no aggregate query needed
    load_range(live_server, spec, step_lo=8)
    grown = run_store.get_run(eng, rid)
    assert grown is not None and reports.figures(eng, [grown])[rid].steps == 20
