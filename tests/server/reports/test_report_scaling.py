"""Scaling, cross-run comparison, collective efficiency and goodput on runs with known answers."""

from __future__ import annotations

from typing import Any

import pytest
from analysis_util import field_index, load, with_fields
from fleetscope.server.reports import collective_efficiency, compare_runs, scaling
from fleetscope.server.reports import goodput as run_goodput

from fleetscope.synthetic import RunSpec


def test_weak_scaling_efficiency_and_the_component_that_grows(live_server: Any) -> None:
    for n in (8, 16, 32, 64):
        load(live_server, RunSpec(name=f"s{n}", family="vla-7b", world_size=n, steps=5, seed=n), collectives=False)
    load(live_server, RunSpec(name="other-config", family="vla-7b", world_size=16, steps=5, comm_bound=True),
         collectives=False)
    out = scaling(live_server.state.engine, family="vla-7b")
    main = next(g for g in out["groups"] if len(g["points"]) == 4)
    assert len(out["groups"]) == 2  # the comm-bound config is its own curve
    assert main["mode"] == "weak" and main["n0"] == 8 and [p["world_size"] for p in main["points"]] == [8, 16, 32, 64]
    eff = [p["efficiency"] for p in main["points"]]
    assert eff[0] == pytest.approx(1.0) and eff[-1] < eff[0] and all(0.3 < e <= 1.001 for e in eff)
    p64 = main["points"][-1]
    assert p64["efficiency"] == pytest.approx(
        (p64["throughput_tokens_per_s"] / 64) / (main["points"][0]["throughput_tokens_per_s"] / 8))
    assert p64["ideal_throughput_tokens_per_s"] == pytest.approx(main["points"][0]["throughput_tokens_per_s"] * 8)
    assert main["growing_component"]["component"] == "comm_exposed"


def test_compare_runs_in_normalised_units_with_the_config_diff(live_server: Any) -> None:
    a = load(live_server, RunSpec(name="a", family="vla-7b", world_size=8, steps=4), collectives=False)
    b = load(live_server, RunSpec(name="b", family="vit-h", world_size=16, steps=4, comm_bound=True),
             collectives=False)
    out = compare_runs(live_server.state.engine, [a, b, 999])
    ra, rb = out["runs"]
    assert out["missing"] == [999] and ra["id"] == a and rb["id"] == b
    for r in (ra, rb):
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["mfu"] < 1
        assert r["step_s_per_1k_tokens"] == pytest.approx(1000 / r["tokens_per_s_per_gpu"], rel=0.05)
    assert out["relative_to_first"]["mfu"][0] == 1.0
    assert out["relative_to_first"]["tokens_per_s_per_gpu"][1] == pytest.approx(
        rb["tokens_per_s_per_gpu"] / ra["tokens_per_s_per_gpu"])
    assert {"model_family", "world_size", "overlap", "bucket_mb"} <= set(out["config_diff"])


def test_collective_efficiency_uses_the_declared_topology_or_says_unknown(live_server: Any) -> None:
    topo = {"gpus_per_node": 8, "nvlink_GBps": 450, "nic_Gbps": 400}
    rid = load(live_server, RunSpec(name="topo", family="vit-h", world_size=16, steps=3),
               meta={"topology": topo, "flops_source": "estimated"})
    small = load(live_server, RunSpec(name="intra", family="vit-h", world_size=8, steps=3),
                 meta={"topology": topo})
    bare = load(live_server, RunSpec(name="bare", family="vit-h", world_size=8, steps=3))
    eng = live_server.state.engine
    e = collective_efficiency(eng, rid)
    ar = [c for c in e["collectives"] if c["op"] == "all_reduce"]
    assert ar and all(c["link"] == "nic" and c["link_peak_bytes_per_s"] == 50e9 for c in ar)
    assert all(c["efficiency"] == pytest.approx(c["busbw_bytes_per_s"] / 50e9) for c in ar)
    assert e["efficiency_large_messages"] is not None and e["note"] is None
    assert not any(c["op"] == "barrier" for c in e["collectives"])
    intra = collective_efficiency(eng, small)["collectives"]
    assert all(c["link"] == "nvlink" and c["link_peak_bytes_per_s"] == 450e9 for c in intra)
    b = collective_efficiency(eng, bare)
    assert all(c["efficiency"] is None and c["link"] == "unknown" for c in b["collectives"]) and "unknown" in b["note"]


def test_goodput_splits_badput_by_cause(live_server: Any) -> None:
    spec = RunSpec(name="gp", family="vit-h", world_size=4, steps=40, step_ms=500, start_ts=1.7e9)
    i_ts = field_index("ts")

    def pauses(step: int, rows: list[tuple]) -> list[tuple]:
        # a 4 s checkpoint before step 10, a 3 s evaluation before step 20: steps start later
        shift = 4.0 * (step >= 10) + 3.0 * (step >= 20)
        return [with_fields(r, ts=r[i_ts] + shift) for r in rows]

    t0 = spec.start_ts
    t10 = t0 + 10 * 0.5  # about when step 10 would have started
    events = [
        {"rank": 0, "seq": 0, "kind": "checkpoint", "ts": t10, "step": 10, "data": {"duration_s": 4.0}},
        {"rank": 0, "seq": 1, "kind": "eval", "ts": t10 + 9.0, "step": 20, "data": {"duration_s": 3.0}},
        # the job failed 1 s after the checkpoint completed and restarted from it
        {"rank": 0, "seq": 2, "kind": "restart", "ts": t10 + 5.0, "step": 12, "data": {}},
    ]
    rid = load(live_server, spec, transform=pauses, events=events, started_at=t0 - 30)
    g = run_goodput(live_server.state.engine, rid)
    bp = g["badput"]
    assert bp["init_s"] == pytest.approx(30, abs=0.1)
    assert bp["checkpoint_s"] == 4.0 and bp["eval_s"] == 3.0 and bp["restart_s"] == pytest.approx(1.0)
    assert 0 < bp["data_stall_s"] < 1 and g["overlap_s"] == 0
    assert g["productive_s"] + sum(bp.values()) == pytest.approx(g["wall_s"], rel=1e-6)
    assert 0.2 < g["goodput"] < 0.5 and g["estimated"] is False and g["events"]["restart"] == 1
