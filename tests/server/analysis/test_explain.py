"""Alerts that explain (server/analysis/explain.py, the secondary metrics and setup switches of
server/analysis/regressions.py): cause, diff and the sentence with known answers, no database."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from fleetscope.server.analysis import explain as ex
from fleetscope.server.analysis import regressions as rg
from fleetscope.server.analysis.figures import RunFigures
from fleetscope.server.store.rows import RunRow

BASE = RunRow(id=1, name="good", model_family="vla-7b", config={}, config_signature="A", world_size=64, mp_size=1,
              device_type="H100", device_count=64, peak_flops=989e12, git_commit="c0de0001", status="finished",
              meta={}, started_at="2024-01-01T00:00:00+00:00", finished_at=None, last_seen_at=None, rank_steps=640,
              collective_records=0, steps=10, last_step=9)

BEFORE = {"step_s": 1.02, "data_s": 0.05, "compute_s": 0.77, "comm_exposed_s": 0.10, "other_s": 0.10}
AFTER = {"step_s": 1.20, "data_s": 0.05, "compute_s": 0.78, "comm_exposed_s": 0.25, "other_s": 0.12}


def test_flatten_nested_config_to_dotted_keys() -> None:
    assert ex.flatten({"fsdp": {"prefetch": True, "shard": {"size": 8}}, "lr": 1e-4, "layers": [1, 2], "empty": {}}) == {
        "fsdp.prefetch": True, "fsdp.shard.size": 8, "lr": 1e-4, "layers": [1, 2], "empty": {}}
    assert ex.flatten(None) == {}


def test_cause_is_the_component_with_the_largest_share_and_the_dim_and_op_within_it() -> None:
    c = ex.cause(BEFORE, AFTER,
                 dims=({"dp": 0.08, "tp": 0.02}, {"dp": 0.21, "tp": 0.04}),
                 ops=({("dp", "all_reduce"): 0.07, ("dp", "all_gather"): 0.01, ("tp", "all_gather"): 0.02},
                      {("dp", "all_reduce"): 0.19, ("dp", "all_gather"): 0.02, ("tp", "all_gather"): 0.04}))
    assert c is not None
    assert c["component"] == "comm_exposed_s" and c["label"] == "exposed comm"
    assert (c["before"], c["after"]) == (0.10, 0.25)
    assert c["share_of_change"] == pytest.approx(0.15 / 0.18)
    assert c["step_change"] == pytest.approx(0.18 / 1.02)
    assert c["components"]["compute_s"]["share_of_change"] == pytest.approx(0.01 / 0.18)
    assert c["components"]["other_s"]["share_of_change"] == pytest.approx(0.02 / 0.18)
    # the shares of the components add up to the step change when the decomposition is complete
    assert sum(v["share_of_change"] for v in c["components"].values()) == pytest.approx(1.0)
    assert c["dim"] == {"name": "dp", "before": 0.08, "after": 0.21, "share_of_change": pytest.approx(0.13 / 0.18)}
    assert c["op"]["name"] == "all_reduce" and c["op"]["dim"] == "dp"
    assert c["op"]["share_of_change"] == pytest.approx(0.12 / 0.18)


def test_a_compute_cause_names_no_dim_and_no_cause_without_a_step_rise() -> None:
    after = {**BEFORE, "step_s": 1.30, "compute_s": 1.04}
    c = ex.cause(BEFORE, after, dims=({"dp": 0.1}, {"dp": 0.3}))
    assert c is not None and c["component"] == "compute_s" and c["dim"] is None and c["op"] is None
    assert c["share_of_change"] == pytest.approx(0.27 / 0.28)
    assert ex.cause(BEFORE, {**BEFORE, "step_s": 1.025}) is None  # < 1 % rise: nothing to explain
    assert ex.cause(BEFORE, {**BEFORE, "step_s": 0.9, "compute_s": 0.6}) is None  # faster
    assert ex.cause({"step_s": None}, AFTER) is None


def _fig(step: float, data: float, compute: float, comm: float, other: float, tokens: float = 8192.0,
         **kw: Any) -> RunFigures:
    return RunFigures(steps=10, step_s=step, data_s=data, compute_s=compute, comm_exposed_s=comm, other_s=other,
                      tokens_per_rank_step=tokens, step_s_per_1k_tokens=step * 1000 / tokens,
                      tokens_per_s_per_gpu=tokens / step, **kw)


def test_cause_of_runs_takes_medians_over_the_good_and_bad_runs() -> None:
    good = [_fig(1.0 + d, 0.05, 0.75 + d, 0.1, 0.1) for d in (0.0, 0.01, -0.01, 0.02, 0.5)]  # one outlier run
    bad = [_fig(1.2 + d, 0.05, 0.75 + d, 0.3, 0.1) for d in (0.0, 0.01, -0.01)]
    comm = [({"dp": 0.1}, {("dp", "all_reduce"): 0.1})] * 5
    comm_bad = [({"dp": 0.3}, {("dp", "all_reduce"): 0.3})] * 3
    c = ex.cause_of_runs(good, bad, comm_good=comm, comm_bad=comm_bad)
    assert c is not None and c["basis"] == "step"
    assert c["step_before"] == pytest.approx(1.01) and c["step_after"] == pytest.approx(1.2)  # medians: outlier ignored
    assert c["component"] == "comm_exposed_s" and c["share_of_change"] == pytest.approx(0.2 / 0.19)
    assert c["dim"]["name"] == "dp" and c["op"]["name"] == "all_reduce"


def test_cause_is_per_1k_tokens_when_the_batch_changed() -> None:
    # the bad runs do twice the tokens per step in 1.9x the time: per token they are faster, except data
    good = [_fig(1.0, 0.05, 0.75, 0.1, 0.1, tokens=8192)] * 3
    bad = [_fig(2.3, 0.5, 1.5, 0.2, 0.1, tokens=16384)] * 3
    c = ex.cause_of_runs(good, bad)
    assert c is not None and c["basis"] == "per_1k_tokens"
    per = 1000 / 8192
    assert c["step_before"] == pytest.approx(1.0 * per) and c["step_after"] == pytest.approx(2.3 * per / 2)
    assert c["component"] == "data_s" and c["before"] == pytest.approx(0.05 * per)
    assert c["after"] == pytest.approx(0.5 * per / 2)


def test_cause_of_steps_within_a_run() -> None:
    n, k = 60, 40
    rng = np.random.default_rng(0)
    data = np.full(n, 0.02)
    data[k:] = 0.32  # the loader stalls from step 40 on
    compute = 0.8 + rng.normal(0, 0.001, n)
    cols = {"step_s": data + compute + 0.1 + 0.05, "data_s": data, "compute_s": compute,
            "comm_exposed_s": np.full(n, 0.1), "other_s": np.full(n, 0.05)}
    cols["comm_exposed_s"][3] = np.nan  # an unmeasured value is left out of the median
    c = ex.cause_of_steps(cols, k)
    assert c is not None and c["component"] == "data_s"
    assert (c["before"], c["after"]) == (pytest.approx(0.02), pytest.approx(0.32))
    assert c["share_of_change"] == pytest.approx(1.0, abs=0.01)
    assert ex.cause_of_steps(cols, 0) is None and ex.cause_of_steps(cols, n) is None


def test_run_diff_lists_what_changed_and_caps_the_keys() -> None:
    good = dataclasses.replace(BASE, config={"fsdp": {"prefetch": True, "shard": 8}, "lr": 1e-4, "seed": 1,
                                             "tags": ["a"]},
                               meta={"torch": "2.5.0", "nccl": "2.21.5", "host": "n1", "job_id": "1"})
    bad = dataclasses.replace(BASE, id=2, name="bad", world_size=128, git_commit="c0de0002",
                              config={"fsdp": {"prefetch": False, "shard": 8}, "lr": 1e-4, "seed": 2, "new": "x" * 300,
                                      "tags": ["a", "b"]},
                              meta={"torch": "2.5.0", "nccl": "2.23.4", "host": "n9", "job_id": "2"})
    d = ex.run_diff(good, bad, good_nodes=["n1", "n2"], bad_nodes=["n1", "n2", "n3", "n4"])
    assert d["good_run"] == {"id": 1, "name": "good"} and d["bad_run"] == {"id": 2, "name": "bad"}
    assert d["config"] == {"fsdp.prefetch": [True, False], "new": [None, "x" * 119 + "…"], "tags": ['["a"]', '["a", "b"]']}
    assert d["meta"] == {"nccl": ["2.21.5", "2.23.4"]}  # host / job id are the process's, not the setup's
    assert d["commit"] == ["c0de0001", "c0de0002"] and d["world_size"] == [64, 128] and d["nodes"] == [2, 4]
    assert d["device_type"] == ["H100", "H100"] and d["hosts"] == {"added": ["n3", "n4"], "removed": []}
    assert d["truncated"] == 0
    capped = ex.run_diff(good, bad, max_keys=2)
    assert list(capped["config"]) == ["fsdp.prefetch", "new"] and capped["meta"] == {} and capped["truncated"] == 2
    assert capped["nodes"] == [None, None]


def test_the_sentence_says_it_all_in_one_line() -> None:
    c = ex.cause(BEFORE, {**AFTER, "step_s": 1.20})
    diff = ex.run_diff(dataclasses.replace(BASE, config={"fsdp": {"prefetch": True}}),
                       dataclasses.replace(BASE, id=2, world_size=128, config={"fsdp": {"prefetch": False}}))
    s = ex.explanation("step_s", 0.18 / 1.02, 1.02, 1.20, "s", c, diff)
    assert s == ("step time +18 % (1.02 s → 1.20 s): exposed comm explains 83 % of it (100 ms → 250 ms); "
                 "changed: world_size 64 → 128, config.fsdp.prefetch true → false")
    s2 = ex.explanation("tokens_per_s_per_gpu", -0.15, 9876.0, 8395.0, "tokens/s/GPU", c, {**diff, "truncated": 3})
    assert s2 == ("tokens/s per GPU -15 % (9876 tokens/s/GPU → 8395 tokens/s/GPU); step time +18 % (1.02 s → 1.20 s): "
                  "exposed comm explains 83 % of it (100 ms → 250 ms); changed: world_size 64 → 128, "
                  "config.fsdp.prefetch true → false and 3 more")
    same = ex.run_diff(BASE, dataclasses.replace(BASE, id=2))
    assert ex.explanation("step_s", 0.1, 1.0, 1.1, "s", None, same) == \
        "no config, commit, scale, node or version change recorded"
    assert ex.explanation("step_s", 0.1, 1.0, 1.1, "s", None, None) is None


def test_the_sentence_escapes_user_strings() -> None:
    diff = ex.run_diff(dataclasses.replace(BASE, config={"<!channel>": 1}),
                       dataclasses.replace(BASE, id=2, config={"<!channel>": 2}))
    s = ex.explanation("step_s", 0.1, 1.0, 1.1, "s", None, diff, esc=lambda v: v.replace("<", "&lt;"))
    assert s is not None and "<!channel>" not in s and "config.&lt;!channel> 1 → 2" in s


# ------------------------------------------------------------------------- detection: secondary metrics


_PATTERN = (0.8, -0.6, 0.2, -1.0, 1.0, -0.2, 0.6, 0.0, 0.4, -0.4, -0.8, 0.9, -0.3, 0.1, 0.5, -0.5)


def _series(n_good: int, n_bad: int, bad: dict[str, float], *, sig: str = "A", ws: int = 64, start: int = 0,
            noise: float = 0.004, seed: int = 0) -> list[tuple[RunRow, RunFigures]]:
    """Runs of one comparable setup: the good levels, then ``bad`` multipliers on components / memory / tokens.
    The run-to-run noise is a fixed pattern (``noise`` × ``_PATTERN``) in which no side's end is its extreme,
    so the change point's place is determined (a perfectly separated side ties the rank statistic)."""
    out = []
    for i in range(n_good + n_bad):
        m = bad if i >= n_good else {}
        j = 1 + noise * _PATTERN[(i + seed) % len(_PATTERN)]
        c = {k: v * m.get(k, 1.0) * j for k, v in
             {"data_s": 0.05, "compute_s": 0.75, "comm_exposed_s": 0.1, "other_s": 0.1}.items()}
        step = sum(c.values())
        run = dataclasses.replace(BASE, id=start + i + 1, name=f"r{start + i}", config_signature=sig, world_size=ws,
                                  git_commit=f"c{start + i:04d}", started_at=f"2024-01-{start + i + 1:02d}T00:00:00+00:00")
        fig = _fig(step, c["data_s"], c["compute_s"], c["comm_exposed_s"], c["other_s"], tokens=8192 * m.get("tokens", 1.0),
                   mfu=0.4 / step, mem_peak_bytes=60e9 * m.get("mem", 1.0) * j)
        out.append((run, fig))
    return out


