"""Stragglers (``reports.stragglers``) on synthetic runs with known answers, through the real ingest and
compaction."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from analysis_util import field_index, load, with_fields
from fleetscope.server import reports
from fleetscope.server.analysis.rollups import HIST_BW
from fleetscope.server.analysis.stragglers import from_blocks
from fleetscope.server.reports import stragglers as run_stragglers
from fleetscope.server.store.steps import recent_blocks
from sqlalchemy import text

from fleetscope.synthetic import RunSpec


def test_injected_straggler_is_named_first_and_alone_with_its_cause(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="strag", family="vla-7b", world_size=64, steps=30, straggler={13: 1.3}))
    s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary").json()
    assert [x["rank"] for x in s["stragglers"]] == [13]
    top = s["stragglers"][0]
    assert top["host"] == "node0001" and top["kind"] == "persistent" and top["component"] == "compute"
    # work = data + compute + other with compute 95 % of it: 1.3x compute is ~1.28x work
    assert top["slowdown"] == pytest.approx(1.285, abs=0.02)
    rep = run_stragglers(live_server.state.engine, rid, per_step=True, max_points=8)
    assert rep["source"] == "rollups" and rep["nodes"] == []
    ps = rep["per_step"]  # 30 steps in buckets of 4: each bucket's worst step, rank 13 every time
    assert ps["bucket_steps"] == 4 and len(ps["step"]) == 8 and set(ps["slowest_rank"]) == {13}
    assert all(1.25 < v < 1.32 for v in ps["skew"])
    assert rep["skew_p50"] == pytest.approx(1.285, abs=0.03)
    # the straggler is the slowest rank of every step: all the fleet's waiting is charged to it
    assert rep["stragglers"][0]["slowest_steps"] == 30
    assert rep["stragglers"][0]["lost_s"] == pytest.approx(rep["fleet_lost_s"], rel=1e-3)
    assert rep["stragglers"][0]["lost_gpu_s"] == pytest.approx(rep["fleet_lost_s"] * 63, rel=1e-3)


def test_a_slow_node_is_named_when_all_its_ranks_straggle(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="node", family="llm-70b", world_size=32, steps=12,
                                    straggler={r: 1.3 for r in range(8, 16)}))
    rep = run_stragglers(live_server.state.engine, rid)
    assert sorted(x["rank"] for x in rep["stragglers"]) == list(range(8, 16))
    assert all(x["node_flagged"] and x["kind"] == "persistent" for x in rep["stragglers"])
    assert [n["node"] for n in rep["nodes"]] == ["node0001"] and rep["nodes"][0]["ranks"] == list(range(8, 16))
    assert rep["nodes"][0]["slowdown"] == pytest.approx(1.28, abs=0.03)


def test_no_straggler_means_an_empty_list(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="clean", family="vit-h", world_size=32, steps=20))
    assert httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary").json()["stragglers"] == []


def test_transient_straggler_is_told_apart_from_a_persistent_one(live_server: Any) -> None:
    i_step, i_comp = field_index("step_s"), field_index("compute_s")

    def slow_5_mid_run(step: int, rows: list[tuple]) -> list[tuple]:
        if not 100 <= step < 200:
            return rows
        r = rows[5]
        extra = 0.4 * r[i_comp]
        rows[5] = with_fields(r, step_s=r[i_step] + extra, compute_s=r[i_comp] + extra)
        return rows

    rid = load(live_server, RunSpec(name="transient", family="vit-h", world_size=16, steps=300),
               transform=slow_5_mid_run, collectives=False)
    rep = run_stragglers(live_server.state.engine, rid)
    assert [x["rank"] for x in rep["stragglers"]] == [5]
    st = rep["stragglers"][0]
    assert st["kind"] == "transient" and st["windows_flagged"] == 1 and st["windows"] == 3
    assert st["first_window_step"] == 100 and st["peak_window_slowdown"] > 1.3
    assert st["slowdown"] < 1.05 and st["component"] == "compute"


def test_late_arrivals_at_collectives_are_measured(live_server: Any) -> None:
    def late_rank_3(step: int, rows: list[tuple]) -> list[tuple]:
        # (rank, step, seq, op, n, bytes, calls, total_s, exposed_s, start_ts)
        return [r[:9] + (r[9] + 0.05 * (r[0] == 3) + 0.001 * r[0] / 100,) for r in rows]

    rid = load(live_server, RunSpec(name="late", family="vit-h", world_size=8, steps=10), coll_transform=late_rank_3)
    rep = run_stragglers(live_server.state.engine, rid)
    assert [x["rank"] for x in rep["late_ranks"]] == [3]
    assert rep["late_ranks"][0]["lateness_s"] == pytest.approx(0.05, abs=0.002)
    assert rep["late_ranks"][0]["last_arrivals"] == 40  # 4 collectives per step, every step


def test_rollups_stay_exact_when_ranks_arrive_late_or_twice(live_server: Any) -> None:
    """Steps compacted with half their ranks, then completed (and partly re-sent), fold to the same
    figures as one pass over the final blocks."""
    spec = RunSpec(name="refold", family="vla-7b", world_size=16, steps=12, straggler={11: 1.2, 2: 1.1})
    from fleetscope.client import columnar
    from fleetscope.synthetic import rank_step_rows
    from fleetscope.wire import RANK_STEP_FIELDS

    rid = load(live_server, RunSpec(name="refold", family="vla-7b", world_size=16, steps=0))
    rows = {step: r for step, r in rank_step_rows(spec)}
    with live_server.client() as c:
        c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar([x for r in rows.values() for x in r[:8]],
                                                                  RANK_STEP_FIELDS)})
        live_server.compact()
        c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar([x for r in rows.values() for x in r[5:]],
                                                                  RANK_STEP_FIELDS)})
        live_server.compact()
    eng = live_server.state.engine
    rep = run_stragglers(eng, rid)
    assert [x["rank"] for x in rep["stragglers"]] == [11, 2]
    with eng.connect() as c:
        roll = {r[0]: r[1:] for r in c.execute(
            text("SELECT rank, steps, above, excess_s, compute_excess_s, lost_s, slowest_steps FROM rank_rollups "
                 "WHERE run_id = :id"), {"id": rid})}
    ref = from_blocks(recent_blocks(eng, rid, 512), 16)
    assert ref is not None
    arr = ref["arr"]
    for j, rank in enumerate(arr["rank"].astype(int)):
        steps, above, excess, cex, lost, slowest = roll[rank]
        assert steps == arr["steps"][j] == 12 and above == arr["above"][j] and slowest == arr["slowest_steps"][j]
        assert excess == pytest.approx(arr["excess_s"][j], abs=1e-4)
        assert cex == pytest.approx(arr["compute_excess_s"][j], abs=1e-4)
        assert lost == pytest.approx(arr["lost_s"][j], abs=1e-4)
    slow = {x["rank"]: x["slowdown"] for x in rep["stragglers"]}
    assert slow[11] == pytest.approx(float(arr["slowdown"][11]), rel=HIST_BW)


def test_runs_without_rollups_are_analysed_from_recent_blocks(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="old", family="vla-7b", world_size=16, steps=8, straggler={4: 1.25}))
    eng = live_server.state.engine
    with eng.begin() as c:
        c.execute(text("DELETE FROM rank_rollups WHERE run_id = :id"), {"id": rid})
        c.execute(text("DELETE FROM rank_windows WHERE run_id = :id"), {"id": rid})
    reports.clear_caches()  # reports are cached per run until new data is folded; rollups never vanish
    rep = run_stragglers(eng, rid)
    assert rep["source"].startswith("blocks") and [x["rank"] for x in rep["stragglers"]] == [4]
    assert rep["stragglers"][0]["slowdown"] == pytest.approx(1.24, abs=0.02)
    assert np.isfinite(rep["fleet_lost_s"])


def test_a_failing_rollup_fold_never_stops_compaction(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetscope.server.analysis import rollups

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected")

    before = rollups.fold_errors
    monkeypatch.setattr(rollups, "_fold", boom)
    rid = load(live_server, RunSpec(name="foldfail", family="vit-h", world_size=4, steps=3), collectives=False)
    assert rollups.fold_errors > before
    s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary").json()
    assert s["steps"] == 3 and s["rank_steps"] == 12  # compacted; stragglers fall back to the blocks
    assert run_stragglers(live_server.state.engine, rid)["source"].startswith("blocks")

