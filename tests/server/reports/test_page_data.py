"""Page data of the façade (``fleetscope.server.reports``, ``server/rank_matrix.py``) against the real
Postgres, with data sent through the real ingest: they agree with the run summary and say how much
they reduced."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from dash_util import add_alert, add_benchmarks, load
from fleetscope.server import reports
from fleetscope.server.downsample import reduce_matrix
from fleetscope.server.rank_matrix import clear_cache
from fleetscope.server.reports import rank_heatmap, rank_slowdown
from fleetscope.server.store.steps import load_steps, rank_step_matrix

from fleetscope.synthetic import RunSpec


def test_fleet_rows_carry_the_same_numbers_as_each_run_summary(live_server: Any) -> None:
    a = load(live_server, RunSpec(name="a-8", family="vla-7b", world_size=8, steps=12, seed=1))
    b = load(live_server, RunSpec(name="b-4", family="vit-h", world_size=4, steps=10, seed=2))
    eng = live_server.state.engine
    rows = {r["id"]: r for r in reports.fleet_rows(eng)}
    assert set(rows) == {a, b}
    for rid in (a, b):
        s = reports.run_summary(eng, rid)
        r = rows[rid]
        assert r["steps"] == s["steps"]
        for k, ref in (("mfu", s["mfu"]), ("tokens_per_s", s["tokens_per_s"]), ("step_s_p50", s["step_s_p50"]),
                       ("step_s_p95", s["step_s_p95"]), ("tokens_per_s_per_gpu", s["tokens_per_s_per_gpu"])):
            assert r[k] == pytest.approx(ref, rel=1e-9), k
        top = r["top_bottleneck"]
        assert top["component"] == "compute" and 0 < top["share"] < 1 and top["max_speedup"] is None  # compute: the work itself, no ceiling
        assert r["alerts_firing"] == 0
    assert [r["id"] for r in reports.fleet_rows(eng, family="vit-h")] == [b]
    assert [r["id"] for r in reports.fleet_rows(eng, q="A-8")] == [a]
    assert reports.fleet_rows(eng, status="failed") == []
    assert reports.families(eng) == ["vit-h", "vla-7b"]


def test_fleet_summary_cache_follows_new_steps_and_alerts(live_server: Any) -> None:
    spec = RunSpec(name="grow", family="vla-7b", world_size=4, steps=20, seed=3)
    rid = load(live_server, spec, step_hi=8)
    eng = live_server.state.engine
    assert reports.fleet_rows(eng)[0]["steps"] == 8
    load(live_server, spec, step_lo=8)
    row = reports.fleet_rows(eng)[0]
    assert row["steps"] == 20 and row["step_s_p50"] == pytest.approx(reports.run_summary(eng, rid)["step_s_p50"])
    add_alert(eng, run_id=rid, kind="step_time_shift", metric="step_s", first_bad={"run_id": rid, "step": 10})
    assert reports.fleet_rows(eng)[0]["alerts_firing"] == 1


def test_heatmap_is_reduced_server_side_exactly_and_says_by_how_much(live_server: Any) -> None:
    clear_cache()
    spec = RunSpec(name="big", family="llm-70b", world_size=64, steps=120, seed=4, straggler={37: 1.3})
    rid = load(live_server, spec, step_hi=60)
    eng = live_server.state.engine
    assert rank_heatmap(eng, rid, max_ranks=16, max_steps=50)["n_steps"] == 60
    load(live_server, spec, step_lo=60)  # the cached matrix is extended with the new steps only
    hm = rank_heatmap(eng, rid, field="work_s", how="max", max_ranks=16, max_steps=50)
    assert hm["n_steps"] == 120 and hm["n_ranks"] == 64 and hm["cells"] == 64 * 120
    assert hm["values"].shape == (16, 40) and hm["rank_factor"] == 4 and hm["step_factor"] == 3
    assert list(hm["step_lo"][:3]) == [0, 3, 6] and list(hm["rank_lo"][:2]) == [0, 4]
    steps, _, ref = rank_step_matrix(eng, rid, "work_s", step_hi=10**9)
    assert steps.size == 120
    expect = reduce_matrix(ref.T, max_rows=16, max_cols=50, how="max").values
    assert np.allclose(hm["values"], expect, rtol=1e-6)
    # the straggler's group of ranks is the slowest row in every column
    assert np.all(np.argmax(hm["values"], axis=0) == 37 // 4)
    raw = rank_heatmap(eng, rid, field="step_s", max_ranks=1000, max_steps=1000)
    assert raw["rank_factor"] == 1 and raw["step_factor"] == 1 and raw["values"].shape == (64, 120)


def test_rank_slowdown_names_the_straggler_rank_and_node(live_server: Any) -> None:
    slow = {r: 1.25 for r in range(8, 16)} | {20: 1.4}  # a slow node (node0001) and one slow rank on node0002
    rid = load(live_server, RunSpec(name="slow", family="llm-70b", world_size=32, steps=30, seed=5, straggler=slow))
    sd = rank_slowdown(live_server.state.engine, rid)
    assert int(np.nanargmax(sd["slowdown"])) == 20 and sd["slowdown"][20] == pytest.approx(1.4, rel=0.05)
    assert sd["node_of"][20] == "node0002"
    assert sd["nodes"][0]["node"] == "node0001" and sd["nodes"][0]["slowdown"] == pytest.approx(1.25, rel=0.05)
    assert np.nanmedian(sd["slowdown"][:8]) == pytest.approx(1.0, abs=0.02)
    assert sd["time_lost_s"] > 0


def test_run_series_are_reduced_with_spikes_kept_and_modalities_summed(live_server: Any) -> None:
    spec = RunSpec(name="mm", family="vla-7b", world_size=4, steps=120, seed=6)
    rid = load(live_server, spec, modalities=True, events=True)
    eng = live_server.state.engine
    ser = reports.run_series(eng, rid, max_points=10)
    raw = load_steps(eng, rid)
    assert ser["n_steps"] == 120 and ser["decomposition"]["factor"] == 12 and len(ser["decomposition"]["step"]) == 10
    assert ser["step_s_max"].factor > 1 and ser["step_s_max"].y.max() == pytest.approx(np.nanmax(raw["step_s_max"]))
    assert ser["step_s_max"].x[0] == 0 and ser["step_s_max"].x[-1] == 119
    assert np.nanmax(ser["mfu"].y) == pytest.approx(np.nanmax(raw["flops"] / (raw["n_ranks"] * raw["step_s"] * spec.peak_flops)))
    assert 0.8 < float(np.nanmedian(ser["packing"].y)) < 1.0
    assert ser["mem_peak_bytes"].y.max() == pytest.approx(np.nanmax(raw["mem_peak_bytes"]))
    mod = reports.modality_series(eng, rid, max_points=40)
    assert mod["factor"] == 3 and set(mod["tokens"]) == {"vision", "text", "action"}
    assert mod["totals"] == {"vision": 120 * 4 * 1000, "text": 120 * 4 * 2000, "action": 120 * 4 * 3000}
    ev = reports.run_events(eng, rid)
    assert [e["step"] for e in ev] == list(range(0, 120, 10)) and ev[0]["kind"] == "checkpoint"


def test_collective_efficiency_needs_a_declared_topology(live_server: Any) -> None:
    eng = live_server.state.engine
    plain = load(live_server, RunSpec(name="c1", family="vit-h", world_size=8, steps=4, seed=7))
    topo = {"gpus_per_node": 8, "intra_node_bytes_per_s": 450e9, "inter_node_bytes_per_s": 50e9}
    known = load(live_server, RunSpec(name="c2", family="vit-h", world_size=8, steps=4, seed=7), meta={"topology": topo})
    rows = reports.collectives_view(eng, plain)["rows"]
    assert rows and all(r["efficiency"] is None for r in rows)
    ar = [r for r in reports.collectives_view(eng, known)["rows"] if r["op"] == "all_reduce"]
    assert ar and all(r["efficiency"] == pytest.approx(r["busbw_bytes_per_s"] / 450e9) for r in ar)


def test_compare_normalises_and_diffs_the_config(live_server: Any) -> None:
    eng = live_server.state.engine
    a = load(live_server, RunSpec(name="x8", family="vla-7b", world_size=8, steps=10, seed=8))
    b = load(live_server, RunSpec(name="x16", family="vla-7b", world_size=16, steps=10, seed=9))
    v = reports.compare_view(eng, [b, a, 9999])
    assert [r["id"] for r in v["runs"]] == [b, a] and v["missing"] == [9999]
    m = v["metrics"][a]
    s = reports.run_summary(eng, a)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_s_per_gpu"], rel=1e-6)
    assert m["mfu"] == pytest.approx(s["mfu"], rel=1e-6)
    assert m["step_ms_per_1k_tokens"] == pytest.approx(1e6 / m["tokens_per_s_per_gpu"], rel=0.05)
    diff = {c["key"]: c for c in v["config"]}
    assert diff["global_batch_tokens"]["differs"] and not diff["bucket_mb"]["differs"]
    assert set(v["series"]) == {a, b} and v["series"][a].x.size == 10


def test_scaling_view_has_ideal_line_and_efficiency_per_configuration(live_server: Any) -> None:
    eng = live_server.state.engine
    for n in (8, 16, 32):
        load(live_server, RunSpec(name=f"s{n}", family="vit-h", world_size=n, steps=8, seed=n))
    v = reports.scaling_view(eng, "vit-h")
    assert len(v["configs"]) == 1
    pts = v["configs"][0]["points"]
    assert [p["world_size"] for p in pts] == [8, 16, 32] and pts[0]["efficiency"] == pytest.approx(1.0)
    assert pts[2]["ideal_tokens_per_s"] == pytest.approx(pts[0]["tokens_per_s"] * 4)
    assert all(0.5 < p["efficiency"] <= 1.05 for p in pts) and v["configs"][0]["mode"] == "weak"
    assert reports.scaling_view(eng, "nope")["configs"] == []


def test_alert_series_for_each_kind_of_alert(live_server: Any) -> None:
    eng = live_server.state.engine
    ids = [load(live_server, RunSpec(name=f"n{i}", family="vla-7b", world_size=4, steps=6, seed=i, start_ts=1.7e9 + i * 86400))
           for i in range(4)]
    rs = add_alert(eng, kind="run_series", run_id=ids[-1], before=9000.0, after=7000.0, change=-0.22,
                   first_bad={"run_id": ids[2], "index": 2}, details={"runs": ids, "values": [9e3, 9.1e3, 7e3, 7.1e3]})
    alerts = {a["id"]: a for a in reports.alerts_view(eng)}
    ser = reports.alert_series(eng, alerts[rs])
    assert ser["change_index"] == 2 and ser["y"][2] == 7e3 and ser["xlabel"] == "run start" and "n2" in ser["labels"][2]
    st = add_alert(eng, kind="step_time_shift", metric="step_s", run_id=ids[0], first_bad={"run_id": ids[0], "step": 3})
    ser = reports.alert_series(eng, next(a for a in reports.alerts_view(eng) if a["id"] == st))
    assert ser["change_x"] == 3 and ser["x"] == list(range(6))
    add_benchmarks(live_server)
    bench = reports.benchmarks_view(eng)
    assert len(bench) == 4 and all(len(s["value"]) == 6 for s in bench)
    sid = next(s["id"] for s in bench if s["name"] == "matmul_tflops")
    bk = add_alert(eng, kind="benchmark", metric="matmul_tflops", first_bad={"index": 4, "series_id": sid},
                   details={"series_id": sid, "unit": "TFLOP/s"})
    ser = reports.alert_series(eng, next(a for a in reports.alerts_view(eng) if a["id"] == bk))
    assert ser["change_index"] == 4 and ser["y"][4] == 640.0 and ser["unit"] == "TFLOP/s"
    assert [a["id"] for a in reports.alerts_view(eng, state="resolved")] == []
