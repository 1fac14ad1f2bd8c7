"""Regressions: the detections the alert worker reconciles, ``check`` of one run, the alerts and
benchmark series as the API and the Regressions/Benchmarks pages show them, and the series an alert
was raised on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from ..analysis import explain
from ..analysis import regressions as rg
from ..analysis.figures import RunFigures
from ..analysis.parallel import comm_by_dim
from ..downsample import minmax_series
from ..store import alert_inputs, alerts, baselines, benchmarks, collectives, steps
from ..store import runs as run_store
from ..store.rows import RunRow
from . import _cache, scope
from .devices import straggler_device_cause
from .network import network_findings
from .runs import figures, stragglers, with_figures
from .tokens import run_token_balance

__all__ = [
    "run_series_regressions",
    "benchmark_regressions",
    "step_shift_regression",
    "straggler_finding",
    "slow_node_findings",
    "check_run",
    "list_alerts",
    "get_alert",
    "alerts_view",
    "alert_explanation",
    "alert_series",
    "benchmark_series",
    "benchmarks_view",
    "explain_run_regression",
]


def run_series_regressions(engine: Engine, *, run_ids: Sequence[int] | None = None) -> tuple[list[rg.Regression], set[str]]:
    """Regressions of the run series containing ``run_ids`` (all series when None), and the series
    evaluated; each regression's ``details`` carries its ``cause`` and ``diff`` (``analysis.explain``)."""
    fams = run_store.families(engine) if run_ids is None else run_store.families_of(engine, run_ids)
    found: list[rg.Regression] = []
    evaluated: set[str] = set()
    for fam in fams:
        # one series per owner namespace: another team's runs never enter a team's baseline
        for owned in _by_namespace(run_store.family_runs(engine, fam)):
            if run_ids is not None and not any(r.id in run_ids for r in owned):
                continue
            runs = with_figures(engine, owned)
            sums = alert_inputs.collective_sums(engine, [r.id for r, f in runs if f.steps >= rg.MIN_RUN_STEPS])
            extra = {rid: rg.busbw_by_op([(op, n, b, t) for op, n, _d, b, t, _e in rows]) for rid, rows in sums.items()}
            f, e = rg.run_series_regressions(runs, run_ids=run_ids, extra=extra)
            by_id = {r.id: (r, fig) for r, fig in runs}
            for reg in f:
                explain_run_regression(engine, reg, by_id, sums)
            found += f
            evaluated |= e
    return found, evaluated


def _by_namespace(runs: Sequence[RunRow]) -> list[list[RunRow]]:
    """The runs split by owner namespace (``runs.owner_key``), each list in the given order."""
    out: dict[str, list[RunRow]] = {}
    for r in runs:
        out.setdefault(r.owner_key, []).append(r)
    return list(out.values())


def _same_namespace(runs: Sequence[RunRow], run: RunRow) -> list[RunRow]:
    return [r for r in runs if r.owner_key == run.owner_key]


def _run_comm(engine: Engine, run: RunRow, fig: RunFigures, sums: list[alert_inputs.CollectiveSum]) -> explain.RunComm:
    """({dim: exposed s per step}, {(dim, op): exposed s per rank-step}) of one run (cached per run version)."""
    def compute() -> explain.RunComm:
        dims = {d: v["exposed_s"] for d, v in comm_by_dim(collectives.step_comm(engine, run.id)).items()}
        per = max(1, fig.steps) * max(1, run.world_size)
        ops: dict[tuple[str, str], float] = {}
        for op, _n, dim, _b, _t, exp in sums:
            k = (dim or "unknown", op)
            ops[k] = ops.get(k, 0.0) + exp / per
        return dims, ops

    return _cache.cached("explain_comm", engine, run, compute)


