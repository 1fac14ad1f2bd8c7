"""Regression detection (docs/metrics.md "Regressions") on three kinds of series, with one detector.

- ``run_series``: a summary metric of comparable runs (same family, config signature, device
  type, world size) ordered by start time — tokens/s/GPU when the runs report tokens, else step time
  (the *primary* metric); and the *secondary* per-run figures of the same series: each step-time
  component, MFU, peak memory and busbw per collective op. A secondary metric alerts on its own only
  while the primary does not regress (then it is listed in the primary alert's
  ``details.also_regressed`` and the primary alert's cause names the component); a component also
  needs its change to be at least ``MIN_COMPONENT_STEP_SHARE`` of the step time.
  A second run series per (family, device type) — ``details.scope = "family"`` — catches a
  regression at a *setup switch*: the family's runs moved from one comparable setup (config
  signature, world size) to another, stayed there, and its primary metric (tokens/s/GPU, else MFU)
  changed for the worse at the switch (the detector's change point at it, or one run off, then
  measured at it). Inside one comparable setup that series stays quiet
  (the comparable series owns such changes), so no change alerts twice;
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.changepoint import DEFAULT, DetectorConfig, detect

from ..store.rows import RunRow
from .explain import WINDOW
from .figures import COMPONENTS, METRICS, RunFigures, comparable_key

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
    "slow_node_findings",
    "check_verdict",
    "higher_is_better_unit",
    "series_key",
    "SECONDARY_METRICS",
    "MIN_COMPONENT_STEP_SHARE",
    "busbw_by_op",
]

MIN_CHANGE = 0.05  # a regression is at least 5 % worse: smaller changes are not worth a page
CHECK_Z = 3.0  # check: the run must sit this many robust σ of the baseline runs away
MIN_RUN_STEPS = 3  # a run enters run series once it has this many compacted steps
STEP_SERIES_MAX = 20_000  # within-run: the most recent steps analysed ...
STEP_SERIES_POINTS = 1_000  # ... as at most this many block medians (a step-time shift lasts many steps)
MIN_COMPONENT_STEP_SHARE = 0.02  # a component alert: its change is at least 2 % of the step time before
SWITCH_BASELINE_RUNS = 20  # setup switch: the latest runs of the previous setup the new one is tested against

#: per-run figures of a comparable series besides the primary one: name -> (unit, higher_is_better);
#: plus ``busbw:<op>`` (B/s, higher is better) for every collective op with bytes in every run of the series
SECONDARY_METRICS: dict[str, tuple[str, bool]] = {
    **{k: ("s", False) for k, _ in COMPONENTS},
    "mfu": ("", True),
    "mem_peak_bytes": ("B", False),
}
_COMPONENT_KEYS = frozenset(k for k, _ in COMPONENTS)


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
    res = _last_regression(values, higher_is_better=higher_is_better, config=config)
    return res[:5] if res is not None else None


def _last_regression(values: list[float] | np.ndarray, *, higher_is_better: bool,
                     config: DetectorConfig = DEFAULT) -> tuple[int, float, float, float, float, int] | None:
    """``series_regression`` plus where the good regime starts (the change point before, else 0)."""
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
    return last.index, last.before, last.after, change, last.p_value, cps[-2].index if len(cps) > 1 else 0


def busbw_by_op(rows: Sequence[tuple[str, int, float, float]]) -> dict[str, float]:
    """A run's busbw per collective op from its (op, group size, bytes, seconds) sums: Σ bytes × the
    NCCL-tests factor / Σ seconds over the op's groups (ops that moved no bytes are left out)."""
    from fleetscope.wire import busbw_factor

    acc: dict[str, list[float]] = {}
    for op, n, nbytes, secs in rows:
        if nbytes > 0 and secs > 0:
            a = acc.setdefault(op, [0.0, 0.0])
            a[0] += nbytes * busbw_factor(op, n)
            a[1] += secs
    return {f"busbw:{op}": b / t for op, (b, t) in sorted(acc.items()) if b > 0}


def _primary_metric(members: list[RunWithFigures]) -> str:
    if all(f.tokens_per_s_per_gpu for _, f in members):
        return "tokens_per_s_per_gpu"
    return "step_s"