def test_a_step_regression_is_one_alert_whose_cause_names_the_component_the_others_fold_in() -> None:
    runs = _series(8, 6, {"comm_exposed_s": 2.5})
    found, evaluated = rg.run_series_regressions(runs)
    assert len(evaluated) == 2  # the comparable series and the family's setup series
    (reg,) = found
    assert reg.metric == "tokens_per_s_per_gpu" and reg.first_bad["run_id"] == 9 and reg.details["scope"] == "comparable"
    assert reg.details["good_runs"] == [4, 5, 6, 7, 8] and reg.details["bad_runs"] == [9, 10, 11, 12, 13]
    also = {a["metric"]: a for a in reg.details["also_regressed"]}
    assert set(also) == {"comm_exposed_s", "mfu"}  # step's components and MFU moved with it: no alert of their own
    assert also["comm_exposed_s"]["after"] / also["comm_exposed_s"]["before"] == pytest.approx(2.5, rel=0.02)
    figs = dict((r.id, f) for r, f in runs)
    c = ex.cause_of_runs([figs[i] for i in reg.details["good_runs"]], [figs[i] for i in reg.details["bad_runs"]])
    assert c is not None and c["component"] == "comm_exposed_s" and c["share_of_change"] == pytest.approx(1.0, abs=0.05)