def explain_run_regression(engine: Engine, reg: rg.Regression, by_id: dict[int, tuple[RunRow, RunFigures]],
                           sums: dict[int, list[alert_inputs.CollectiveSum]] | None = None) -> None:
    """Put ``cause`` (the component that explains the step-time change between the regression's good and
    bad runs) and ``diff`` (last good run vs first bad run) into a run-series regression's ``details``."""
    good_ids = [i for i in reg.details.get("good_runs") or [] if i in by_id]
    bad_ids = [i for i in reg.details.get("bad_runs") or [] if i in by_id]
    if not good_ids or not bad_ids:
        return
    sums = sums if sums is not None else alert_inputs.collective_sums(engine, good_ids + bad_ids)
    comm = {i: _run_comm(engine, by_id[i][0], by_id[i][1], sums.get(i, [])) for i in good_ids + bad_ids}
    reg.details["cause"] = explain.cause_of_runs([by_id[i][1] for i in good_ids], [by_id[i][1] for i in bad_ids],
                                                 comm_good=[comm[i] for i in good_ids], comm_bad=[comm[i] for i in bad_ids])
    good, bad = by_id[good_ids[-1]][0], by_id[bad_ids[0]][0]
    nodes = alert_inputs.run_nodes(engine, [good.id, bad.id])
    reg.details["diff"] = explain.run_diff(good, bad, good_nodes=nodes.get(good.id), bad_nodes=nodes.get(bad.id))


def benchmark_regressions(engine: Engine, *, series_ids: Sequence[int] | None = None) -> tuple[list[rg.Regression], set[str]]:
    """Regressions of benchmark series (all when ``series_ids`` is None); ``details.diff`` holds the commits
    of the last good and the first bad point (a benchmark has no step decomposition: no cause)."""
    series = benchmarks.series(engine, series_ids=series_ids)
    found, evaluated = rg.benchmark_regressions([(s.id, s.name, s.cluster, s.params, s.unit, pts) for s, pts in series])
    for reg in found:
        reg.details["diff"] = {"commit": [reg.details.get("good_commit"), reg.first_bad.get("commit")]}
    return found, evaluated


def step_shift_regression(engine: Engine, run_id: int) -> rg.Regression | None:
    """A change point in the run's median step time that made steps slower, with ``details.cause``: the
    component that explains it (median over the run's steps before the first slow step vs from it)."""
    x, y = steps.step_tail(engine, run_id, rg.STEP_SERIES_MAX)
    reg = rg.step_shift_regression(run_id, x, y)
    if reg is not None:
        cols = alert_inputs.step_components_tail(engine, run_id, rg.STEP_SERIES_MAX)
        idx = int((cols["step"] < reg.first_bad["step"]).sum())
        reg.details["cause"] = explain.cause_of_steps(cols, idx)
    return reg


def straggler_finding(engine: Engine, run_id: int) -> rg.Regression | None:
    """A run with persistent stragglers: one alert per run naming the worst rank or node, with
    ``details.cause`` (the component of the worst straggler's excess work, ``explain.straggler_cause``)
    and ``details.diff`` (that rank versus its peers, ``explain.rank_diff``)."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    rep = stragglers(engine, run_id)
    reg = rg.straggler_finding(run_id, rep)
    if reg is None or rep is None:
        return reg
    top = next((s for s in rep["stragglers"] if s["rank"] == reg.first_bad.get("rank")), None)
    if top is None:
        return reg
    fig = figures(engine, [run])[run.id]
    reg.details["cause"] = explain.straggler_cause(top, fig.decomposition)
    dev = straggler_device_cause(engine, run_id, int(top["rank"]), top.get("slowdown"), top.get("component"))
    if dev is not None:  # its GPU throttled or logged errors: the reason goes into the alert's cause
        reg.details["cause"] = {**(reg.details["cause"] or {"basis": "rank_vs_median", "rank": top["rank"],
                                                             "slowdown": top.get("slowdown")}),
                                "reason": dev["reason"], "device": dev}
    tokens = run_token_balance(engine, run) if fig.tokens_per_rank_step else None
    reg.details["diff"] = explain.rank_diff(top, alert_inputs.rank_placement(engine, run_id),
                                            [s["rank"] for s in rep["stragglers"] if s["kind"] == "persistent"],
                                            tokens=tokens)
    return reg


def slow_node_findings(engine: Engine, run_id: int) -> tuple[list[rg.Regression], set[str]]:
    """The run's network-slow nodes (the summary's ``network.slow_nodes``) as ``slow_node`` findings, one
    per (run, node), and the per-(run, node) series evaluated (``analysis.regressions.slow_node_findings``)."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return [], set()
    net, hosts = network_findings(engine, run)
    return rg.slow_node_findings(run_id, net, hosts, steps=run.steps)