def _windows(members: Sequence[RunWithFigures], i: int, lo: int) -> dict[str, list[int]]:
    """The runs a cause is measured over: the last ≤ WINDOW of the good regime, the first ≤ WINDOW bad."""
    return {"good_runs": [r.id for r, _ in members[max(lo, i - WINDOW):i]],
            "bad_runs": [r.id for r, _ in members[i:i + WINDOW]]}


def _run_regression(members: Sequence[RunWithFigures], skey: str, metric: str, unit: str, vals: list[float],
                    res: tuple[int, float, float, float, float, int], details: dict[str, Any]) -> Regression:
    i, before, after, change, p, lo = res
    bad = members[i][0]
    return Regression(
        kind="run_series", series=skey, metric=metric, unit=unit, before=before, after=after, change=change,
        significance=p,
        first_bad={"run_id": bad.id, "run": bad.name, "commit": bad.git_commit, "started_at": bad.started_at, "index": i},
        run_id=members[-1][0].id, url_path=f"/runs/{bad.id}",
        details={**details, "runs": [r.id for r, _ in members], "values": vals,
                 "good_commit": members[i - 1][0].git_commit if i > 0 else None, **_windows(members, i, lo)},
    )


def _metric_values(members: Sequence[RunWithFigures], metric: str,
                   extra: Mapping[int, Mapping[str, float]]) -> list[float] | None:
    raw = [f.get(metric) if not metric.startswith("busbw:") else extra.get(r.id, {}).get(metric) for r, f in members]
    if any(v is None or not math.isfinite(float(v)) for v in raw):
        return None
    return [float(v) for v in raw if v is not None]


def _namespace(members: Sequence[RunWithFigures]) -> tuple[str, ...]:
    """The owner namespace of a series' runs as a series-key part: () for runs without owner (the keys
    series had before namespaces), (owner_key,) otherwise — so two teams' series of one family and setup
    are two series, and one's evaluation never resolves the other's alert."""
    ns = getattr(members[0][0], "owner_key", "") if members else ""
    return (ns,) if ns else ()


def run_series_regressions(runs: Sequence[RunWithFigures], *, run_ids: Collection[int] | None = None,
                           extra: Mapping[int, Mapping[str, float]] | None = None,
                           ) -> tuple[list[Regression], set[str]]:
    """Regressions of the run series (comparable runs in start order) formed by ``runs`` — one
    family's runs with their figures — that contain one of ``run_ids`` (all when None), and the
    series evaluated: the primary metric, else the secondary ones (``SECONDARY_METRICS``, plus
    ``busbw:<op>`` from ``extra`` = {run id: {"busbw:<op>": B/s}}), and the family's setup switches.
    Each regression's ``details`` carries ``good_runs``/``bad_runs``, the runs its cause is measured over."""
    extra = extra or {}
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
        skey = series_key("runs", *key, *_namespace(members))
        evaluated.add(skey)
        details = {"scope": "comparable", "family": key[0], "config_signature": key[1], "device_type": key[2],
                   "world_size": key[3]}
        secondary: list[tuple[str, str, list[float], tuple[int, float, float, float, float, int]]] = []
        busbw = sorted({m for r, _ in members for m in extra.get(r.id, {})})
        for m, (u, h) in [*SECONDARY_METRICS.items(), *((b, ("B/s", True)) for b in busbw)]:
            sv = _metric_values(members, m, extra)
            if sv is None:
                continue
            sres = _last_regression(sv, higher_is_better=h)
            if sres is None:
                continue
            if m in _COMPONENT_KEYS:
                i, lo = sres[0], sres[5]
                step_before = np.median([f.step_s or 0.0 for _, f in members[lo:i]])
                if abs(sres[2] - sres[1]) < MIN_COMPONENT_STEP_SHARE * step_before:
                    continue  # a component that moved a negligible part of the step
            secondary.append((m, u, sv, sres))
        vals = _metric_values(members, metric, extra)
        res = _last_regression(vals, higher_is_better=hib) if vals is not None else None
        if res is not None and vals is not None:
            also = [{"metric": m, "unit": u, "before": r[1], "after": r[2], "change": r[3], "index": r[0]}
                    for m, u, _, r in secondary]
            found.append(_run_regression(members, skey, metric, unit, vals, res, {**details, "also_regressed": also}))
            continue
        for m, u, sv, sres in secondary:  # the primary metric did not regress: each stands on its own
            found.append(_run_regression(members, skey, m, u, sv, sres, {**details, "primary_metric": metric}))
    f2, e2 = _switch_regressions(runs, run_ids)
    return found + f2, evaluated | e2


