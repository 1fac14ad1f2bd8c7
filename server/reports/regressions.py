"""Regressions: the detections the alert worker reconciles, ``check`` of one run, the alerts and
benchmark series as the API and the Regressions/Benchmarks pages show them, and the series an alert
was raised on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from ..analysis import regressions as rg
from ..downsample import minmax_series
from ..store import alerts, benchmarks, steps
from ..store import runs as run_store
from .runs import figures, stragglers, with_figures

__all__ = [
    "run_series_regressions",
    "benchmark_regressions",
    "step_shift_regression",
    "straggler_finding",
    "check_run",
    "list_alerts",
    "get_alert",
    "alerts_view",
    "alert_series",
    "benchmark_series",
    "benchmarks_view",
]


def run_series_regressions(engine: Engine, *, run_ids: Sequence[int] | None = None) -> tuple[list[rg.Regression], set[str]]:
    """Regressions of the run series containing ``run_ids`` (all series when None), and the series evaluated."""
    fams = run_store.families(engine) if run_ids is None else run_store.families_of(engine, run_ids)
    found: list[rg.Regression] = []
    evaluated: set[str] = set()
    for fam in fams:
        f, e = rg.run_series_regressions(with_figures(engine, run_store.family_runs(engine, fam)), run_ids=run_ids)
        found += f
        evaluated |= e
    return found, evaluated


def benchmark_regressions(engine: Engine, *, series_ids: Sequence[int] | None = None) -> tuple[list[rg.Regression], set[str]]:
    """Regressions of benchmark series (all when ``series_ids`` is None)."""
    series = benchmarks.series(engine, series_ids=series_ids)
    return rg.benchmark_regressions([(s.id, s.name, s.cluster, s.params, s.unit, pts) for s, pts in series])


def step_shift_regression(engine: Engine, run_id: int) -> rg.Regression | None:
    """A change point in the run's median step time that made steps slower."""
    x, y = steps.step_tail(engine, run_id, rg.STEP_SERIES_MAX)
    return rg.step_shift_regression(run_id, x, y)


def straggler_finding(engine: Engine, run_id: int) -> rg.Regression | None:
    """A run with persistent stragglers: one alert per run naming the worst rank or node."""
    return rg.straggler_finding(run_id, stragglers(engine, run_id))


def check_run(engine: Engine, run_id: int, *, max_baseline: int = 20) -> dict[str, Any] | None:
    """Is this run a regression against its family's baseline? (``fleetscope check``); None for no such run."""
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    family = run_store.family_runs(engine, run.model_family) if run.model_family is not None else [run]
    figs = figures(engine, [*family, run])
    return rg.check_verdict((run, figs[run.id]), [(r, figs[r.id]) for r in family],
                            step_shift_regression(engine, run_id), max_baseline=max_baseline)


def list_alerts(engine: Engine, *, state: str | None = None, kind: str | None = None, run_id: int | None = None,
                limit: int = 500) -> list[dict[str, Any]]:
    """Alerts newest first, optionally by state, kind or run."""
    return alerts.list_alerts(engine, state=state, kind=kind, run_id=run_id, limit=limit)


def get_alert(engine: Engine, alert_id: int) -> dict[str, Any] | None:
    return alerts.get_alert(engine, alert_id)


def alerts_view(engine: Engine, *, state: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    """Alerts, newest first, optionally by state, with their run's name and family."""
    return alerts.alerts_with_runs(engine, state=state, limit=limit)


_RUN_METRICS = {"tokens_per_s", "step_s", "step_s_p95", "mfu", "packing_efficiency", "data_s", "compute_s",
                "comm_exposed_s", "other_s", "mem_peak_bytes"}


def alert_series(engine: Engine, alert: dict[str, Any], *, max_points: int = 1000) -> dict[str, Any] | None:
    """The series an alert was raised on, with the change point (``change_index`` into x, or ``change_x``).

    By kind (``analysis.regressions``): ``run_series`` → the metric over the comparable runs
    (``details.runs``/``details.values``) in start order; ``benchmark`` → the benchmark's points;
    ``step_time_shift`` (or any ``first_bad.step``) → the run's step time (min/max reduced). Without
    details: the metric over the family's runs of the same world size and device."""
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
        return {"x": red.x.tolist(), "y": red.y.tolist(), "labels": None, "change_x": first_bad["step"], "xlabel": "step",
                "metric": "step_s", "unit": "s", "factor": red.factor, "source": "run steps"}
    if run_id and metric in _RUN_METRICS:
        base = run_store.get_run(engine, int(run_id), pending=False)
        if base is None:
            return None
        runs = run_store.comparable_runs(engine, base.model_family, base.world_size, base.device_type)[::-1]  # oldest first
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
    return None


def benchmark_series(engine: Engine, *, cluster: str | None = None, name: str | None = None,
                     series_id: int | None = None, points: int = 1000) -> list[dict[str, Any]]:
    """Benchmark series with their latest ``points`` points, as the API shows them."""
    out = []
    for s, pts in benchmarks.series(engine, cluster=cluster, name=name,
                                    series_ids=[series_id] if series_id is not None else None, limit_points=points):
        out.append({"id": s.id, "name": s.name, "cluster": s.cluster, "params": s.params, "unit": s.unit,
                    "points": [{"ts": t.isoformat(), "value": v, "git_commit": g} for t, v, g in pts]})
    return out


def benchmarks_view(engine: Engine) -> list[dict[str, Any]]:
    """Microbenchmark series (name, cluster, params, unit) with their points in time order."""
    return benchmarks.series_with_points(engine)