def check_run(engine: Engine, run_id: int, *, max_baseline: int = 20) -> dict[str, Any] | None:
    """Is this run a regression against its family's baseline? (``fleetscope check``); None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    # the baseline: the family's runs of the run's own namespace (its team's, or its token's)
    family = (_same_namespace(run_store.family_runs(engine, run.model_family), run) if run.model_family is not None
              else [run])
    figs = figures(engine, [*family, run])
    pinned = (baselines.pinned_run(engine, owner_key=run.owner_key, family=run.model_family,
                                   signature=run.config_signature or "")
              if run.model_family is not None else None)
    return rg.check_verdict((run, figs[run.id]), [(r, figs[r.id]) for r in family],
                            step_shift_regression(engine, run_id), max_baseline=max_baseline, pinned=pinned)


def pin_baseline(engine: Engine, run_id: int, *, by: str | None = None) -> dict[str, Any] | None:
    """Pin ``run_id`` as the baseline of its namespace, family and config signature (``fleetscope baseline
    pin``); None for no such run (or one the reader may not see). A run without a family cannot be pinned
    (ValueError)."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None or not scope.is_visible(engine, run_id):
        return None
    if run.model_family is None:
        raise ValueError(f"run {run_id} has no model family: a baseline is per family and config signature")
    baselines.pin(engine, owner_key=run.owner_key, family=run.model_family, signature=run.config_signature or "",
                  run_id=run_id, by=by)
    return {"run_id": run_id, "name": run.name, "model_family": run.model_family,
            "config_signature": run.config_signature or ""}


def list_baselines(engine: Engine) -> list[dict[str, Any]]:
    """The pinned baselines the current reader may see, newest first."""
    keys = scope.visible_keys()
    return baselines.list_pins(engine, None if keys is None else sorted(keys))


def alert_explanation(alert: dict[str, Any]) -> str | None:
    """The alert's one-sentence explanation (``analysis.explain.explanation``) from its cause and diff."""
    return explain.explanation(alert["metric"], alert.get("change"), alert.get("before"), alert.get("after"),
                               (alert.get("details") or {}).get("unit"), alert.get("cause"), alert.get("diff"))


def _explained(a: dict[str, Any]) -> dict[str, Any]:
    a["explanation"] = alert_explanation(a)
    return a


def list_alerts(engine: Engine, *, state: str | None = None, kind: str | None = None, run_id: int | None = None,
                limit: int = 500) -> list[dict[str, Any]]:
    """Alerts newest first, optionally by state, kind or run; each with ``cause``, ``diff`` and ``explanation``."""
    return [_explained(a) for a in _visible_alerts(
        engine, alerts.list_alerts(engine, state=state, kind=kind, run_id=run_id, limit=limit))]