def _switch_regressions(runs: Sequence[RunWithFigures],
                        run_ids: Collection[int] | None) -> tuple[list[Regression], set[str]]:
    """Per (family, device type): a regression exactly at the family's latest switch of comparable
    setup (config signature, world size), when the runs before it share one setup and the runs
    from it share another (module docstring)."""
    found: list[Regression] = []
    evaluated: set[str] = set()
    fams: dict[tuple[Any, Any], list[RunWithFigures]] = {}
    for run, fig in runs:
        if fig.steps >= MIN_RUN_STEPS:
            fams.setdefault((run.model_family, run.device_type), []).append((run, fig))
    for (family, device), members in fams.items():
        if run_ids is not None and not any(r.id in run_ids for r, _ in members):
            continue
        members.sort(key=lambda m: (m[0].started_at or "", m[0].id))
        skey = series_key("family", family, device, *_namespace(members))
        evaluated.add(skey)
        keys = [comparable_key(r) for r, _ in members]
        j = len(keys) - 1
        while j > 0 and keys[j - 1] == keys[-1]:
            j -= 1
        if j == 0:
            continue  # one setup only: the comparable series covers it
        k = j - 1
        while k > 0 and keys[k - 1] == keys[j - 1] and j - k < SWITCH_BASELINE_RUNS:
            k -= 1
        seq = members[k:]
        metric = next((m for m in ("tokens_per_s_per_gpu", "mfu") if _metric_values(seq, m, {}) is not None), None)
        if metric is None:
            continue
        unit, hib = METRICS[metric]
        vals = _metric_values(seq, metric, {}) or []
        res = _last_regression(vals, higher_is_better=hib)
        if res is None or abs(res[0] - (j - k)) > 1:
            continue  # no regression, or not at the switch
        if res[0] != j - k:
            # a run off: when the run next to the switch is the extreme of its side, the rank statistic ties
            # with (and prefers) the more balanced split; the setups say where the change is
            before, after = float(np.median(vals[: j - k])), float(np.median(vals[j - k:]))
            change = (after - before) / abs(before)
            if (-change if hib else change) < MIN_CHANGE:
                continue
            res = (j - k, before, after, change, res[4], 0)
        good, bad = members[j - 1][0], members[j][0]
        found.append(_run_regression(seq, skey, metric, unit, vals, res, {
            "scope": "family", "family": family, "device_type": device, "world_size": bad.world_size,
            "config_signature": bad.config_signature,
            "switch": {"from": {"config_signature": good.config_signature, "world_size": good.world_size},
                       "to": {"config_signature": bad.config_signature, "world_size": bad.world_size}}}))
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


MAX_ALERT_RANKS = 64  # ranks an alert's details list


def slow_node_findings(run_id: int, network: dict[str, Any] | None, hosts: Mapping[int, tuple[str | None, str | None]],
                       *, steps: int) -> tuple[list[Regression], set[str]]:
    """One ``slow_node`` finding per node the run's network analysis (``analysis.network``, the summary's
    ``network``) calls slow, and the series evaluated: one per (run, node) of the run's nodes, so a node
    that is no longer slow resolves and ``dedup_key`` is unique per (run, node). ``after`` = the node's
    network slowdown: the larger of 1 / busbw_ratio and latency_ratio (the time its collectives take over
    the time the median rank's speed would take). Nothing is evaluated before ``STRAGGLER_MIN_STEPS``
    compacted steps or when nothing was measured (collective blocks gone): alerts stay as they are."""
    if not network or network.get("source") is None or steps < STRAGGLER_MIN_STEPS:
        return [], set()
    ranks_of: dict[str, list[int]] = {}
    host_of: dict[str, str | None] = {}
    for rank, (host, node) in hosts.items():
        if node or host:
            ranks_of.setdefault(str(node or host), []).append(int(rank))
            host_of.setdefault(str(node or host), host)
    evaluated = {series_key("slow_node", run_id, n) for n in ranks_of}
    found: list[Regression] = []
    for sn in network.get("slow_nodes") or []:
        node = str(sn["node"])
        b, lat = sn.get("busbw_ratio"), sn.get("latency_ratio")
        slow = max(1.0 / b if b else 1.0, float(lat) if lat else 1.0)
        on = sorted(ranks_of.get(node, []))
        found.append(Regression(
            kind="slow_node", series=series_key("slow_node", run_id, node), metric="node_network_slowdown", unit="x",
            before=1.0, after=slow, change=slow - 1.0, significance=None,
            first_bad={"run_id": run_id, "node": node, "host": host_of.get(node)},
            run_id=run_id, url_path=f"/runs/{run_id}",
            details={"node": node, "host": host_of.get(node), "busbw_ratio": b, "latency_ratio": lat,
                     "ranks": on[:MAX_ALERT_RANKS], "node_ranks": len(on), "measured_ranks": sn.get("ranks"),
                     "slow_ranks": sn.get("slow_ranks"), "slow_nodes": network.get("slow_nodes_total"),
                     "steps_sampled": network.get("steps_sampled"), "source": network.get("source"),
                     "thresholds": network.get("thresholds")},
        ))
    return found, evaluated