def test_a_component_alerts_on_its_own_only_when_the_step_did_not_regress_and_it_matters() -> None:
    # data 0.05 -> 0.075 s: +2.5 % of the step (below the 5 % floor of the step, above the 2 % floor of a component)
    found, _ = rg.run_series_regressions(_series(8, 6, {"data_s": 1.5}, noise=0.001))
    assert [(r.metric, r.first_bad["run_id"], r.details["primary_metric"]) for r in found] == \
        [("data_s", 9, "tokens_per_s_per_gpu")]
    assert found[0].change == pytest.approx(0.5, abs=0.02) and found[0].unit == "s"
    # 0.05 -> 0.06 s is +20 % of data but 1 % of the step: not worth an alert
    assert rg.run_series_regressions(_series(8, 6, {"data_s": 1.2}, noise=0.001))[0] == []
    # peak memory has no step floor: +10 % alerts
    (mem,) = rg.run_series_regressions(_series(8, 6, {"mem": 1.1}, noise=0.001))[0]
    assert mem.metric == "mem_peak_bytes" and mem.unit == "B" and mem.change == pytest.approx(0.1, abs=0.01)


def test_busbw_per_op_is_a_series_too() -> None:
    assert rg.busbw_by_op([("all_reduce", 8, 1e9, 0.01), ("all_reduce", 8, 1e9, 0.01), ("all_gather", 4, 3e8, 0.01),
                           ("barrier", 8, 0.0, 0.001)]) == {
        "busbw:all_gather": pytest.approx(3e8 * 0.75 / 0.01), "busbw:all_reduce": pytest.approx(2e9 * 1.75 / 0.02)}
    runs = _series(8, 6, {}, noise=0.001)
    extra = {r.id: {"busbw:all_reduce": 100e9 * (0.7 if r.id > 8 else 1.0) * (1 + 0.001 * (r.id % 3))} for r, _ in runs}
    (reg,) = rg.run_series_regressions(runs, extra=extra)[0]
    assert reg.metric == "busbw:all_reduce" and reg.unit == "B/s" and reg.change == pytest.approx(-0.3, abs=0.01)
    assert ex.metric_label(reg.metric) == "all_reduce busbw"


