"""The analysis functions on hand-made rows — no database: figures, bottlenecks, stragglers, collectives,
goodput, scaling, regressions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from fleetscope.server.analysis import figures as F
from fleetscope.server.analysis.bottlenecks import bottleneck_report, data_stall_ranks
from fleetscope.server.analysis.collectives import collective_efficiency, collective_rows
from fleetscope.server.analysis.goodput import goodput
from fleetscope.server.analysis.regressions import check_verdict, step_shift_regression
from fleetscope.server.analysis.scaling import compare_runs, scaling
from fleetscope.server.analysis.stragglers import from_blocks, straggler_report
from fleetscope.server.store.rows import CollectiveRow, RankRollups, RunAggregate, RunRow, StepFrame

RUN = RunRow(id=1, name="r", model_family="llm", config={"lr": 1}, config_signature="sig", world_size=8, mp_size=2,
             device_type="H100", device_count=8, peak_flops=1e15, git_commit="c1", status="finished", meta={},
             started_at="2024-01-01T00:00:00+00:00", finished_at=None, last_seen_at=None, rank_steps=80,
             collective_records=0, steps=10, last_step=9)


def _agg(**kw: Any) -> RunAggregate:
    base = {f: None for f in RunAggregate.__dataclass_fields__}
    base.update(n=10, step_s=1.0, step_s_max_p95=1.2, data_s=0.1, compute_s=0.6, comm_exposed_s=0.2, other_s=0.1,
                comm_total_s=0.5, straggler_wait_s=0.05, sum_step_s=10.0, sum_data_s=1.0, sum_compute_s=6.0,
                sum_comm_exposed_s=2.0, sum_other_s=1.0, sum_comm_total_s=5.0, sum_wait_s=0.5, sum_wait_in_comm_s=0.5,
                flops_per_dev_s=4e14, tokens_per_s_raw=16_000.0, tokens_per_rank_step=1000.0, tokens_per_step=8000.0,
                n_ranks=8.0, sum_tokens=80_000.0, sum_padded_tokens=100_000.0, alloc_retries=None, neg_residual_steps=0.0)
    base.update(kw)
    return RunAggregate(**base)


def test_each_figure_follows_its_one_definition() -> None:
    f = F.run_figures(RUN, _agg())
    assert f.mfu == pytest.approx(0.4) and f.tokens_per_s == pytest.approx(8000.0)  # mp_size 2 counts tokens once
    assert f.tokens_per_s_per_gpu == pytest.approx(1000.0)
    # GPU-seconds per 1k tokens of one GPU: 1 s per step for 1000 tokens per rank × mp 2
    assert f.step_s_per_1k_tokens == pytest.approx(0.5) and f.step_s_per_1k_tokens == pytest.approx(1000 / 2000)
    assert f.overlap_ratio == pytest.approx(0.6) and f.packing_efficiency == pytest.approx(0.8)
    assert f.shares == pytest.approx({"data": 0.1, "compute": 0.6, "comm_exposed": 0.15, "other": 0.1,
                                      "straggler_wait": 0.05})
    assert sum(f.shares.values()) == pytest.approx(1.0) and f.alloc_retries == 0.0
    assert F.RunFigures.from_json(f.to_json()) == f and F.RunFigures.from_json({**f.to_json(), "v": 1}) is None
    empty = F.run_figures(RUN, None)
    assert empty.steps == 0 and empty.mfu is None and empty.shares is None and empty.alloc_retries is None
    assert F.run_figures(replace(RUN, peak_flops=None), _agg()).mfu is None
    assert F.amdahl_ceiling(0.75) == pytest.approx(4.0) and F.amdahl_ceiling(1.0) is None
    # per-step series use the same functions
    assert np.allclose(F.mfu(np.array([4e14, 5e14]), 1e15), [0.4, 0.5])


def test_bottleneck_report_ranks_by_ceiling_and_names_causes() -> None:
    fig = F.run_figures(RUN, _agg(sum_comm_exposed_s=4.5, sum_comm_total_s=5.0, sum_wait_s=0.0, sum_wait_in_comm_s=0.0,
                                  alloc_retries=3.0))
    st = {"stragglers": [], "nodes": []}
    rep = bottleneck_report(1, fig, efficiency_large_messages=0.3, stall_ranks=[], stragglers=st)
    comps = {c["component"]: c for c in rep["components"]}
    assert [c["share"] for c in rep["components"]] == sorted((c["share"] for c in rep["components"]), reverse=True)
    assert rep["overlap_ratio"] == pytest.approx(0.1) and "low overlap" in comps["comm_exposed"]["finding"]
    assert any("low bus bandwidth" in x for x in comps["comm_exposed"]["findings"])
    assert "allocator retries" in comps["other"]["finding"] and rep["mfu"] == pytest.approx(0.4)
    assert bottleneck_report(1, F.RunFigures(), efficiency_large_messages=None, stall_ranks=[], stragglers=None) == {
        "run_id": 1, "components": [], "findings": []}


def test_data_stalls_on_a_minority_of_ranks() -> None:
    n = 16
    arr = {"rank": np.arange(n, dtype=float), "step_s": np.full(n, 10.0), "data_s": np.full(n, 0.2)}
    arr["data_s"][[3, 6]] = 3.0
    hosts = {r: (f"h{r // 8}", None) for r in range(n)}
    got = data_stall_ranks(RankRollups(arr, {}, {}), hosts)
    assert [x["rank"] for x in got] == [3, 6] and got[0]["host"] == "h0" and got[0]["data_share"] == pytest.approx(0.3)
    arr["data_s"][:] = 3.0  # everyone stalls: not "some ranks only"
    assert data_stall_ranks(RankRollups(arr, {}, {}), hosts) == [] and data_stall_ranks(None, hosts) == []


def _blocks(n_steps: int, ranks: int, slow: dict[int, float]) -> list[tuple[int, dict[str, np.ndarray]]]:
    out = []
    for s in range(n_steps):
        work = np.array([slow.get(r, 1.0) for r in range(ranks)])
        out.append((s, {"rank": np.arange(ranks), "step_s": work + 0.1, "comm_exposed_s": np.full(ranks, 0.1),
                        "data_s": np.full(ranks, 0.01), "compute_s": work - 0.02, "other_s": np.full(ranks, 0.01)}))
    return out


def test_straggler_report_from_blocks_names_the_slow_rank_and_its_node() -> None:
    data = from_blocks(_blocks(30, 8, {r: 1.3 for r in (4, 5)}), 8)
    hosts = {r: ("host-a" if r < 4 else "host-b", "node-a" if r < 4 else "node-b") for r in range(8)}
    fig = F.RunFigures(steps=30, sum_wait_s=9.0, sum_step_s=33.0, skew_p50=1.3)
    rep = straggler_report(1, world_size=8, fig=fig, hosts={r: hosts[r] for r in range(6)}, data=data)
    assert [x["rank"] for x in rep["stragglers"]] == [4, 5] and rep["source"].startswith("blocks")
    assert rep["stragglers"][0]["component"] == "compute" and rep["fleet_lost_share"] == pytest.approx(9 / 33)
    assert [n["node"] for n in rep["nodes"]] == ["node-b"]
    assert from_blocks([], 8) is None


def test_collective_rows_and_efficiency_against_the_declared_links() -> None:
    rows = [CollectiveRow("all_reduce", 8, 24, 10, 10, 10 * 2.0**24, 0.01, 0.001),
            CollectiveRow("all_reduce", 16, 24, 10, 10, 10 * 2.0**24, 0.04, 0.002),
            CollectiveRow("barrier", 16, 0, 5, 5, 0.0, 0.001, 0.0)]
    api = collective_rows(rows)
    assert api[0]["algbw_bytes_per_s"] == pytest.approx(10 * 2**24 / 0.01)
    assert api[0]["busbw_bytes_per_s"] == pytest.approx(api[0]["algbw_bytes_per_s"] * 2 * 7 / 8)
    run = replace(RUN, world_size=16, meta={"topology": {"gpus_per_node": 8, "nvlink_GBps": 450, "nic_Gbps": 400}})
    eff = collective_efficiency(run, rows, None)
    links = {(c["group_size"], c["link"]) for c in eff["collectives"]}
    assert links == {(8, "nvlink"), (16, "nic")} and eff["note"] is None and eff["efficiency_large_messages"] > 0
    bare = collective_efficiency(RUN, rows, 8)
    assert all(c["efficiency"] is None for c in bare["collectives"]) and "unknown" in bare["note"]


def test_goodput_charges_checkpoints_and_data_waits() -> None:
    ts = 1000.0 + np.arange(10) * 1.0
    ts[5:] += 4.0  # a 4 s checkpoint between step 4 and 5
    frame = StepFrame({"step": np.arange(10.0), "ts": ts, "step_s": np.full(10, 1.0), "data_s": np.full(10, 0.1)})
    g = goodput(1, 990.0, None, frame, [("checkpoint", 1005.0, 5, {"duration_s": 4.0})])
    assert g["badput"]["init_s"] == pytest.approx(10.0) and g["badput"]["checkpoint_s"] == 4.0
    assert g["badput"]["data_stall_s"] == pytest.approx(1.0) and g["productive_s"] == pytest.approx(9.0)
    assert g["goodput"] == pytest.approx(9.0 / 24.0) and g["estimated"] is False
    assert goodput(1, 0.0, None, StepFrame({"step": np.empty(0)}), [])["goodput"] is None


def test_scaling_and_compare_from_figures() -> None:
    runs = []
    for i, n in enumerate((8, 16, 32)):
        run = replace(RUN, id=i + 1, name=f"s{n}", world_size=n, mp_size=1)
        runs.append((run, F.run_figures(run, _agg(tokens_per_s_raw=1000.0 * n * (1 - 0.05 * i), tokens_per_rank_step=1000.0))))
    (g,) = scaling("llm", runs)["groups"]
    assert [p["world_size"] for p in g["points"]] == [8, 16, 32] and g["mode"] == "weak"
    assert [p["efficiency"] for p in g["points"]] == pytest.approx([1.0, 0.95, 0.9])
    cmp = compare_runs([3, 1, 99], {r.id: (r, f) for r, f in runs})
    assert [r["id"] for r in cmp["runs"]] == [3, 1] and cmp["missing"] == [99]
    assert cmp["relative_to_first"]["tokens_per_s_per_gpu"][1] == pytest.approx(1 / 0.9)


def test_check_verdict_and_within_run_shift() -> None:
    base = [(replace(RUN, id=i, started_at=f"2024-01-0{i}"), F.run_figures(RUN, _agg())) for i in range(1, 6)]
    me = (replace(RUN, id=9, started_at="2024-01-09"), F.run_figures(RUN, _agg(tokens_per_s_raw=12_000.0)))
    v = check_verdict(me, [*base, me], None)
    assert v["regressed"] and v["baseline"]["runs"] == [1, 2, 3, 4, 5]
    assert {r["metric"] for r in v["regressions"]} == {"tokens_per_s_per_gpu"}
    ok = check_verdict(base[-1], base, None)
    assert not ok["regressed"] and "config signature" in ok["baseline"]["match"]
    y = np.r_[np.full(60, 1.0), np.full(40, 1.3)] + np.random.default_rng(0).normal(0, 0.01, 100)
    shift = step_shift_regression(7, np.arange(100), y)
    assert shift is not None and abs(shift.first_bad["step"] - 60) <= 2 and shift.change == pytest.approx(0.3, abs=0.03)
    assert step_shift_regression(7, np.arange(3), np.ones(3)) is None


def test_phases_are_the_measured_compute_phases_only() -> None:
    from fleetscope.server.analysis.figures import run_figures

    fig = run_figures(RUN, _agg(forward_s=0.2, backward_s=0.35, optimizer_s=0.05))
    assert fig.phases == {"forward": 0.2, "backward": 0.35, "optimizer": 0.05}
    assert run_figures(RUN, _agg()).phases is None  # nothing measured: absent, not zero