def _baseline(runs: Sequence[RunWithFigures], run: RunRow) -> tuple[list[RunWithFigures], str]:
    others = [(r, f) for r, f in runs if r.id != run.id and f.steps >= MIN_RUN_STEPS
              and (r.started_at or "") <= (run.started_at or "")]
    strict = [(r, f) for r, f in others if comparable_key(r) == comparable_key(run)]
    if strict:
        return strict, "family + config signature + device + world size"
    loose = [(r, f) for r, f in others if (r.device_type, r.world_size) == (run.device_type, run.world_size)]
    return loose, "family + device + world size (no run with the same config signature)"


def _verdict(fig: RunFigures, base: Sequence[RunWithFigures]) -> list[dict[str, Any]]:
    """The metrics on which ``fig`` regressed against the median of ``base`` (empty: no regression)."""
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
    return regs


def passing_baseline(runs: Sequence[RunWithFigures], *, pinned: int | None = None,
                     max_baseline: int = 20) -> tuple[list[RunWithFigures], int | None]:
    """The baseline ``runs`` (earlier comparable runs, in start order) give: from the pinned run on when
    one of them is pinned (else from the first), each later run joins it only when it passed against the
    baseline of its time — so a regression that is never fixed never becomes the baseline, however many
    runs repeat it. Returns (the latest ``max_baseline`` runs of the baseline, the pinned run's id when
    the pin was found among ``runs``)."""
    order = sorted(runs, key=lambda m: (m[0].started_at or "", m[0].id))
    start = next((i for i, (r, _f) in enumerate(order) if r.id == pinned), None) if pinned is not None else None
    pool = order[start:] if start is not None else order
    accepted: list[RunWithFigures] = []
    for m in pool:
        if not accepted or not _verdict(m[1], accepted[-max_baseline:]):
            accepted.append(m)
    return accepted[-max_baseline:], (pinned if start is not None else None)


def check_verdict(me: RunWithFigures, family: Sequence[RunWithFigures], shift: Regression | None, *,
                  max_baseline: int = 20, pinned: int | None = None) -> dict[str, Any]:
    """Is this run a regression against its baseline? (``fleetscope check``): its figures against the
    median of the latest ``max_baseline`` runs of its baseline — the earlier comparable runs of
    ``family`` that passed, from the ``pinned`` run on when there is one (:func:`passing_baseline`) —
    plus its own within-run step-time shift."""
    run, fig = me
    cands, how = _baseline(family, run)
    base, pin_used = passing_baseline(cands, pinned=pinned, max_baseline=max_baseline)
    if pin_used is not None:
        how += f"; from the pinned run {pin_used} on"
    regs = _verdict(fig, base)
    if shift is not None:
        regs.append({"metric": "step_s (within run)", "unit": "s", "before": shift.before, "after": shift.after,
                     "change": shift.change, "p_value": shift.significance, "first_bad_step": shift.first_bad["step"]})
    return {
        "run": {"id": run.id, "name": run.name, "model_family": run.model_family, "world_size": run.world_size,
                "device_type": run.device_type, "git_commit": run.git_commit},
        "baseline": {"runs": [r.id for r, _ in base], "match": how, "pinned": pin_used,
                     "basis": ("the pinned run and the runs that passed after it" if pin_used is not None
                               else "the earlier comparable runs that passed (a regression never joins them)")},
        "regressions": regs,
        "regressed": bool(regs),
        "min_change": MIN_CHANGE,
    }
