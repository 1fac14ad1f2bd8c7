"""Bottleneck attribution (``reports.bottlenecks``) on runs whose bottleneck is known by construction."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from analysis_util import field_index, load, with_fields
from fleetscope.server.reports import bottlenecks as run_bottlenecks

from fleetscope.synthetic import RunSpec


def _summary(srv: Any, rid: int) -> dict[str, Any]:
    return httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary").json()


def test_shares_add_up_and_are_ranked_by_their_amdahl_ceiling(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="plain", family="vla-7b", world_size=16, steps=10))
    b = _summary(live_server, rid)["bottlenecks"]
    assert {x["component"] for x in b} == {"data", "compute", "comm_exposed", "other", "straggler_wait"}
    assert sum(x["share"] for x in b) == pytest.approx(1.0, abs=1e-4)
    assert [x["share"] for x in b] == sorted((x["share"] for x in b), reverse=True)
    ranked = set(_summary(live_server, rid)["diagnosis"]["ranked_causes"])
    causes = {"comm_exposed": {"comm_bandwidth", "comm_sync", "pipeline_bubble"}}
    for x in b:  # a ceiling only where physical (not compute, 10–90 % of the step) and for a ranked cause
        physical = x["component"] != "compute" and 0.1 <= x["share"] <= 0.9
        if physical and ranked & causes.get(x["component"], {x["component"]}):
            assert x["max_speedup"] == pytest.approx(1 / (1 - x["share"]), rel=1e-3)
        else:
            assert x["max_speedup"] is None
        assert isinstance(x["finding"], str)
    assert b[0]["component"] == "compute" and "the work itself" in b[0]["finding"]


def test_comm_bound_run_points_at_exposed_communication_and_low_overlap(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="comm", family="llm-70b", world_size=64, steps=8, comm_bound=True))
    ok = load(live_server, RunSpec(name="overlapped", family="llm-70b", world_size=64, steps=8))
    rep = run_bottlenecks(live_server.state.engine, rid)
    ref = run_bottlenecks(live_server.state.engine, ok)
    comm = next(c for c in rep["components"] if c["component"] == "comm_exposed")
    comm_ref = next(c for c in ref["components"] if c["component"] == "comm_exposed")
    print(rep["components"])
    assert rep["components"][1]["component"] == "comm_exposed" and comm["share"] > 3 * comm_ref["share"]
    assert "low overlap" in comm["finding"] and rep["overlap_ratio"] == pytest.approx(0.15, abs=0.02)
    assert "low overlap" not in comm_ref["finding"] and ref["overlap_ratio"] > 0.5


def test_straggler_wait_names_the_rank_and_its_host(live_server: Any) -> None:
    rid = load(live_server, RunSpec(name="st", family="vla-7b", world_size=32, steps=10, straggler={21: 1.5}))
    b = {x["component"]: x for x in _summary(live_server, rid)["bottlenecks"]}
    assert b["straggler_wait"]["share"] > 0.25
    assert "straggler rank 21 on node0002" in b["straggler_wait"]["finding"]


def test_data_stalls_on_some_ranks_only_and_allocator_retries_are_findings(live_server: Any) -> None:
    i_step, i_data = field_index("step_s"), field_index("data_s")

    def stall(step: int, rows: list[tuple]) -> list[tuple]:
        for r in (3, 6):
            row = rows[r]
            extra = 0.3 * row[i_step]
            rows[r] = with_fields(row, step_s=row[i_step] + extra, data_s=row[i_data] + extra)
        rows[0] = with_fields(rows[0], alloc_retries=2)
        return rows

    rid = load(live_server, RunSpec(name="stall", family="vit-h", world_size=16, steps=10), transform=stall)
    rep = run_bottlenecks(live_server.state.engine, rid)
    comps = {c["component"]: c for c in rep["components"]}
    assert "data stalls on some ranks only" in comps["data"]["finding"]
    assert "rank 3 (node0000)" in comps["data"]["finding"] and "rank 6 (node0000)" in comps["data"]["finding"]
    assert "allocator retries" in comps["other"]["finding"] and "20 times" in comps["other"]["finding"]
    assert len(rep["findings"]) >= 2
