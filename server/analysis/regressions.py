"""Regression detection (docs/metrics.md "Regressions") on three kinds of series, with one detector.

- ``run_series``: a summary metric of comparable runs (same family, config signature, device
  type, world size) ordered by start time — tokens/s/GPU when the runs report tokens, else step time;
- ``benchmark``: the points of one benchmark series ordered by time;
- ``step_time_shift``: the median step time within one run, step by step.

Each series goes through ``fleetscope.changepoint.detect`` (default configuration). The *current* regime is
compared with the one before it: a regression is a last change point in the worse direction of at
least ``MIN_CHANGE`` (5 %) — statistically significant (the detector's test) and practically large
(this floor). Only the current state alerts: history that has recovered does not, and a later change
back resolves the alert (``alerts.sync``).

``check_run`` is the CI gate of ``fleetscope check``: one run against the distribution of its
baseline runs (a robust z-score and the same 5 % floor) plus its own within-run shift.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.changepoint import DEFAULT, DetectorConfig, detect

from ..store.rows import RunRow
from .figures import METRICS, RunFigures, comparable_key

RunWithFigures = tuple[RunRow, RunFigures]
BenchmarkSeries = tuple[int, str, str, dict[str, Any] | None, str, list[tuple[dt.datetime, float, str | None]]]

__all__ = [
    "Regression",
    "MIN_CHANGE",
    "series_regression",
    "run_series_regressions",
    "benchmark_regressions",
    "step_shift_regression",
    "straggler_finding",
    "check_verdict",
    "higher_is_better_unit",
    "series_key",
]

MIN_CHANGE = 0.05  # a regression is at least 5 % worse: smaller changes are not worth a page
CHECK_Z = 3.0  # check: the run must sit this many robust σ of the baseline runs away
MIN_RUN_STEPS = 3  # a run enters run series once it has this many compacted steps
STEP_SERIES_MAX = 20_000  # within-run: the most recent steps analysed ...
STEP_SERIES_POINTS = 1_000  # ... as at most this many block medians (a step-time shift lasts many steps)


@dataclass
class Regression:
    """A detected regression, before it becomes (or updates) an alert."""

    kind: str  # run_series | benchmark | step_time_shift
    series: str  # stable key of the series (dedup)
    metric: str
    unit: str
    before: float
    after: float
    change: float  # relative (after - before) / |before|
    significance: float | None  # p-value of the change point (None: not a statistical test)
    first_bad: dict[str, Any]
    run_id: int | None
    url_path: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def dedup_key(self) -> str:
        ident = self.first_bad.get("run_id", self.first_bad.get("index"))
        return f"{self.kind}:{self.series}:{self.metric}:{ident}"[:256]


def series_key(*parts: Any) -> str:
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:16]


def higher_is_better_unit(unit: str) -> bool:
    """Throughput-like units (…/s, FLOP/s, B/s) improve upwards; times and latencies downwards."""
    u = unit.lower()
    return "/s" in u or "flop" in u or "tokens" in u or u in ("mfu", "ratio", "efficiency")


def series_regression(values: list[float] | np.ndarray, *, higher_is_better: bool,
                      config: DetectorConfig = DEFAULT) -> tuple[int, float, float, float, float] | None:
    """(index, before, after, relative change, p) of the last change point when it is a regression."""
    cps = detect(values, config)
    if not cps:
        return None
    last = cps[-1]
    if last.before == 0 or not math.isfinite(last.before):
        return None
    change = (last.after - last.before) / abs(last.before)
    worse = -change if higher_is_better else change
    if worse < MIN_CHANGE:
        return None
    return last.index, last.before, last.after, change, last.p_value


def _primary_metric(members: list[RunWithFigures]) -> str:
    if all(f.tokens_per_s_per_gpu for _, f in members):
        return "tokens_per_s_per_gpu"
    return "step_s"


def run_series_regressions(runs: Sequence[RunWithFigures], *,
                           run_ids: Collection[int] | None = None) -> tuple[list[Regression], set[str]]:
    """Regressions of the run series (comparable runs in start order) formed by ``runs`` — one
    family's runs with their figures — that contain one of ``run_ids`` (all when None), and the
    series evaluated."""
    found: list[Regression] = []
    evaluated: set[str] = set()
    groups: dict[tuple[Any, ...], list[RunWithFigures]] = {}
    for run, fig in runs:
        if fig.steps >= MIN_RUN_STEPS:
            groups.setdefault(comparable_key(run), []).append((run, fig))
    for key, members in groups.items():
        if run_ids is not None and not any(r.id in run_ids for r, _ in members):
            continue
        members.sort(key=lambda m: (m[0].started_at or "", m[0].id))
        metric = _primary_metric(members)
        unit, hib = METRICS[metric]
        skey = series_key("runs", *key)
        evaluated.add(skey)
        raw = [f.get(metric) for _, f in members]
        if any(v is None for v in raw):
            continue
        vals = [float(v) for v in raw if v is not None]
        res = series_regression(vals, higher_is_better=hib)
        if res is None:
            continue
        i, before, after, change, p = res
        bad = members[i][0]
        last = members[-1][0]
        found.append(Regression(
            kind="run_series", series=skey, metric=metric, unit=unit, before=before, after=after, change=change,
            significance=p,
            first_bad={"run_id": bad.id, "run": bad.name, "commit": bad.git_commit,
                       "started_at": bad.started_at, "index": i},
            run_id=last.id, url_path=f"/runs/{bad.id}",
            details={"family": key[0], "config_signature": key[1], "device_type": key[2], "world_size": key[3],
                     "runs": [r.id for r, _ in members], "values": vals,
                     "good_commit": members[i - 1][0].git_commit if i > 0 else None},
        ))
    return found, evaluated


def benchmark_regressions(series: Sequence[BenchmarkSeries]) -> tuple[list[Regression], set[str]]:
    """Regressions of benchmark series: (id, name, cluster, params, unit, points (ts, value, commit))."""
    found: list[Regression] = []
    evaluated: set[str] = set()
    for sid, name, cluster, params, unit, p in series:
        skey = series_key("bench", sid)
        evaluated.add(skey)
        hib = (params or {}).get("higher_is_better")
        hib = higher_is_better_unit(unit) if hib is None else bool(hib)
        res = series_regression([float(v) for _, v, _ in p], higher_is_better=hib)
        if res is None:
            continue
        i, before, after, change, pv = res
        found.append(Regression(
            kind="benchmark", series=skey, metric=name, unit=unit, before=before, after=after, change=change,
            significance=pv,
            first_bad={"index": i, "ts": p[i][0].isoformat(), "commit": p[i][2], "series_id": sid},
            run_id=None, url_path=f"/benchmarks?series={sid}",
            details={"cluster": cluster, "params": params or {}, "series_id": sid,
                     "good_commit": p[i - 1][2] if i > 0 else None},
        ))
    return found, evaluated


def step_shift_regression(run_id: int, steps: np.ndarray, step_s: np.ndarray) -> Regression | None:
    """A change point in a run's median step time that made steps slower (e.g. a restart onto a slower
    node), over its most recent ``STEP_SERIES_MAX`` steps (``steps``/``step_s`` in step order)."""
    if len(steps) < 2 * DEFAULT.min_size:
        return None
    k = max(1, -(-len(steps) // STEP_SERIES_POINTS))
    vals = np.asarray(step_s, dtype=np.float64)
    m = len(vals) // k
    series = np.median(vals[: m * k].reshape(m, k), axis=1) if k > 1 else vals
    res = series_regression(series, higher_is_better=False)
    if res is None:
        return None
    i, before, after, change, p = res
    i *= k
    step = int(steps[i])
    return Regression(
        kind="step_time_shift", series=series_key("steps", run_id), metric="step_s", unit="s", before=before,
        after=after, change=change, significance=p, first_bad={"run_id": run_id, "step": step, "index": i},
        run_id=run_id, url_path=f"/runs/{run_id}?step={step}", details={"steps": len(steps), "block_steps": k},
    )


STRAGGLER_MIN_STEPS = 10  # a straggler alert needs this many compacted steps (no flapping at start)


def straggler_finding(run_id: int, rep: dict[str, Any] | None) -> Regression | None:
    """A run with persistent stragglers (docs/metrics.md): one alert per run naming the worst rank or node,
    from its straggler report (``stragglers.straggler_report``)."""
    if not rep or rep["steps"] < STRAGGLER_MIN_STEPS:
        return None
    persistent = [s for s in rep["stragglers"] if s["kind"] == "persistent" and s["slowdown"]]
    if not persistent:
        return None
    top = persistent[0]
    node = rep["nodes"][0] if rep["nodes"] else None
    return Regression(
        kind="straggler", series=series_key("stragglers", run_id), metric="straggler_slowdown", unit="x",
        before=1.0, after=float(top["slowdown"]), change=float(top["slowdown"]) - 1.0, significance=None,
        first_bad={"run_id": run_id, "rank": top["rank"], "host": top["host"], "node": top["node"],
                   "step": top.get("first_window_step") or 0},
        run_id=run_id, url_path=f"/runs/{run_id}",
        details={"ranks": [s["rank"] for s in persistent][:64], "stragglers": len(persistent),
                 "node": node["node"] if node else None, "node_ranks": node["ranks"] if node else None,
                 "component": top.get("component"), "lost_s": top.get("lost_s"),
                 "fleet_lost_share": rep.get("fleet_lost_share"), "threshold": rep["threshold"]},
    )


def _baseline(runs: Sequence[RunWithFigures], run: RunRow) -> tuple[list[RunWithFigures], str]:
    others = [(r, f) for r, f in runs if r.id != run.id and f.steps >= MIN_RUN_STEPS
              and (r.started_at or "") <= (run.started_at or "")]
    strict = [(r, f) for r, f in others if comparable_key(r) == comparable_key(run)]
    if strict:
        return strict, "family + config signature + device + world size"
    loose = [(r, f) for r, f in others if (r.device_type, r.world_size) == (run.device_type, run.world_size)]
    return loose, "family + device + world size (no run with the same config signature)"


def check_verdict(me: RunWithFigures, family: Sequence[RunWithFigures], shift: Regression | None, *,
                  max_baseline: int = 20) -> dict[str, Any]:
    """Is this run a regression against its family's baseline? (``fleetscope check``): its figures
    against the median of the ``max_baseline`` latest earlier baseline runs of ``family``, plus its own
    within-run step-time shift."""
    run, fig = me
    base, how = _baseline(family, run)
    base.sort(key=lambda m: (m[0].started_at or "", m[0].id))
    base = base[-max_baseline:]
    regs: list[dict[str, Any]] = []
    for metric, (unit, hib) in METRICS.items():
        x = fig.get(metric)
        vals = np.array([f.get(metric) for _, f in base if f.get(metric) is not None], dtype=np.float64)
        if x is None or not vals.size:
            continue
        med = float(np.median(vals))
        if med == 0:
            continue
        sigma = 1.4826 * float(np.median(np.abs(vals - med))) if vals.size >= 3 else 0.0
        change = (x - med) / abs(med)
        worse = -change if hib else change
        z = abs(x - med) / sigma if sigma > 0 else None
        if worse >= MIN_CHANGE and (z is None or z >= CHECK_Z):
            regs.append({"metric": metric, "unit": unit, "before": med, "after": x, "change": change, "z": z,
                         "baseline_runs": int(vals.size)})
    if shift is not None:
        regs.append({"metric": "step_s (within run)", "unit": "s", "before": shift.before, "after": shift.after,
                     "change": shift.change, "p_value": shift.significance, "first_bad_step": shift.first_bad["step"]})
    return {
        "run": {"id": run.id, "name": run.name, "model_family": run.model_family, "world_size": run.world_size,
                "device_type": run.device_type, "git_commit": run.git_commit},
        "baseline": {"runs": [r.id for r, _ in base], "match": how},
        "regressions": regs,
        "regressed": bool(regs),
        "min_change": MIN_CHANGE,
    }
