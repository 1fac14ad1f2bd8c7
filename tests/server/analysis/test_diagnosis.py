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

import pytest
from fleetscope.server.analysis.diagnosis import SYNC_BYTES, diagnose, job_pattern
from fleetscope.server.store.rows import CollectiveRow

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
STEPS = 16  # enough for the straggler window (MIN_WINDOW_STEPS)
MB25 = 25 << 20
FSDP_SETTINGS = ("set_modules_to_forward_prefetch", "reshard_after_forward", "fully_shard units")


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


def _ingest(srv: Any, name: str, ws: int, steps: list[tuple], colls: list[tuple]) -> dict[str, Any]:
    with srv.client() as c:
        rid = c.register_run({"name": name, "model_family": "f", "world_size": ws})
        c.ingest_rows(rid, steps, colls)
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
    s = _ingest(live_server, "hf-ddp", 4, steps, colls)
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
    # must: DDP bucketing advice (bandwidth ranked), a sync finding; must not: any FSDP advice
    causes = [a["cause"] for a in d["advice"]]
    assert "comm_bandwidth" in causes and "comm_sync" in causes
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
    s = _ingest(live_server, "ddp-bandwidth", 4, steps, colls)
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
