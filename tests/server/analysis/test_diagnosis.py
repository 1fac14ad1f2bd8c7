"""The run summary's ``diagnosis`` (server/analysis/diagnosis.py) through the real server: runs ingested over
the wire with known causes, each the regression case of a contradiction the advice producers used to make.

(a) a DDP job with a 16-byte all-gather during data loading (HF Trainer) gets no FSDP prefetch advice;
(b) a job whose exposed comm is an 8-byte broadcast waiting for a slow rank is ranked as straggler wait, with
    no bandwidth or bucketing advice anywhere;
(c) a simulated fleet with a straggler, whose data-parallel all-reduce exposes mostly the wait for it: straggler
    wait first, bandwidth-bound comm small, no bucketing advice;
(d) a bandwidth-bound DDP job (large gradient all-reduce exposed after backward) gets bucketing advice;
(e) an FSDP job with exposed all-gathers gets prefetch advice and no DDP advice.
Each also checks that the parts partition the median step (their sum is the step within 1 %)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fleetscope.server.analysis.bottlenecks import physical_ceiling
from fleetscope.server.analysis.diagnosis import (
    SYNC_BYTES,
    consistent_bottlenecks,
    consistent_overlap_advice,
    diagnose,
    job_pattern,
)
from fleetscope.server.store.rows import CollectiveRow

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
STEPS = 16  # enough for the straggler window (MIN_WINDOW_STEPS)
MB25 = 25 << 20
FSDP_SETTINGS = ("set_modules_to_forward_prefetch", "reshard_after_forward", "fully_shard units",
                 "set_modules_to_backward_prefetch")


def _row(rank: int, step: int, *, data: float, fwd: float, bwd: float, opt: float, other: float, exposed: float,
         total: float) -> tuple:
    compute = fwd + bwd + opt
    vals = {"rank": rank, "step": step, "ts": T0 + step, "step_s": data + compute + exposed + other, "data_s": data,
            "compute_s": compute, "forward_s": fwd, "backward_s": bwd, "optimizer_s": opt, "comm_exposed_s": exposed,
            "comm_total_s": total, "other_s": other, "mem_peak_bytes": 2_000_000_000}
    row: list[Any] = [None] * len(NAMES)
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


#: what the agent records of a DDP model whose 25 MiB buckets hold gradients of at most 4 MiB
DDP_FACTS = {"bucket_cap_bytes": MB25, "first_bucket_bytes": MB25, "gradient_as_bucket_view": False, "params": 40,
             "grad_bytes": 4 * MB25, "largest_grad_bytes": 4 << 20, "buckets_estimated": 4}


def _facts_event(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"rank": 0, "seq": 0, "kind": kind, "ts": T0, "step": None, "data": data}


def _ingest(srv: Any, name: str, ws: int, steps: list[tuple], colls: list[tuple],
            facts: dict[str, Any] | None = None) -> dict[str, Any]:
    with srv.client() as c:
        rid = c.register_run({"name": name, "model_family": "f", "world_size": ws})
        c.ingest_rows(rid, steps, colls, **({"events": [_facts_event("ddp", facts)]} if facts else {}))
    srv.compact()
    with srv.client() as c:
        return c.summary(rid)


def _parts(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    d = s["diagnosis"]
    assert d is not None
    total = sum(p["seconds"] for p in d["parts"])
    assert total == pytest.approx(d["step_s"], rel=0.01) and d["step_s"] == pytest.approx(s["step_s_p50"])
    assert d["sum_s"] == pytest.approx(total)
    shares = [p["share"] for p in d["parts"]]
    assert shares == sorted(shares, reverse=True)  # ranked
    for p in d["parts"]:
        assert p["seconds"] == pytest.approx(p["share"] * d["step_s"])
    return {p["cause"]: p for p in d["parts"]}


def _advice_text(s: dict[str, Any]) -> str:
    """Every piece of advice or finding the summary gives, as one lower-case text."""
    return json.dumps([s["diagnosis"]["advice"], s["overlap_advice"], [b["findings"] for b in s["bottlenecks"]],
                       [f["finding"] for f in s["parallel_findings"]]]).lower()


def _first_comm(parts: dict[str, dict[str, Any]]) -> str:
    return max((p for c, p in parts.items() if c not in ("compute", "data", "other")), key=lambda p: p["share"])["cause"]


# gradient buckets of 25 MiB in backward, 15 ms each one after the other: the last completes 15 ms after
# backward ends and the optimizer waits for it
def _buckets(r: int, s: int, t0: float, seq0: int, exposed_last: float = 0.015) -> list[tuple]:
    return [(r, s, seq0 + i, "all_reduce", 4, MB25, 1, 0.015, exposed_last if i == 3 else 0.0, T0 + s + t0 + 0.015 * i,
             "dp") for i in range(4)]


def test_a_ddp_job_with_a_tiny_all_gather_gets_no_fsdp_advice(live_server: Any) -> None:
    # HF Trainer: a 16-byte all-gather while the batch loads (waited for: 12 ms), then DDP's buckets
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s, data=0.005, fwd=0.030, bwd=0.060, opt=0.010, other=0.002, exposed=0.027, total=0.072))
            colls.append((r, s, 0, "all_gather", 4, 16, 1, 0.012, 0.012, T0 + s + 0.001, "dp"))
            colls += _buckets(r, s, 0.062, 1)  # the last issued when backward ends (107 ms)
    s = _ingest(live_server, "hf-ddp", 4, steps, colls, DDP_FACTS)
    parts = _parts(s)
    d = s["diagnosis"]
    assert d["pattern"] == {"ddp": True, "fsdp": False}
    # the 12 ms all-gather is a synchronisation, the 15 ms tail bandwidth-bound: each counted once
    step = d["step_s"]
    assert step == pytest.approx(0.134)
    assert parts["comm_sync"]["seconds"] == pytest.approx(0.012, rel=0.02)
    assert parts["comm_bandwidth"]["seconds"] == pytest.approx(0.015, rel=0.02)
    assert "straggler_wait" not in parts
    assert "all-gather in dp (16 B per call)" in " ".join(parts["comm_sync"]["evidence"])
    # must: DDP bucketing advice (bandwidth ranked, 11 %); must not: any FSDP advice, nor advice for the 9 %
    # synchronisation (under the 10 % a cause needs)
    causes = [a["cause"] for a in d["advice"]]
    assert "comm_bandwidth" in causes and "comm_sync" not in causes and "comm_sync" not in d["ranked_causes"]
    assert d["facts"]["ddp"]["largest_grad_bytes"] == 4 << 20
    assert [a["setting"] for a in s["overlap_advice"]] == ["bucket_cap_mb"]
    assert any(a.get("setting") == "bucket_cap_mb" for a in d["advice"])
    text = _advice_text(s)
    for bad in ("prefetch", "fully_shard", "reshard", "fsdp"):
        assert bad not in text, bad


def test_b_an_8_byte_broadcast_waiting_for_a_slow_rank_is_wait_not_bandwidth(live_server: Any) -> None:
    # Lightning: rank 3 computes 30 ms longer; the others wait for it in an 8-byte broadcast after the
    # optimizer (30.5 ms exposed; 0.5 ms its latency); DDP's buckets are hidden in backward
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            slow = 0.030 if r == 3 else 0.0
            bc = 0.0005 + (0.030 - slow)
            steps.append(_row(r, s, data=0.005, fwd=0.030, bwd=0.060 + slow, opt=0.010, other=0.002, exposed=bc,
                              total=0.060 + bc))
            colls += _buckets(r, s, 0.040 + slow, 0, exposed_last=0.0)
            colls.append((r, s, 4, "broadcast", 4, 8, 1, bc, bc, T0 + s + 0.107 + slow, None))
    s = _ingest(live_server, "lightning-skew", 4, steps, colls)
    parts = _parts(s)
    d = s["diagnosis"]
    step = d["step_s"]
    assert step == pytest.approx(0.1375)
    # must: straggler wait ranked (first after compute), rank 3 named; the broadcast's own time is sync
    assert _first_comm(parts) == "straggler_wait"
    assert parts["straggler_wait"]["seconds"] == pytest.approx(0.030, rel=0.02)
    assert parts.get("comm_bandwidth", {"seconds": 0.0})["seconds"] == pytest.approx(0.0, abs=1e-6)
    assert parts["comm_sync"]["seconds"] == pytest.approx(0.0005, rel=0.05)
    assert "straggler_wait" in d["ranked_causes"] and "comm_bandwidth" not in d["ranked_causes"]
    assert any(a["cause"] == "straggler_wait" and "rank 3" in a["text"] for a in d["advice"])
    # must not: bandwidth or bucketing advice anywhere, nor a parallel finding blaming bandwidth
    assert all(a["cause"] != "comm_bandwidth" for a in d["advice"])
    assert s["overlap_advice"] == []
    text = _advice_text(s)
    for bad in ("bucket", "prefetch", "nccl", "larger gradient"):
        assert bad not in text, bad
    (world,) = s["parallel_findings"]  # the broadcast names no dimension
    assert world["cause"] == "straggler_wait" and world["bandwidth_share"] == pytest.approx(0.0, abs=1e-6)
    assert "waiting for the slowest rank" in world["finding"] and world["share"] > 0.2  # the exposed share is kept


def test_c_simulated_straggler_fleet_ranks_the_wait_not_the_all_reduce(live_server: Any) -> None:
    spec = RunSpec(name="sim-straggler", family="llm-70b", world_size=16, steps=24, seed=7, straggler={5: 1.3})
    steps, colls = [], []
    for step, rows in rank_step_rows(spec):
        steps += rows
        colls += collective_rows(spec, step, rows)
    with live_server.client() as c:
        rid = c.register_run(spec.run_info())
        c.ingest_rows(rid, steps, colls)
    live_server.compact()
    with live_server.client() as c:
        s = c.summary(rid)
    parts = _parts(s)
    d = s["diagnosis"]
    # must: straggler wait ranked first of everything but compute, rank 5 named; bandwidth-bound comm small
    assert _first_comm(parts) == "straggler_wait"
    assert [p["cause"] for p in d["parts"] if p["cause"] != "compute"][0] == "straggler_wait"
    assert parts["straggler_wait"]["share"] > 0.15
    assert parts["comm_bandwidth"]["share"] < 0.05
    assert "comm_bandwidth" not in d["ranked_causes"]
    assert any(a["cause"] == "straggler_wait" and "rank 5" in a["text"] for a in d["advice"])
    # the data-parallel all-reduce exposes ~the wait: the finding says so, without bucketing advice
    dp = [f for f in s["parallel_findings"] if f["dim"] == "dp"]
    assert dp and dp[0]["share"] > 0.15 and dp[0]["bandwidth_share"] < 0.05 and dp[0]["cause"] == "straggler_wait"
    # must not: bucketing / bandwidth advice anywhere
    assert all(a["cause"] != "comm_bandwidth" for a in d["advice"])
    assert not any(a["setting"] in ("bucket_cap_mb", "gradient bytes") for a in s["overlap_advice"])
    text = _advice_text(s)
    for bad in ("bucket", "prefetch", "larger gradient"):
        assert bad not in text, bad
    assert any("not advised" in n for n in d["notes"]) or s["overlap_advice"] == []


def test_d_a_bandwidth_bound_ddp_job_gets_bucketing_advice(live_server: Any) -> None:
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s, data=0.005, fwd=0.030, bwd=0.060, opt=0.010, other=0.002, exposed=0.015, total=0.060))
            colls += _buckets(r, s, 0.050, 0)  # the last issued when backward ends (95 ms)
    s = _ingest(live_server, "ddp-bandwidth", 4, steps, colls, DDP_FACTS)
    parts = _parts(s)
    d = s["diagnosis"]
    assert d["pattern"] == {"ddp": True, "fsdp": False}
    assert _first_comm(parts) == "comm_bandwidth"
    assert parts["comm_bandwidth"]["seconds"] == pytest.approx(0.015, rel=0.02)
    assert "all-reduce in dp (25 MiB per call)" in " ".join(parts["comm_bandwidth"]["evidence"])
    # must: bucketing advice, in the diagnosis and in overlap_advice; must not: FSDP or straggler advice
    assert "comm_bandwidth" in d["ranked_causes"]
    assert [a["setting"] for a in s["overlap_advice"]] == ["bucket_cap_mb"]
    (adv,) = [a for a in d["advice"] if a["cause"] == "comm_bandwidth"]
    assert adv["setting"] == "bucket_cap_mb" and "bucket_cap_mb" in adv["text"] and "DDP" in adv["why"]
    assert all(a["cause"] != "straggler_wait" for a in d["advice"])
    text = _advice_text(s)
    for bad in ("prefetch", "fully_shard", "reshard"):
        assert bad not in text, bad


def test_e_an_fsdp_job_with_exposed_all_gathers_gets_prefetch_advice(live_server: Any) -> None:
    # forward all-gather waited for at once (10 ms), a backward one exposed (6 ms), reduce-scatters in backward
    # (the last one waited for whole: 12 ms)
    colls_of = [("all_gather", 0.000, 0.010, 0.010), ("all_gather", 0.040, 0.006, 0.006),
                ("reduce_scatter", 0.060, 0.010, 0.0), ("reduce_scatter", 0.086, 0.012, 0.012)]
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s, data=0.0, fwd=0.030, bwd=0.040, opt=0.010, other=0.002, exposed=0.028, total=0.038))
            colls += [(r, s, i, op, 4, 6_000_000, 1, tot, exp, T0 + s + t, "dp") for i, (op, t, tot, exp) in enumerate(colls_of)]
    s = _ingest(live_server, "fsdp-gathers", 4, steps, colls)
    parts = _parts(s)
    d = s["diagnosis"]
    assert d["pattern"] == {"ddp": False, "fsdp": True}
    assert parts["comm_bandwidth"]["seconds"] == pytest.approx(0.028, rel=0.02)
    settings = [a["setting"] for a in s["overlap_advice"]]
    # must: the prefetch advice (and the other FSDP ones); must not: DDP advice
    assert "set_modules_to_forward_prefetch" in settings and set(settings) <= set(FSDP_SETTINGS)
    assert any(a.get("setting") == "set_modules_to_forward_prefetch" for a in d["advice"])
    text = _advice_text(s)
    for bad in ("bucket_cap_mb", "bf16_compress_hook", "ddp bucket"):
        assert bad not in text, bad


def test_the_sync_threshold_and_the_order_the_wait_is_carved_in() -> None:
    def row(op: str, per_call: int, exposed: float, dim: str = "dp", calls: int = 10) -> CollectiveRow:
        return CollectiveRow(op, 8, max(per_call, 1).bit_length() - 1, calls, calls, float(per_call * calls), exposed,
                             exposed, dim)

    # 64 KiB per call is bandwidth; one byte less is a synchronisation
    shares = {"data": 0.1, "compute": 0.5, "other": 0.1, "comm_exposed": 0.2, "straggler_wait": 0.1}
    colls = [row("all_reduce", SYNC_BYTES, 2.0), row("all_reduce", SYNC_BYTES - 1, 1.0)]
    d = diagnose(step_s=2.0, shares=shares, colls=colls)
    assert d is not None
    parts = {p["cause"]: p["share"] for p in d["parts"]}
    # exposed 30 %: a third (10 %) in the small one, all of it the 10 % wait; the large one's 20 % bandwidth
    assert parts["straggler_wait"] == pytest.approx(0.1) and parts["comm_bandwidth"] == pytest.approx(0.2)
    assert "comm_sync" not in parts
    assert sum(p["seconds"] for p in d["parts"]) == pytest.approx(2.0)
    # a wait larger than the small collectives' time is taken out of the large ones next
    d = diagnose(step_s=2.0, shares={**shares, "comm_exposed": 0.1, "straggler_wait": 0.2}, colls=colls)
    assert d is not None
    parts = {p["cause"]: p["share"] for p in d["parts"]}
    assert parts["straggler_wait"] == pytest.approx(0.2) and parts["comm_bandwidth"] == pytest.approx(0.1)
    # small all-gathers say nothing about FSDP; large all-gathers + reduce-scatters do; TP all-reduces not DDP
    assert job_pattern([row("all_gather", 16, 1.0), row("all_reduce", 1 << 20, 1.0)])["fsdp"] is False
    assert job_pattern([row("all_gather", 1 << 20, 1.0), row("reduce_scatter", 1 << 20, 1.0)])["fsdp"] is True
    assert job_pattern([row("all_reduce", 1 << 20, 1.0, dim="tp")]) == {"ddp": False, "fsdp": False, "evidence": []}


# ------------------------------------------------------------------ issue 31: advice whose preconditions hold


def test_f_three_16_mib_gradients_get_no_smaller_bucket_advice(live_server: Any) -> None:
    # the job: three 16 MiB gradients, one per bucket, the last bucket's all-reduce left after backward
    mib16 = 16 << 20
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s, data=0.002, fwd=0.030, bwd=0.060, opt=0.010, other=0.002, exposed=0.020, total=0.060))
            colls += [(r, s, i, "all_reduce", 4, mib16, 1, 0.020, 0.020 if i == 2 else 0.0, T0 + s + 0.052 + 0.020 * i,
                       "dp") for i in range(3)]
    facts = {**DDP_FACTS, "largest_grad_bytes": mib16, "grad_bytes": 3 * mib16, "params": 3}
    s = _ingest(live_server, "ddp-16mib", 4, steps, colls, facts)
    parts = _parts(s)
    d = s["diagnosis"]
    assert _first_comm(parts) == "comm_bandwidth" and "comm_bandwidth" in d["ranked_causes"]
    text = _advice_text(s)
    # must not: a bucket size below the largest gradient tensor (DDP cannot split a parameter)
    assert "lower bucket_cap_mb" not in text and "about 8" not in text
    assert all(a.get("setting") != "bucket_cap_mb" for a in s["overlap_advice"] + d["advice"])
    # must: the reason in the notes, and the change that can act (fewer bytes / fewer syncs)
    assert any(n.startswith("not advised: bucket_cap_mb") and "cannot split one parameter" in n for n in d["notes"])
    (adv,) = [a for a in d["advice"] if a["cause"] == "comm_bandwidth"]
    assert adv["setting"] == "gradient bytes" and "bf16_compress_hook" in adv["text"]


def test_g_a_run_without_ddp_facts_gets_no_bucket_size_advice(live_server: Any) -> None:
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(4):
            steps.append(_row(r, s, data=0.005, fwd=0.030, bwd=0.060, opt=0.010, other=0.002, exposed=0.015, total=0.060))
            colls += _buckets(r, s, 0.050, 0)
    s = _ingest(live_server, "ddp-old-agent", 4, steps, colls)  # an older agent: no ``ddp`` event
    d = s["diagnosis"]
    assert d["facts"]["ddp"] is None and "comm_bandwidth" in d["ranked_causes"]
    assert all(a.get("setting") != "bucket_cap_mb" for a in s["overlap_advice"] + d["advice"])
    assert any("bucket_cap_mb" in n and "unknown" in n for n in d["notes"])


def test_h_one_slow_loader_of_two_ranks_is_one_cause_counted_once(live_server: Any) -> None:
    # rank 1 loads each batch 40 ms late; rank 0 waits for it in the gradient all-reduce
    steps, colls = [], []
    for s in range(STEPS):
        for r in range(2):
            data, exp = (0.040, 0.001) if r == 1 else (0.0, 0.041)
            steps.append(_row(r, s, data=data, fwd=0.030, bwd=0.060, opt=0.010, other=0.002, exposed=exp,
                              total=0.020 + exp))
            colls.append((r, s, 0, "all_reduce", 2, MB25, 1, 0.020 + exp, exp, T0 + s + data + 0.080, "dp"))
    s = _ingest(live_server, "one-slow-loader", 2, steps, colls, DDP_FACTS)
    parts = _parts(s)
    d = s["diagnosis"]
    step = d["step_s"]
    # must: data first, holding the 40 ms once (the median rank's 20 ms and the 20 ms the others wait); rank 1 named
    assert [p["cause"] for p in d["parts"]][0] == "compute" and d["parts"][1]["cause"] == "data"
    assert parts["data"]["seconds"] == pytest.approx(0.040, rel=0.05)
    assert parts.get("straggler_wait", {"seconds": 0.0})["seconds"] < 0.1 * 0.040
    assert "straggler_wait" not in d["ranked_causes"]
    assert step == pytest.approx(0.143, rel=0.02)
    (adv,) = [a for a in d["advice"] if a["cause"] == "data"]
    assert "rank 1" in adv["text"]
    assert any("rank 1" in e and "counted here once" in e for e in parts["data"]["evidence"])
    # must not: "most ranks" (one of two is not most), nor the same seconds again as waiting for the slowest rank
    text = _advice_text(s)
    assert "most ranks" not in text
    assert "waiting for the slowest rank" not in json.dumps(d["advice"]).lower()
    assert len(d["advice"]) <= len(d["ranked_causes"])
    # the all-reduce that holds the wait is not called bandwidth-bound: its time is rank 1's data
    (dp,) = [f for f in s["parallel_findings"] if f["dim"] == "dp"]
    assert dp["cause"] == "data" and dp["bandwidth_share"] < 0.05 and "data loading" in dp["finding"]


def test_i_a_pipeline_last_stage_is_compared_with_its_own_stage(live_server: Any) -> None:
    # two stages, one rank each: the last stage computes the head and the loss (30 ms more); stage 0 waits
    # for its gradients in a recv. Slower by design: no straggler, no "fix or replace rank 1"
    steps, colls, evs = [], [], []
    for s in range(STEPS):
        for r in range(2):
            bwd, exp = (0.090, 0.001) if r == 1 else (0.060, 0.031)
            steps.append(_row(r, s, data=0.002, fwd=0.030, bwd=bwd, opt=0.010, other=0.002, exposed=exp, total=exp + 0.002))
            op = "recv" if r == 0 else "send"
            colls.append((r, s, 0, op, 2, 4 << 20, 1, exp + 0.002, exp, T0 + s + 0.040, "pp"))
    for r in range(2):
        evs.append({"rank": r, "seq": 0, "kind": "pp_stage", "ts": T0, "step": None,
                    "data": {"stage": r, "num_stages": 2, "group_rank": r, "group_size": 2}})
    with live_server.client() as c:
        rid = c.register_run({"name": "pp-2", "model_family": "f", "world_size": 2})
        c.ingest_rows(rid, steps, colls, events=evs)
    live_server.compact()
    with live_server.client() as c:
        s = c.summary(rid)
    parts = _parts(s)
    d = s["diagnosis"]
    assert s["stragglers"] == []  # each rank alone in its stage: no peer to be slower than
    text = _advice_text(s)
    assert "fix or replace" not in text and "replace rank" not in text
    # must: the wait is the stages' imbalance (11 % of the step), and the advice balances the stages
    assert "straggler_wait" in d["ranked_causes"] and parts["straggler_wait"]["label"] == "waiting for the busiest pipeline stage"
    (adv,) = [a for a in d["advice"] if a["cause"] == "straggler_wait"]
    assert adv["text"].startswith("balance the pipeline stages: stage 1 works 134 ms per step against 104 ms for stage 0")
    assert any("compared with their own stage" in e for e in parts["straggler_wait"]["evidence"])


def test_j_advice_only_for_causes_worth_it_and_one_item_per_cause_and_kind() -> None:
    def row(op: str, per_call: int, exposed: float, dim: str = "dp", calls: int = 10) -> CollectiveRow:
        return CollectiveRow(op, 8, max(per_call, 1).bit_length() - 1, calls, calls, float(per_call * calls), exposed,
                             exposed, dim)

    # an 86 % bandwidth-bound cause beside 7 % data and 6 % other, each with a finding: only the 86 % gets advice
    shares = {"data": 0.07, "compute": 0.01, "other": 0.06, "comm_exposed": 0.86, "straggler_wait": 0.0}
    comps = [{"component": "data", "findings": ["input pipeline stalls: 7 % of the step waits for data on most ranks"]},
             {"component": "other", "findings": ["allocator retries: 3"]}]
    items = [{"setting": "bucket_cap_mb", "suggestion": "raise bucket_cap_mb to about 100", "expected_gain_s": 0.5,
              "expected_gain_share": 0.5, "why": "w"},
             {"setting": "gradient bytes", "suggestion": "compress", "expected_gain_s": 0.03,
              "expected_gain_share": 0.03, "why": "w"}]
    d = diagnose(step_s=1.0, shares=shares, colls=[row("all_reduce", 1 << 24, 1.0)], bottlenecks=comps,
                 overlap_items=items)
    assert d is not None
    assert d["ranked_causes"] == ["comm_bandwidth"]
    assert [(a["cause"], a.get("setting")) for a in d["advice"]] == [("comm_bandwidth", "bucket_cap_mb")]
    assert any("≥ 10 %" in n for n in d["notes"])
    # ceilings: only for the ranked cause within 10–90 %; compute never (92 % compute: no 13.88×)
    by = {p["cause"]: p for p in d["parts"]}
    assert by["comm_bandwidth"]["max_speedup"] == pytest.approx(1 / (1 - 0.86))
    assert by["data"]["max_speedup"] is None and by["compute"]["max_speedup"] is None
    d2 = diagnose(step_s=1.0, shares={"data": 0.02, "compute": 0.928, "other": 0.002, "comm_exposed": 0.05,
                                      "straggler_wait": 0.0}, colls=[row("all_reduce", 1 << 24, 1.0)])
    assert d2 is not None and d2["ranked_causes"] == [] and d2["advice"] == []
    assert all(p["max_speedup"] is None for p in d2["parts"])
    comps2 = [{"component": "compute", "share": 0.928, "max_speedup": 13.88, "finding": "x", "findings": []},
              {"component": "comm_exposed", "share": 0.05, "max_speedup": 1.05, "finding": "y", "findings": []}]
    assert all(c["max_speedup"] is None for c in consistent_bottlenecks(comps2, d2))
    assert physical_ceiling("compute", 0.5) is None and physical_ceiling("data", 0.9954) is None
    assert physical_ceiling("data", 0.5) == pytest.approx(2.0) and physical_ceiling("data", 0.06) is None
    # FSDP: a second kind of change for one cause only when it can remove ≥ 5 % of the step
    fsdp_colls = [row("all_gather", 1 << 22, 1.0), row("reduce_scatter", 1 << 22, 1.0)]
    items = [{"setting": "set_modules_to_forward_prefetch", "suggestion": "prefetch", "expected_gain_s": 0.2,
              "expected_gain_share": 0.2, "why": "w"},
             {"setting": "reshard_after_forward", "suggestion": "reshard", "expected_gain_s": 0.03,
              "expected_gain_share": 0.03, "why": "w"},
             {"setting": "fully_shard units", "suggestion": "units", "expected_gain_s": 0.06,
              "expected_gain_share": 0.06, "why": "w"}]
    d3 = diagnose(step_s=1.0, shares={**shares, "comm_exposed": 0.5, "compute": 0.37}, colls=fsdp_colls,
                  overlap_items=items)
    assert d3 is not None
    assert [a.get("setting") for a in d3["advice"]] == ["set_modules_to_forward_prefetch", "fully_shard units"]
    assert [a["setting"] for a in consistent_overlap_advice(items, d3)] == ["set_modules_to_forward_prefetch",
                                                                            "fully_shard units"]
    assert any(n.startswith("not advised: reshard_after_forward") for n in d3["notes"])
    # one item per cause and kind: of two data findings only the first (the most specific) is advice
    d4 = diagnose(step_s=1.0, shares={"data": 0.4, "compute": 0.5, "other": 0.05, "comm_exposed": 0.05,
                                      "straggler_wait": 0.0}, colls=[],
                  bottlenecks=[{"component": "data", "findings": ["data stalls on some ranks only: rank 3", "more"]}])
    assert d4 is not None and [a["text"] for a in d4["advice"]] == ["data stalls on some ranks only: rank 3"]


def test_k_a_slow_rank_within_its_pipeline_stage_is_still_named(live_server: Any) -> None:
    # stages 0 (ranks 0, 1) and 1 (ranks 2, 3): stage 1 is slower by design; rank 3 is 30 % slower than rank 2
    steps, colls, evs = [], [], []
    bwd_of = {0: 0.060, 1: 0.060, 2: 0.090, 3: 0.117}
    for s in range(STEPS):
        for r in range(4):
            exp = 0.118 - bwd_of[r] + 0.001
            steps.append(_row(r, s, data=0.002, fwd=0.030, bwd=bwd_of[r], opt=0.010, other=0.002, exposed=exp,
                              total=exp + 0.002))
            colls.append((r, s, 0, "recv" if r < 2 else "send", 2, 4 << 20, 1, exp + 0.002, exp, T0 + s + 0.040, "pp"))
    for r in range(4):
        evs.append({"rank": r, "seq": 0, "kind": "pp_stage", "ts": T0, "step": None,
                    "data": {"stage": r // 2, "num_stages": 2, "group_rank": r // 2, "group_size": 2}})
    with live_server.client() as c:
        rid = c.register_run({"name": "pp-4", "model_family": "f", "world_size": 4})
        c.ingest_rows(rid, steps, colls, events=evs)
    live_server.compact()
    with live_server.client() as c:
        s = c.summary(rid)
    # rank 3 against rank 2 (its stage), not against stage 0: named; rank 2 (slower than stage 0) is not
    assert [x["rank"] for x in s["stragglers"]] == [3]
    assert s["stragglers"][0]["slowdown"] == pytest.approx((0.030 + 0.117 + 0.014) / (0.030 + 0.090 + 0.014), rel=0.05)


def test_l_small_syncs_that_are_a_tiny_models_gradient_buckets_say_so() -> None:
    rows = [CollectiveRow("all_reduce", 2, 12, 80, 80, 80 * 4352.0, 1.0, 1.0, "dp")]  # 4.25 KiB per call
    shares = {"data": 0.05, "compute": 0.6, "other": 0.05, "comm_exposed": 0.3, "straggler_wait": 0.0}
    tiny = {"ddp": {"grad_bytes": 4352, "buckets_estimated": 1, "largest_grad_bytes": 4096}}
    d = diagnose(step_s=0.1, shares=shares, colls=rows, facts=tiny)
    assert d is not None and d["ranked_causes"] == ["comm_sync"]
    (adv,) = d["advice"]
    assert "DDP's own gradient buckets are among them" in adv["text"] and "no_sync" in adv["text"]
    big = {"ddp": {"grad_bytes": 4 * MB25, "buckets_estimated": 4, "largest_grad_bytes": 4 << 20}}
    d = diagnose(step_s=0.1, shares=shares, colls=rows, facts=big)
    assert d is not None and "gradient buckets" not in d["advice"][0]["text"]


def _simulated_summary(live_server: Any, run: str, *args: str) -> dict[str, Any]:
    """A run sent by ``fleetscope simulate`` (its default model: the family's own parallelism, collectives in
    their place), its summary."""
    from typer.testing import CliRunner

    from fleetscope.cli import app

    out = CliRunner().invoke(app, ["simulate", "--server", live_server.url, "--token", live_server.token, "--run", run,
                                   "--steps", "16", *args])
    assert out.exit_code == 0, out.output
    live_server.compact()
    (r,) = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": f"eq:{run}"}, timeout=60).json()["runs"]
    # the gradient all-reduces are issued during backward (the last one as it ends), not at the step's start
    ov = httpx.get(f"{live_server.url}/api/v1/runs/{r['id']}/overlap", timeout=60).json()
    grads = [c for c in ov["collectives"] if c["gradient"]]
    assert grads and all(c["phase"] == "backward" for c in grads), ov["collectives"]
    with live_server.client() as c:
        return c.summary(r["id"])


def test_m_simulated_ddp_runs_send_their_facts_and_bucket_advice_follows_them(live_server: Any) -> None:
    # vit-h trains with DDP; a fifth of its batch per step, and bucket_cap_mb=1000: two buckets, the last one's
    # all-reduce (~27 ms) left after backward. Its tensors are 12.5 MiB: a smaller cap is possible and advised
    common = ["--family", "vit-h", "--ranks", "16", "--seed", "3", "--shift", "compute_s=0.2,data_s=0.2,other_s=0.2",
              "--bucket-mb", "1000"]
    s = _simulated_summary(live_server, "ddp-big-cap", *common)
    facts = s["diagnosis"]["facts"]["ddp"]
    assert facts["bucket_cap_bytes"] == 1000 << 20 and facts["largest_grad_bytes"] < 13 << 20
    colls = [a for a in s["overlap_advice"] if a["setting"] == "bucket_cap_mb"]
    assert colls and colls[0]["suggestion"].startswith("lower bucket_cap_mb to about "), s["overlap_advice"]
    assert "now bucket_cap_mb = 1000" in colls[0]["suggestion"]
    assert not any("unknown" in n for n in s["diagnosis"]["notes"]), s["diagnosis"]["notes"]
    # the same job whose largest tensor (600 MiB) exceeds the cap the advice would propose: withheld
    s = _simulated_summary(live_server, "ddp-big-tensor", "--largest-grad-mb", "600", *common)
    assert s["diagnosis"]["facts"]["ddp"]["largest_grad_bytes"] == 600 << 20
    assert not any(a["setting"] == "bucket_cap_mb" for a in s["overlap_advice"]), s["overlap_advice"]
    assert any("not advised: bucket_cap_mb" in n and "600 MiB" in n and "cannot split one parameter" in n
               for n in s["diagnosis"]["notes"]), s["diagnosis"]["notes"]


def test_n_fsdp_advice_never_keeps_parameters_unsharded_beyond_the_device_memory(live_server: Any) -> None:
    from fleetscope.demo import fleet_history, load_history
    from fleetscope.synthetic import DEVICE_MEMORY, RunSpec

    # the demo's llm-70b runs (70B on FSDP, 80 units, a 70 GB peak on 80 GB at 32 ranks), and the same model
    # over NCCL's socket transport, so that backward cannot hide its all-gathers: at 32 ranks one more
    # unsharded unit fits beside the peak (removing 1/80 of the wait: not worth it); at 256 ranks (states
    # sharded further) some do, never all 80
    demo = [s for s in fleet_history(small=True) if s.family == "llm-70b"]
    tight = RunSpec(name="llm-70b-socket-32", family="llm-70b", world_size=32, steps=16, seed=5, comm_bound=True,
                    start_ts=demo[0].start_ts, realistic=True)
    roomy = RunSpec(name="llm-70b-socket-256", family="llm-70b", world_size=256, steps=16, seed=6, comm_bound=True,
                    start_ts=demo[0].start_ts, realistic=True)
    specs = [*demo, tight, roomy]
    with live_server.client() as c:
        load_history(c, specs)
    live_server.compact()
    runs = {r["name"]: r for r in httpx.get(f"{live_server.url}/api/v1/runs", params={"limit": 100},
                                            timeout=60).json()["runs"]}
    summaries = {}
    with live_server.client() as c:
        for spec in specs:
            s = summaries[spec.name] = c.summary(runs[spec.name]["id"])
            d = s["diagnosis"]
            assert d["facts"]["fsdp"]["units"] == 80  # the simulated units: FSDP advice is not "unknown"
            peak, total = s["mem_peak_bytes"], DEVICE_MEMORY[spec.gpu]
            unit = 2 * 70e9 / 80 * (spec.world_size - 1) / spec.world_size
            for a in s["overlap_advice"]:
                if a["setting"] == "reshard_after_forward":
                    # only as many units as fit beside the measured peak, never the whole 140 GB model
                    assert "at most " in a["suggestion"], (spec.name, a)
                    k = int(a["suggestion"].split("at most ")[1].split(" ")[0])
                    assert 1 <= k < 80 and peak + k * unit <= 0.9 * total, (spec.name, a)
            text = " ".join(str(a.get("text")) for a in d["advice"]) + " ".join(
                str(a["suggestion"]) for a in s["overlap_advice"])
            if peak + 2 * unit > 0.9 * total:  # at most one unit fits (< 1 % of the step): not proposed
                assert "reshard_after_forward=False" not in text, (spec.name, text)
    # the tight run: backward prefetch instead, and the note says what resharding would cost and why not
    s = summaries["llm-70b-socket-32"]
    assert s["mem_peak_bytes"] + 2 * 2 * 70e9 / 80 > 0.9 * DEVICE_MEMORY["H100"]  # two more units do not fit
    assert "set_modules_to_backward_prefetch" in [a["setting"] for a in s["overlap_advice"]], s["overlap_advice"]
    assert "reshard_after_forward" not in [a["setting"] for a in s["overlap_advice"]]
    (note,) = [n for n in s["diagnosis"]["notes"] if n.startswith("not advised: reshard_after_forward")]
    assert "136 GB more per rank" in note and "for 1 of them only" in note, note
    # the roomy run: resharding kept off for only as many blocks as fit beside its 39 GB peak
    (a,) = [a for a in summaries["llm-70b-socket-256"]["overlap_advice"] if a["setting"] == "reshard_after_forward"]
    assert "reshard_after_forward=False) for at most" in a["suggestion"] and "do not fit" in a["why"], a
