"""The steady-state rule (server/analysis/steady.py): which steps are set apart, why, and what stays in."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.server.analysis.goodput import goodput, with_set_apart
from fleetscope.server.analysis.steady import (
    MAX_LISTED_STEPS,
    RULE,
    set_apart_excess,
    steady_basis,
)
from fleetscope.server.store.rows import StepFrame


def _steps(n: int, base: float = 0.1, noise: float = 0.002, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.arange(n, dtype=np.int64), base + rng.uniform(-noise, noise, n)


def _reasons(b: object) -> dict[str, list[int]]:
    return {r["reason"]: r["steps"] for r in b.as_dict()["set_apart"]}  # type: ignore[attr-defined]


def test_two_long_compile_steps_are_set_apart_by_their_events_and_counted_in_seconds() -> None:
    steps, t = _steps(30)
    t[0] += 8.0
    t[1] += 3.3
    ev = [("compile", 1.7e9, 0, {"duration_s": 8.0}), ("compile", 1.7e9 + 9, 1, None)]
    b = steady_basis(steps, t, events=ev)
    d = b.as_dict()
    assert d["steps"] == 28 and d["of"] == 30
    assert d["set_apart"] == [{"reason": "compile", "steps": [0, 1], "n": 2, "seconds": pytest.approx(t[0] + t[1])}]
    assert d["rule"] == RULE and d["fallback"] is None
    assert b.kept.tolist() == list(range(2, 30))


def test_unmarked_warm_up_steps_are_found_by_the_rule_and_called_warm_up() -> None:
    steps, t = _steps(30)
    t[0] += 1.0
    t[1] += 1.0
    t[2] += 0.06  # 1.6× the median: still warming up, right after the others
    t[20] += 0.05  # the same excess later in the run is no outlier (below 3× the median)
    b = steady_basis(steps, t)
    assert _reasons(b) == {"warm-up": [0, 1, 2]}
    assert 20 in b.kept


def test_a_first_step_at_the_steady_pace_is_kept_and_short_runs_set_nothing_apart() -> None:
    steps, t = _steps(10)
    assert _reasons(steady_basis(steps, t)) == {}
    t[0] *= 1.4  # slower, but below 1.5× the median: kept
    assert _reasons(steady_basis(steps, t)) == {}
    t[0] = 0.2
    assert _reasons(steady_basis(steps, t)) == {"warm-up": [0]}
    steps2, t2 = _steps(2)
    t2[0] += 5.0
    b = steady_basis(steps2, t2)
    assert b.kept.tolist() == [0, 1] and not b.set_apart


def test_a_rare_spike_is_an_outlier_but_a_recurring_slow_step_is_the_steady_state() -> None:
    steps, t = _steps(100)
    t[50] = 0.9  # one 9× step mid-run: a hiccup
    b = steady_basis(steps, t)
    assert _reasons(b) == {"outlier": [50]}
    # a loader that stalls every fourth step for 3× the step: the job's steady state, kept
    steps2, t2 = _steps(100)
    t2[3::4] = 0.45
    b2 = steady_basis(steps2, t2)
    assert _reasons(b2) == {}
    assert set(range(3, 100, 4)) <= set(b2.kept.tolist())


def test_checkpoint_eval_and_restart_events_mark_their_steps_by_step_or_timestamp() -> None:
    steps, t = _steps(40)
    ts = 1.7e9 + np.cumsum(np.r_[0.0, t[:-1]])
    ev = [
        ("checkpoint_save", float(ts[10] + 0.01), None, {"duration_s": 2.0}),  # no step: by its timestamp
        ("eval", None, 20, {"duration_s": 1.0}),
        ("restart", float(ts[29] + 0.05), None, None),  # the first step starting after it is warm-up
        ("graph_break", None, 5, None),  # not a marking kind
    ]
    t[10] += 2.0
    t[20] += 1.0
    t[30] += 0.5
    b = steady_basis(steps, t, ts=ts, events=ev)
    assert _reasons(b) == {"checkpoint": [10], "eval": [20], "warm-up": [30]}
    assert 5 in b.kept


def test_a_slow_step_after_a_compiled_first_step_is_warm_up_too() -> None:
    steps, t = _steps(20)
    t[0] += 4.0
    t[1] += 0.5
    b = steady_basis(steps, t, events=[("compile", None, 0, None)])
    assert _reasons(b) == {"compile": [0], "warm-up": [1]}


def test_a_step_with_two_reasons_takes_the_most_specific_one() -> None:
    steps, t = _steps(20)
    t[0] += 4.0
    b = steady_basis(steps, t, events=[("compile", None, 0, None), ("checkpoint_load", None, 0, None)])
    assert _reasons(b) == {"compile": [0]}


def test_when_most_steps_are_marked_every_step_is_kept_and_the_basis_says_why() -> None:
    steps, t = _steps(10)
    ev = [("compile", None, int(s), None) for s in range(7)]  # recompiles every step
    b = steady_basis(steps, t, events=ev)
    d = b.as_dict()
    assert d["steps"] == d["of"] == 10 and d["set_apart"] == []
    assert "no steady state" in d["fallback"]


def test_listed_steps_are_bounded_but_counted() -> None:
    steps, t = _steps(1000)
    ev = [("eval", None, int(s), None) for s in range(1, 400, 2)]  # 200 eval steps
    d = steady_basis(steps, t, events=ev).as_dict()
    (e,) = [x for x in d["set_apart"] if x["reason"] == "eval"]
    assert e["n"] == 200 and len(e["steps"]) == MAX_LISTED_STEPS


def test_set_apart_excess_is_what_those_steps_took_beyond_a_steady_step_outside_data_wait() -> None:
    steps, t = _steps(20, noise=0.0)
    data = np.full(20, 0.02)
    t[0] += 5.0  # compile
    t[1] += 1.0
    data[1] += 1.0  # a loader warming up: data wait, already a data stall in goodput
    t[2] += 2.0  # checkpoint: its event's duration is already lost time
    b = steady_basis(steps, t, events=[("compile", None, 0, None), ("checkpoint", None, 2, None)])
    ex = set_apart_excess(b, steps, t, data)
    assert ex == {"compile": pytest.approx(5.0), "warmup_outlier": pytest.approx(0.0)}


def test_goodput_moves_set_apart_time_from_productive_to_lost() -> None:
    steps, t = _steps(10, noise=0.0)
    ts = 1.7e9 + np.arange(10) * 1.0
    t[0] += 0.5
    frame = StepFrame({"step": steps.astype(float), "ts": ts, "step_s": t, "data_s": np.zeros(10)})
    plain = goodput(1, 1.7e9, None, frame, [])
    g = goodput(1, 1.7e9, None, frame, [], set_apart_s={"compile": 0.5, "warmup_outlier": 0.1})
    assert g["badput"]["compile_steps_s"] == pytest.approx(0.5)
    assert g["badput"]["warmup_outlier_steps_s"] == pytest.approx(0.1)
    assert g["productive_s"] == pytest.approx(plain["productive_s"] - 0.6)
    assert g["wall_s"] == pytest.approx(plain["wall_s"])
    summary = {"wall_s": 10.0, "productive_s": 6.0, "fraction": 0.6, "lost": {"data_stall": 4.0}}
    s = with_set_apart(summary, {"warmup_outlier": 1.5})
    assert s is not None
    assert s["productive_s"] == pytest.approx(4.5) and s["fraction"] == pytest.approx(0.45)
    assert s["lost"] == {"data_stall": 4.0, "compile_steps": 0.0, "warmup_outlier_steps": 1.5}
    assert with_set_apart(None, {"compile": 1.0}) is None


# ------------------------------------------------------------------ through the real server

def _row(rank: int, step: int, ts: float, *, data: float, fwd: float, bwd: float, opt: float, other: float,
         exposed: float, total: float) -> tuple:
    from fleetscope.wire import RANK_STEP_FIELDS

    names = [f.name for f in RANK_STEP_FIELDS]
    compute = fwd + bwd + opt
    vals = {"rank": rank, "step": step, "ts": ts, "step_s": data + compute + exposed + other, "data_s": data,
            "compute_s": compute, "forward_s": fwd, "backward_s": bwd, "optimizer_s": opt, "comm_exposed_s": exposed,
            "comm_total_s": total, "other_s": other, "tokens": 4096, "flops": 2e12, "mem_peak_bytes": 2_000_000_000}
    row: list[object] = [None] * len(names)
    for k, v in vals.items():
        row[names.index(k)] = v
    return tuple(row)


def _job(warm: tuple[float, ...], seed: int = 3) -> tuple[list[tuple], list[tuple]]:
    """A 4-rank DDP job whose exposed gradient all-reduce is the largest part of its 30 steady steps,
    after ``warm`` extra seconds of compute in its first steps (compilation)."""
    rng = np.random.default_rng(seed)
    rows, colls = [], []
    t = 1.7e9
    for s in range(len(warm) + 30):
        extra = warm[s] if s < len(warm) else 0.0
        jit = rng.uniform(0.98, 1.02, 4)
        for r in range(4):
            rows.append(_row(r, s, t, data=0.004 * jit[r], fwd=0.020 * jit[r] + extra, bwd=0.040 * jit[r], opt=0.006,
                             other=0.002, exposed=0.070 * jit[r], total=0.090))
            colls += [(r, s, i, "all_reduce", 4, 25 << 20, 1, 0.075 if i == 3 else 0.005, 0.070 * jit[r] if i == 3 else 0.0,
                       t + 0.030 + 0.005 * i, "dp") for i in range(4)]
        t += 0.142 + extra + 0.001
    return rows, colls


def _summary(srv: object, name: str, rows: list[tuple], colls: list[tuple], events: list[dict] | None = None) -> dict:
    with srv.client() as c:  # type: ignore[attr-defined]
        rid = c.register_run({"name": name, "model_family": "steady", "world_size": 4, "peak_flops": 1e14})
        extra = {"events": events} if events else {}
        c.ingest_rows(rid, rows, colls, **extra)
    srv.compact()  # type: ignore[attr-defined]
    with srv.client() as c:  # type: ignore[attr-defined]
        return c.summary(rid)  # type: ignore[no-any-return]


def test_a_run_with_two_long_warm_up_steps_is_diagnosed_as_the_same_run_without_them(live_server: object) -> None:
    rows, colls = _job(())
    plain = _summary(live_server, "steady-plain", rows, colls)
    rows, colls = _job((8.1, 3.4))
    # the second step's compilation is reported; the first step's 8 s are found by the rule
    ev = [{"rank": 0, "seq": 1, "kind": "compile", "ts": 1.7e9 + 8.5, "step": 1, "data": {"compile_s": 3.3}}]
    warm = _summary(live_server, "steady-warm", rows, colls, ev)

    b = warm["basis"]
    assert (b["steps"], b["of"]) == (30, 32)
    assert [(x["reason"], x["steps"]) for x in b["set_apart"]] == [("compile", [1]), ("warm-up", [0])]
    assert sum(x["seconds"] for x in b["set_apart"]) == pytest.approx(11.5 + 2 * 0.142, rel=0.02)
    assert warm["steps"] == 32 and plain["basis"]["of"] == 30
    # every figure on the same basis: KPIs, decomposition, shares, diagnosis, bottlenecks, parallel findings
    for k in ("step_s_p50", "step_s_p95", "overlap_ratio", "mfu", "tokens_per_s", "comm_total_s"):
        assert warm[k] == pytest.approx(plain[k], rel=0.03), k
    for k, v in plain["decomposition"].items():
        assert warm["decomposition"][k] == pytest.approx(v, rel=0.03, abs=1e-4), k
    dw, dp = warm["diagnosis"], plain["diagnosis"]
    assert dw["ranked_causes"][0] == dp["ranked_causes"][0] == "comm_bandwidth"
    pw, pp = ({p["cause"]: p["share"] for p in d["parts"]} for d in (dw, dp))
    assert pw.keys() == pp.keys()
    for cause, share in pp.items():
        assert pw[cause] == pytest.approx(share, abs=0.01), cause
    assert [c["component"] for c in warm["bottlenecks"]] == [c["component"] for c in plain["bottlenecks"]]
    for cw, cp in zip(warm["bottlenecks"], plain["bottlenecks"], strict=True):
        assert cw["share"] == pytest.approx(cp["share"], abs=0.01)
    assert [(f["dim"], round(f["share"], 2)) for f in warm["parallel_findings"]] == \
        [(f["dim"], round(f["share"], 2)) for f in plain["parallel_findings"]]
    assert warm["parallel_findings"] and warm["parallel_findings"][0]["dim"] == "dp"
    # the exposed all-reduce is ~half the steady step; over all steps compile would have looked like 80 %+
    assert pw["comm_bandwidth"] > 0.4 and pw["compute"] < 0.5
    # the set-apart time is accounted in goodput, not dropped
    lost = warm["goodput"]["lost"]
    assert lost["compile_steps"] == pytest.approx(3.4, rel=0.05)
    assert lost["warmup_outlier_steps"] == pytest.approx(8.1, rel=0.05)
    assert plain["goodput"]["lost"]["compile_steps"] == 0.0
    # the run page's goodput section (reports.goodput) says the same
    from fleetscope.server import reports

    g = reports.goodput(live_server.state.engine, warm["run"]["id"])  # type: ignore[attr-defined]
    assert g is not None
    assert g["badput"]["compile_steps_s"] == pytest.approx(3.4, rel=0.05)
    assert g["badput"]["warmup_outlier_steps_s"] == pytest.approx(8.1, rel=0.05)