def test_a_regression_at_a_setup_switch_is_one_family_alert() -> None:
    a = _series(8, 0, {}, sig="A", ws=64)
    b = _series(0, 6, {"comm_exposed_s": 2.5}, sig="B", ws=128, start=8, seed=1)
    found, evaluated = rg.run_series_regressions(a + b)
    assert len(evaluated) == 3  # A's and B's comparable series, the family series
    (reg,) = found
    assert reg.details["scope"] == "family" and reg.metric == "tokens_per_s_per_gpu"
    assert reg.first_bad["run_id"] == 9 and reg.details["good_runs"] == [4, 5, 6, 7, 8]
    assert reg.details["switch"] == {"from": {"config_signature": "A", "world_size": 64},
                                     "to": {"config_signature": "B", "world_size": 128}}
    # a switch that costs nothing raises nothing; nor does a regression inside B (B's own series owns it)
    assert rg.run_series_regressions(a + _series(0, 6, {}, sig="B", start=8, seed=1))[0] == []
    inside = _series(0, 12, {}, sig="B", start=8, seed=1)
    inside = [(r, f) if r.id < 15 else (r, dataclasses.replace(f, tokens_per_s_per_gpu=f.tokens_per_s_per_gpu * 0.8))
              for r, f in inside]
    found, _ = rg.run_series_regressions(a + inside)
    assert [(r.details["scope"], r.first_bad["run_id"]) for r in found] == [("comparable", 15)]
    # setups interleaved (no clean switch): no family alert
    mixed = [(dataclasses.replace(r, config_signature="AB"[i % 2]), f) for i, (r, f) in enumerate(a + b)]
    assert [r for r in rg.run_series_regressions(mixed)[0] if r.details["scope"] == "family"] == []


def test_a_switch_next_to_an_extreme_run_is_still_placed_at_the_switch() -> None:
    from fleetscope.changepoint import detect

    a = _series(10, 0, {}, sig="A")
    b = _series(0, 6, {"comm_exposed_s": 2.5}, sig="B", ws=128, start=10)
    # the last A run is the slowest A run: 9|7 separates as perfectly as 10|6 and is more balanced
    last_r, last_f = a[-1]
    a[-1] = (last_r, dataclasses.replace(last_f, tokens_per_s_per_gpu=min(f.tokens_per_s_per_gpu for _, f in a) * 0.999))
    vals = [f.tokens_per_s_per_gpu for _, f in a + b]
    assert [c.index for c in detect(vals)] == [9]
    (reg,) = rg.run_series_regressions(a + b)[0]
    assert reg.details["scope"] == "family" and reg.first_bad["run_id"] == 11 and reg.first_bad["index"] == 10
    assert reg.before == pytest.approx(float(np.median(vals[:10]))) and reg.after == pytest.approx(float(np.median(vals[10:])))
    assert reg.details["good_runs"] == [6, 7, 8, 9, 10] and reg.details["bad_runs"] == [11, 12, 13, 14, 15]
