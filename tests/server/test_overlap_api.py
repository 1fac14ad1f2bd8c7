"""``GET /api/v1/runs/{id}/overlap`` and the summary's ``overlap_advice`` through the real server: an
FSDP-like run ingested over the wire (3 ranks, all-gathers in forward and backward, reduce-scatters in
backward, a TP all-reduce in the optimizer) comes back placed against backward with the numbers it was
given; the default step is the representative one and its rank the median one; unknown steps and ranks
are 404; a run whose exposed communication is not a top bottleneck gets no advice."""

from __future__ import annotations

import statistics
from typing import Any

import httpx
import pytest

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
T0 = 1.7e9
#: per step: the median rank's extra other time (its step time = 0.111 + this): step 4's is the median
EXTRA = [0.19, 0.0, 0.002, 0.003, 0.005, 0.39, 0.29]
RANK_EXTRA = {0: -0.001, 1: 0.0, 2: 0.004}  # rank 1 has the median step time of every step
# (op, dim, group, bytes, issue s from the step start, total s, exposed s): forward all-gather waited for at
# once, forward 30 ms, backward from 40 ms with an exposed all-gather, reduce-scatters at 60 ms (hidden) and
# at 86 ms (waited for whole), optimizer from 98 ms with a TP all-reduce
COLLS = [("all_gather", "dp", 3, 6_000_000, 0.000, 0.010, 0.010), ("all_gather", "dp", 3, 6_000_000, 0.040, 0.006, 0.006),
         ("reduce_scatter", "dp", 3, 6_000_000, 0.060, 0.010, 0.0), ("reduce_scatter", "dp", 3, 6_000_000, 0.086, 0.012, 0.012),
         ("all_reduce", "tp", 3, 1000, 0.102, 0.001, 0.001)]


def _step_row(rank: int, step: int, *, exposed: float = 0.029, fwd: float = 0.030, bwd: float = 0.040) -> tuple:
    other = 0.002 + EXTRA[step] + RANK_EXTRA[rank]
    compute = fwd + bwd + 0.010
    vals = {"rank": rank, "step": step, "ts": T0 + 10 * step + rank * 1e-3, "step_s": compute + exposed + other,
            "data_s": 0.0, "compute_s": compute, "forward_s": fwd, "backward_s": bwd, "optimizer_s": 0.010,
            "comm_exposed_s": exposed, "comm_total_s": 0.039, "other_s": other, "mem_peak_bytes": 3_000_000_000}
    row: list[Any] = [None] * len(NAMES)
    for k, v in vals.items():
        row[NAMES.index(k)] = v
    return tuple(row)


def _fsdp_run(srv: Any) -> int:
    steps, colls = [], []
    for s in range(len(EXTRA)):
        for r in range(3):
            steps.append(_step_row(r, s))
            ts = T0 + 10 * s + r * 1e-3
            colls += [(r, s, i, op, n, b, 1, tot, exp, ts + t, dim) for i, (op, dim, n, b, t, tot, exp) in enumerate(COLLS)]
    with srv.client() as c:
        rid = c.register_run({"name": "fsdp-overlap", "model_family": "f", "world_size": 3})
        c.ingest_rows(rid, steps, colls)
    srv.compact()
    return rid


