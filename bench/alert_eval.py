"""Detection quality of the run-series alerts on the new per-run metrics (#12): labelled sets of
comparable-run series with one known change in one figure, scored like bench/changepoint_eval.py.

    python bench/alert_eval.py [--per-metric 30] [--seed 5]

Series: runs of one comparable setup (30-120 runs), each run's decomposition drawn around a
vla-7b-like step on 64 ranks (data 30 ms, compute 1.45 s, exposed comm 100 ms, other 45 ms) with
run-to-run noise per figure (CV drawn per series: data 3-15 %, compute 0.5-2 % plus a 0.3-1 %
node factor, exposed comm 2-10 %, other 2-8 %, peak memory 0.2-1 %, busbw 2-8 %). A labelled series
has one change at a random run of 1-5 noise σ of one figure, random sign (``mfu``: a change of
compute; ``busbw:all_reduce``: of the all-reduce bandwidth, with exposed comm moving inversely);
a no-change series has none. Per metric:

* ``f1``: TCPD F1, margin 5 (bench/cpeval.py ``f1_margin``), of the detector on that metric's series:
  ``k`` series with a 1-5 σ change of random sign and ``k`` without (the no-change baseline too);
* false alerts per 1,000 runs on ``2k`` no-change series: the detector's change points on the
  metric's series, and the alerts the alert rule (``analysis.regressions.run_series_regressions``:
  primary, secondary, no-storm folding, the floors) raises for that metric;
* ``recall``: ``k`` series with a change for the worse of 1.2-3× the alert floors (5 % of the figure;
  a component also 2 % of the step): the share alerted for that metric (its own alert or
  ``also_regressed`` of the primary alert) with the first bad run within 5 runs of the truth;
* ``cause_accuracy``: ``k`` series per component where it adds 6-30 % to the step: of the primary
  (tokens/s/GPU) alerts raised, the share whose ``cause`` names that component.

Nothing here tunes the detector or the rules. Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpeval import f1_margin  # noqa: E402  (bench/cpeval.py)
from fleetscope.server.analysis import explain as ex  # noqa: E402
from fleetscope.server.analysis import regressions as rg  # noqa: E402
from fleetscope.server.analysis.figures import RunFigures  # noqa: E402
from fleetscope.server.store.rows import RunRow  # noqa: E402

from fleetscope.changepoint import change_points  # noqa: E402

BASE = {"data_s": 0.030, "compute_s": 1.45, "comm_exposed_s": 0.100, "other_s": 0.045}
MEM, BUSBW, TOKENS, FLOPS, PEAK = 66e9, 40e9, 7450.0, 6 * 7e9 * 8192, 989e12
METRICS = ("data_s", "compute_s", "comm_exposed_s", "other_s", "mfu", "mem_peak_bytes", "busbw:all_reduce")
COMPONENT = {"data_s": "data_s", "compute_s": "compute_s", "comm_exposed_s": "comm_exposed_s", "other_s": "other_s",
             "mfu": "compute_s"}
RUN = RunRow(id=0, name="r", model_family="vla-7b", config={}, config_signature="A", world_size=64, mp_size=1,
             device_type="H100", device_count=64, peak_flops=PEAK, git_commit=None, status="finished", meta={},
             started_at=None, finished_at=None, last_seen_at=None, rank_steps=0, collective_records=0, steps=20,
             last_step=19)


@dataclasses.dataclass
class Labelled:
    metric: str
    runs: list[tuple[RunRow, RunFigures]]
    extra: dict[int, dict[str, float]]
    cps: tuple[int, ...]
    worse: bool  # the change is for the worse
    material: bool  # and passes the alert floors


def make(rng: np.random.Generator, metric: str, change: bool, mode: str = "sigma") -> Labelled:
    """A series with (``change``) one change of ``metric``: ``sigma`` = 1-5 noise σ, random sign;
    ``practical`` = for the worse, 1.2-3× the alert floors; ``primary`` = a component that adds 6-30 %
    to the step (tokens/s/GPU alerts and its cause is tested)."""
    n = int(rng.integers(30, 121))
    cv = {"data_s": rng.uniform(0.03, 0.15), "compute_s": rng.uniform(0.005, 0.02), "comm_exposed_s": rng.uniform(0.02, 0.10),
          "other_s": rng.uniform(0.02, 0.08), "mem": rng.uniform(0.002, 0.01), "busbw": rng.uniform(0.02, 0.08)}
    node_cv = rng.uniform(0.003, 0.01)
    cp = int(rng.integers(10, n - 5)) if change else n
    effect = float(rng.uniform(1.0, 5.0) * rng.choice([-1, 1])) if change else 0.0
    target = {"mfu": "compute_s", "mem_peak_bytes": "mem", "busbw:all_reduce": "busbw"}.get(metric, metric)
    factor = max(0.05, 1 + effect * cv[target])  # the changed figure's level after the change
    step0 = sum(BASE.values())
    u = float(rng.uniform(1.2, 3.0))
    if change and mode == "practical":
        if target in BASE:
            factor = 1 + u * max(rg.MIN_CHANGE * BASE[target], rg.MIN_COMPONENT_STEP_SHARE * step0) / BASE[target]
        elif target == "mem":
            factor = 1 + u * rg.MIN_CHANGE
        else:  # busbw
            factor = 1 - min(0.9, u * rg.MIN_CHANGE)
        if metric == "mfu":
            factor = 1 + u * rg.MIN_CHANGE * step0 / BASE["compute_s"]
    if change and mode == "primary":
        factor = 1 + float(rng.uniform(0.06, 0.30)) * step0 / BASE[target]
    runs, extra = [], {}
    for i in range(n):
        after = i >= cp
        c = {k: v * float(np.exp(rng.normal(0, cv[k]))) for k, v in BASE.items()}
        c["compute_s"] *= float(np.exp(rng.normal(0, node_cv)))
        bw = BUSBW * float(np.exp(rng.normal(0, cv["busbw"])))
        mem = MEM * float(np.exp(rng.normal(0, cv["mem"])))
        if after and target in c:
            c[target] *= factor
        if after and target == "busbw":
            bw *= factor
            c["comm_exposed_s"] /= factor
        if after and target == "mem":
            mem *= factor
        step = sum(c.values())
        tokens = TOKENS * float(np.exp(rng.normal(0, 0.002)))
        fig = RunFigures(steps=20, step_s=step, **c, tokens_per_rank_step=tokens, tokens_per_s_per_gpu=tokens / step,
                         step_s_per_1k_tokens=step * 1000 / tokens, mfu=FLOPS / (step * PEAK), mem_peak_bytes=mem)
        run = dataclasses.replace(RUN, id=i + 1, name=f"r{i}", started_at=f"{1000000 + i}")
        runs.append((run, fig))
        extra[run.id] = {"busbw:all_reduce": bw}
    hib = metric in ("mfu", "busbw:all_reduce")
    worse = change and ((factor < 1) if hib else (factor > 1))
    # the figure's own relative change, and for a component its share of the step
    vals = _series(runs, extra, metric)
    rel = abs(np.median(vals[cp:]) - np.median(vals[:cp])) / np.median(vals[:cp]) if change else 0.0
    material = bool(worse and rel >= rg.MIN_CHANGE)
    if material and metric in BASE:
        material = abs(np.median(vals[cp:]) - np.median(vals[:cp])) >= rg.MIN_COMPONENT_STEP_SHARE * sum(BASE.values())
    return Labelled(metric, runs, extra, (cp,) if change else (), bool(worse), material)


def _series(runs: list[tuple[RunRow, RunFigures]], extra: dict[int, dict[str, float]], metric: str) -> np.ndarray:
    if metric.startswith("busbw:"):
        return np.array([extra[r.id][metric] for r, _ in runs])
    return np.array([f.get(metric) for _, f in runs], dtype=np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-metric", type=int, default=30, help="labelled series per metric and set")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    k = args.per_metric
    figures: list[tuple[str, float, str]] = []
    t0 = time.perf_counter()

    # no-change series: the detector's and the alert rule's false alerts, per metric
    quiet = [make(rng, "data_s", False) for _ in range(2 * k)]
    quiet_found = [rg.run_series_regressions(s.runs, extra=s.extra)[0] for s in quiet]
    points = sum(len(s.runs) for s in quiet)
    cause_hits = cause_n = 0
    for metric in METRICS:
        name = metric.replace(":", "_")
        sigma = [make(rng, metric, True) for _ in range(k)] + quiet[:k]
        f1 = [f1_margin(s.cps, change_points(_series(s.runs, s.extra, metric))) for s in sigma]
        zero = [f1_margin(s.cps, []) for s in sigma]
        det_false = sum(len(change_points(_series(s.runs, s.extra, metric))) for s in quiet)
        rule_false = sum(1 for found in quiet_found for r in found if r.metric == metric)
        practical = [make(rng, metric, True, "practical") for _ in range(k)]
        hits = 0
        for s in practical:
            found, _ = rg.run_series_regressions(s.runs, extra=s.extra)
            firsts = [r.first_bad["index"] for r in found if r.metric == metric]
            firsts += [a["index"] for r in found for a in r.details.get("also_regressed", []) if a["metric"] == metric]
            hits += any(abs(i - s.cps[0]) <= 5 for i in firsts)
        if metric in BASE:
            for s in (make(rng, metric, True, "primary") for _ in range(k)):
                found, _ = rg.run_series_regressions(s.runs, extra=s.extra)
                prim = [r for r in found if r.metric == "tokens_per_s_per_gpu"]
                if not prim:
                    continue
                by_id = {r.id: f for r, f in s.runs}
                reg = prim[0]
                c = ex.cause_of_runs([by_id[i] for i in reg.details["good_runs"]], [by_id[i] for i in reg.details["bad_runs"]])
                cause_n += 1
                cause_hits += bool(c and c["component"] == metric)
        figures.append((f"alert_{name}_f1_margin5", float(np.mean(f1)), "F1"))
        figures.append((f"alert_{name}_f1_zero_baseline", float(np.mean(zero)), "F1"))
        figures.append((f"alert_{name}_detector_false_per_1000_points", 1000 * det_false / points, "alerts"))
        figures.append((f"alert_{name}_rule_false_per_1000_runs", 1000 * rule_false / points, "alerts"))
        figures.append((f"alert_{name}_recall_worse_above_floor", hits / len(practical), "share"))
        print(f"  {metric:18s} F1 {np.mean(f1):.3f} (zero {np.mean(zero):.3f})  detector false/1000 "
              f"{1000 * det_false / points:.2f}  rule false/1000 {1000 * rule_false / points:.2f}  "
              f"recall {hits}/{len(practical)}", file=sys.stderr)
    # cost of a detection pass: one family of 10 comparable setups × 60 quiet runs, the rule with the
    # secondary metrics and setup switches against the primary metric alone (what a pass did before #12)
    fam: list[tuple[RunRow, RunFigures]] = []
    extra_all: dict[int, dict[str, float]] = {}
    for j in range(10):
        s0 = make(rng, "data_s", False)
        for r, f in s0.runs[:60]:
            fam.append((dataclasses.replace(r, id=j * 1000 + r.id, config_signature=f"S{j}"), f))
            extra_all[j * 1000 + r.id] = s0.extra[r.id]
    t1 = time.perf_counter()
    for _ in range(3):
        rg.run_series_regressions(fam, extra=extra_all)
    new_s = (time.perf_counter() - t1) / 3
    t1 = time.perf_counter()
    for _ in range(3):
        for j in range(10):
            rg.series_regression([f.tokens_per_s_per_gpu for r, f in fam if r.config_signature == f"S{j}"],
                                 higher_is_better=True)
    old_s = (time.perf_counter() - t1) / 3
    figures.append(("alert_pass_ms_600_runs", new_s * 1e3, "ms"))
    figures.append(("alert_pass_ms_600_runs_primary_only", old_s * 1e3, "ms"))
    figures.append(("alert_pass_cost_ratio", new_s / old_s, "x"))
    any_false = sum(len(f) for f in quiet_found)
    figures.append(("alert_rule_false_per_1000_runs_all_metrics", 1000 * any_false / points, "alerts"))
    figures.append(("alert_cause_accuracy", cause_hits / cause_n if cause_n else float("nan"), "share"))
    figures.append(("alert_cause_primary_alerts", float(cause_n), "alerts"))
    figures.append(("alert_no_change_runs", float(points), "runs"))
    figures.append(("alert_eval_seconds", time.perf_counter() - t0, "s"))
    for fname, value, unit in figures:
        print(f"{fname}: {value:.4g} {unit}")


if __name__ == "__main__":
    main()