def _visible_alerts(engine: Engine, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerts the current reader may see: those of its runs, and those of no run (benchmarks)."""
    if scope.visible_keys() is None:
        return rows
    return [a for a in rows if a.get("run_id") is None or scope.is_visible(engine, int(a["run_id"]))]


def get_alert(engine: Engine, alert_id: int) -> dict[str, Any] | None:
    a = alerts.get_alert(engine, alert_id)
    if a is None or not _visible_alerts(engine, [a]):
        return None
    return _explained(a)


def alerts_view(engine: Engine, *, state: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    """Alerts, newest first, optionally by state, with their run's name and family and the explanation."""
    return [_explained(a) for a in _visible_alerts(engine, alerts.alerts_with_runs(engine, state=state, limit=limit))]


_RUN_METRICS = {"tokens_per_s", "step_s", "step_s_p95", "mfu", "packing_efficiency", "data_s", "compute_s",
                "comm_exposed_s", "other_s", "mem_peak_bytes"}


def alert_series(engine: Engine, alert: dict[str, Any], *, max_points: int = 1000) -> dict[str, Any] | None:
    """The series an alert was raised on, with the change point (``change_index`` into x, or ``change_x``).

    By kind (``analysis.regressions``): ``run_series`` → the metric over the comparable runs
    (``details.runs``/``details.values``) in start order; ``benchmark`` → the benchmark's points;
    ``step_time_shift`` (or any ``first_bad.step``) → the run's step time (min/max reduced). Without
    details: the metric over the family's runs of the same world size and device; an alert on one run's
    finding (``slow_node``, a straggler) otherwise → that run's step time, without a change point."""
    details = alert.get("details") or {}
    first_bad = alert.get("first_bad") or {}
    metric = alert.get("metric")
    run_ids = details.get("runs")
    values = details.get("values")
    if isinstance(run_ids, list) and isinstance(values, list) and len(run_ids) == len(values) and run_ids:
        rows = run_store.runs_by_ids(engine, [int(i) for i in run_ids])
        xs: list[Any] = []
        labels = []
        for i, rid in enumerate(run_ids):
            r = rows.get(int(rid))
            xs.append(r.started_at if r is not None else i)
            labels.append(f"{r.name} · {r.git_commit or 'no commit'}" if r is not None else f"run {rid}")
        return {"x": xs, "y": [float(v) if v is not None else None for v in values], "labels": labels,
                "run_ids": [int(i) for i in run_ids], "change_index": first_bad.get("index"), "xlabel": "run start",
                "metric": metric, "unit": details.get("unit"), "source": "comparable runs"}
    sid = details.get("series_id") or first_bad.get("series_id")
    if alert.get("kind") == "benchmark" and sid is not None:
        pts = benchmarks.points(engine, int(sid))
        return {"x": [p[0].isoformat() for p in pts], "y": [p[1] for p in pts], "labels": [p[2] or "" for p in pts],
                "change_index": first_bad.get("index"), "xlabel": "time", "metric": metric, "unit": details.get("unit"),
                "source": "benchmark points"}
    run_id = alert.get("run_id") or first_bad.get("run_id")
    if first_bad.get("step") is not None and run_id:
        s = steps.load_steps(engine, int(run_id), ("step", "step_s"))
        red = minmax_series(s.steps, s["step_s"], max_points)
        # a straggler's "step" is where it was first seen: no change in the step time of its own, and at the
        # run's first step (slow from the start) nothing changed at all — marked only when it came later
        change_x = first_bad["step"]
        if alert.get("kind") == "straggler" and (not len(s.steps) or change_x <= int(s.steps.min())):
            change_x = None
        return {"x": red.x.tolist(), "y": red.y.tolist(), "labels": None, "change_x": change_x, "xlabel": "step",
                "metric": "step_s", "unit": "s", "factor": red.factor, "source": "run steps"}
    if run_id and metric in _RUN_METRICS:
        base = run_store.get_run(engine, int(run_id), pending=False)
        if base is None:
            return None
        runs = _same_namespace(run_store.comparable_runs(engine, base.model_family, base.world_size,
                                                         base.device_type), base)[::-1]  # oldest first
        figs = figures(engine, runs)
        xs, ys, labels, change = [], [], [], None
        bad_id = first_bad.get("run_id") or run_id
        for r in runs:
            v = figs[r.id].get(metric)
            if v is None:
                continue
            if r.id == bad_id:
                change = len(xs)
            xs.append(r.started_at)
            ys.append(v)
            labels.append(f"{r.name} · {r.git_commit or 'no commit'}")
        return {"x": xs, "y": ys, "labels": labels, "change_index": change, "xlabel": "run start", "metric": metric,
                "source": "family runs"}
    if run_id:  # a run's own finding (a slow node, a straggler): the run's step time, for context
        s = steps.load_steps(engine, int(run_id), ("step", "step_s"))
        if len(s.steps):
            red = minmax_series(s.steps, s["step_s"], max_points)
            return {"x": red.x.tolist(), "y": red.y.tolist(), "labels": None, "change_x": None, "xlabel": "step",
                    "metric": "step_s", "unit": "s", "factor": red.factor, "source": "run steps"}
    return None


def benchmark_series(engine: Engine, *, cluster: str | None = None, name: str | None = None,
                     series_id: int | None = None, points: int = 1000) -> list[dict[str, Any]]:
    """Benchmark series with their latest ``points`` points, as the API shows them."""
    out = []
    for s, pts in benchmarks.series(engine, cluster=cluster, name=name,
                                    series_ids=[series_id] if series_id is not None else None, limit_points=points,
                                    owners=scope.visible_keys()):
        out.append({"id": s.id, "name": s.name, "cluster": s.cluster, "params": s.params, "unit": s.unit,
                    "points": [{"ts": t.isoformat(), "value": v, "git_commit": g} for t, v, g in pts]})
    return out


def benchmarks_view(engine: Engine) -> list[dict[str, Any]]:
    """Microbenchmark series (name, cluster, params, unit) with their points in time order."""
    return benchmarks.series_with_points(engine, scope.visible_keys())