def test_overlap_endpoint_places_the_step_and_the_summary_advises(live_server: Any) -> None:
    rid = _fsdp_run(live_server)
    url = f"{live_server.url}/api/v1/runs/{rid}/overlap"
    d = httpx.get(url, timeout=30).json()
    assert d["run_id"] == rid and d["step"] == 4 and d["rank"] == 1  # the median step, its median rank
    assert d["step_s"] == pytest.approx(0.111 + 0.005, abs=1e-6)  # compute 80 + exposed 29 + other 2 + 5 ms
    assert d["backward"]["start_s"] == pytest.approx(0.040, abs=1e-6)
    assert d["backward"]["end_s"] == pytest.approx(0.086, abs=1e-6)
    assert d["backward"]["end"] == "last gradient reduction issued"
    got = [(c["op"], c["dim"], c["bytes"], c["phase"], c["gradient"]) for c in d["collectives"]]
    assert got == [("all_gather", "dp", 6e6, "before_backward", False), ("all_gather", "dp", 6e6, "backward", False),
                   ("reduce_scatter", "dp", 6e6, "backward", True), ("reduce_scatter", "dp", 6e6, "backward", True),
                   ("all_reduce", "tp", 1e3, "after_backward", False)]
    for c, (_op, _dim, _n, _b, t, tot, exp) in zip(d["collectives"], COLLS, strict=True):
        assert c["start_s"] == pytest.approx(t, abs=1e-6) and c["end_s"] == pytest.approx(t + tot, abs=1e-6)
        assert c["exposed_s"] == pytest.approx(exp, abs=1e-7) and c["calls"] == 1
    assert d["tail_s"] == pytest.approx(0.012, abs=1e-6)
    assert d["overlap_ratio"] == pytest.approx(1 - 0.029 / 0.039, abs=1e-5)
    assert d["backward_overlap_ratio"] == pytest.approx(1 - 0.018 / 0.028, abs=1e-5)
    assert d["comm_exposed_s"] == pytest.approx(sum(c["exposed_s"] for c in d["collectives"]), abs=1e-6)
    assert "estimated" in d["note"]

    # another step and rank on request; a rank with more other time (after the optimizer) places the same
    e = httpx.get(url, params={"step": 2, "rank": 2}, timeout=30).json()
    assert (e["step"], e["rank"]) == (2, 2)
    assert e["backward"]["end_s"] == pytest.approx(0.086, abs=1e-6) and e["tail_s"] == pytest.approx(0.012, abs=1e-6)
    for params, detail in (({"step": 99}, "step 99 has no records"), ({"step": 2, "rank": 7}, "rank 7 has no record")):
        r = httpx.get(url, params=params, timeout=30)
        assert r.status_code == 404 and detail in r.json()["detail"], r.text
    assert httpx.get(f"{live_server.url}/api/v1/runs/999999/overlap", timeout=30).status_code == 404
    assert httpx.get(url, params={"step": -1}, timeout=30).status_code == 422

    # the summary: exposed comm is 25 % of the step, so advice, biggest upper bound first, as shares of the
    # median step — over the steady-state steps: step 0 (2.7× the median) is set apart as warm-up, and the
    # median step is the median over the steps kept of each step's cross-rank median, as ingested
    s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary", timeout=30).json()
    assert [(x["reason"], x["steps"]) for x in s["basis"]["set_apart"]] == [("warm-up", [0])]
    apart = {st for x in s["basis"]["set_apart"] for st in x["steps"]}
    i_step = NAMES.index("step_s")
    steady = [statistics.median(_step_row(r, st)[i_step] for r in RANK_EXTRA) for st in range(len(EXTRA))
              if st not in apart]
    step_s = s["step_s_p50"]
    assert len(steady) == len(EXTRA) - 1 and step_s == pytest.approx(statistics.median(steady), abs=1e-6)
    adv = s["overlap_advice"]
    # the device's memory is not reported: backward prefetch, not unsharded parameters (their cost in the notes)
    assert [a["setting"] for a in adv] == ["fully_shard units", "set_modules_to_forward_prefetch",
                                           "set_modules_to_backward_prefetch"]
    assert [a["expected_gain_s"] for a in adv] == pytest.approx([0.012, 0.010, 0.006], abs=1e-6)
    assert [a["expected_gain_share"] for a in adv] == pytest.approx([0.012 / step_s, 0.010 / step_s, 0.006 / step_s],
                                                                    abs=1e-5)
    assert all(a["bound"] == "upper" and a["why"] and a["suggestion"] for a in adv)
    (note,) = [n for n in s["diagnosis"]["notes"] if n.startswith("not advised: reshard_after_forward")]
    assert "~4 MB more per rank" in note and "the peak is 3 GB" in note and "not reported" in note  # 6 MB × 2/3


def test_no_advice_where_exposed_comm_is_not_a_top_bottleneck(live_server: Any) -> None:
    steps, colls = [], []
    for s in range(len(EXTRA)):
        for r in range(3):
            # 2 ms exposed of a ~0.1 s step, compute and other bigger: comm is third and under 10 %
            steps.append(_step_row(r, s, exposed=0.002, fwd=0.030, bwd=0.060))
            ts = T0 + 10 * s + r * 1e-3
            colls += [(r, s, 0, "reduce_scatter", 3, 6_000_000, 1, 0.010, 0.0, ts + 0.04, "dp"),
                      (r, s, 1, "reduce_scatter", 3, 6_000_000, 1, 0.005, 0.002, ts + 0.09, "dp")]
    with live_server.client() as c:
        rid = c.register_run({"name": "compute-bound", "world_size": 3})
        c.ingest_rows(rid, steps, colls)
    live_server.compact()
    s = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary", timeout=30).json()
    assert "comm_exposed" not in [b["component"] for b in s["bottlenecks"]][:2]
    assert s["overlap_advice"] == []
    d = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/overlap", timeout=30).json()
    assert d["tail_s"] == pytest.approx(0.002, abs=1e-6)  # the endpoint still draws the step


def test_overlap_of_a_run_without_steps(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "empty", "world_size": 2})
    d = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/overlap", timeout=30).json()
    assert d["step"] is None and d["rank"] is None and d["collectives"] == [] and d["note"] == "no compacted steps yet"
