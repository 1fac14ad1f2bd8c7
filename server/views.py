"""Page data for the dashboard: batched and downsampled reads on top of the query layer.

The dashboard never issues SQL itself; it calls these functions (and ``queries``), so every number
it shows comes from the same definitions (metrics.md) as the JSON API. Large series are reduced
here, and each result says by how much (``factor``: source points per plotted point).
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
import threading
from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from . import queries
from .downsample import mean_buckets, minmax_series, sum_buckets
from .rank_matrix import rank_heatmap, rank_slowdown

__all__ = [
    "COMPONENTS",
    "amdahl_ranking",
    "run_summaries",
    "fleet_rows",
    "families",
    "run_options",
    "run_series",
    "modality_series",
    "collectives_view",
    "run_events",
    "run_traces",
    "analysis",
    "compare_view",
    "scaling_view",
    "alerts_view",
    "alert_series",
    "benchmarks_view",
    "rank_heatmap",
    "rank_slowdown",
]

log = logging.getLogger(__name__)

#: the step-time components in stacking order: (key, label)
COMPONENTS = (("data_s", "data"), ("compute_s", "compute"), ("comm_exposed_s", "exposed comm"), ("other_s", "other"))

_SUMMARY_SQL = """
SELECT st.run_id,
       count(*) AS n_steps,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.step_s) AS step_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY st.step_s_max) AS step_s_p95,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.data_s) AS data_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.compute_s) AS compute_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.comm_exposed_s) AS comm_exposed_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.other_s) AS other_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.comm_total_s) AS comm_total_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.work_s_max - st.work_s) AS straggler_wait_s,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.flops / (st.n_ranks * nullif(st.step_s, 0) * r.peak_flops)) AS mfu,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY st.tokens / greatest(r.mp_size, 1) / nullif(st.step_s, 0))
           AS tokens_per_s,
       sum(st.tokens) / nullif(sum(st.padded_tokens), 0) AS packing_efficiency,
       max(st.mem_peak_bytes) AS mem_peak_bytes,
       max(st.ts) AS last_ts
FROM steps st JOIN runs r ON r.id = st.run_id
WHERE st.run_id = ANY(:ids) AND st.n_ranks > 0
GROUP BY st.run_id
"""

_RUN_COLS = (
    "id, name, model_family, config, config_signature, world_size, mp_size, device_type, device_count, peak_flops, "
    "git_commit, status, meta, started_at, finished_at, last_seen_at, rank_steps, collective_records, steps, last_step"
)

_summary_cache: dict[tuple[int, int], tuple[tuple[Any, ...], dict[str, Any]]] = {}
_summary_lock = threading.Lock()


def amdahl_ranking(decomposition: dict[str, float | None], straggler_wait_s: float | None = None) -> list[dict[str, Any]]:
    """Components ranked by their Amdahl ceiling 1/(1-p), p = share of the step (metrics.md).

    The straggler wait is the part of exposed comm spent waiting for the slowest rank, so it is split
    out of exposed comm (the shares then add up to the step)."""
    step = decomposition.get("step_s")
    if not step or step <= 0:
        return []
    parts = {k: decomposition.get(k) for k, _ in COMPONENTS}
    wait = max(0.0, straggler_wait_s or 0.0)
    if parts.get("comm_exposed_s") is not None and wait:
        wait = min(wait, parts["comm_exposed_s"] or 0.0)
        parts["comm_exposed_s"] = (parts["comm_exposed_s"] or 0.0) - wait
        parts["straggler_wait_s"] = wait
    labels = dict(COMPONENTS) | {"straggler_wait_s": "straggler wait"}
    out = []
    for k, v in parts.items():
        if v is None:
            continue
        p = min(max(v / step, 0.0), 0.999)
        out.append({"component": labels[k], "key": k, "seconds": v, "share": p, "max_speedup": 1.0 / (1.0 - p)})
    out.sort(key=lambda d: -d["share"])
    return out


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, dt.datetime) else v


def _runs(c: Any, where: str = "", params: dict[str, Any] | None = None, limit: int = 2000) -> list[dict[str, Any]]:
    sql = f"SELECT {_RUN_COLS} FROM runs {where} ORDER BY started_at DESC, id DESC LIMIT :limit"
    return [{k: _iso(v) for k, v in r._mapping.items()} for r in c.execute(text(sql), {**(params or {}), "limit": limit})]


def run_summaries(engine: Engine, runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Summary figures of many runs in one set-based query (same definitions as ``run_summary``).

    A run whose counters did not change since the last call is served from a per-process cache, so
    a fleet of finished runs costs one small query for the runs that are still moving."""
    out: dict[int, dict[str, Any]] = {}
    todo: list[int] = []
    sig = {r["id"]: (r.get("steps"), r.get("rank_steps"), r.get("last_step"), r.get("status")) for r in runs}
    with _summary_lock:
        for rid, s in sig.items():
            hit = _summary_cache.get((id(engine), rid))
            if hit is not None and hit[0] == s:
                out[rid] = hit[1]
            else:
                todo.append(rid)
    if todo:
        with engine.connect() as c:
            rows = c.execute(text(_SUMMARY_SQL), {"ids": todo}).fetchall()
        got = {}
        for row in rows:
            d = dict(row._mapping)
            rid = d.pop("run_id")
            decomposition = {k: d[k] for k in ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s")}
            d["decomposition"] = decomposition
            d["bottlenecks"] = amdahl_ranking(decomposition, d["straggler_wait_s"])
            got[rid] = d
        with _summary_lock:
            for rid in todo:
                d = got.get(rid) or {"n_steps": 0, "decomposition": {}, "bottlenecks": []}
                _summary_cache[(id(engine), rid)] = (sig[rid], d)
                out[rid] = d
    return out


def fleet_rows(
    engine: Engine, *, family: str | None = None, status: str | None = None, q: str | None = None, limit: int = 2000
) -> list[dict[str, Any]]:
    """Runs (newest first) with their summary figures, top bottleneck and firing alert count."""
    where, params = [], {}
    if family:
        where.append("model_family = :family")
        params["family"] = family
    if status:
        where.append("status = :status")
        params["status"] = status
    if q:
        where.append("name ILIKE :q")
        params["q"] = f"%{q}%"
    with engine.connect() as c:
        runs = _runs(c, ("WHERE " + " AND ".join(where)) if where else "", params, limit)
        alerts = dict(
            c.execute(
                text("SELECT run_id, count(*) FROM alerts WHERE state = 'firing' AND run_id = ANY(:ids) GROUP BY run_id"),
                {"ids": [r["id"] for r in runs]},
            ).fetchall()
        )
    sums = run_summaries(engine, runs)
    out = []
    for r in runs:
        s = sums.get(r["id"], {})
        top = (s.get("bottlenecks") or [None])[0]
        tps = s.get("tokens_per_s")
        out.append(
            {
                "id": r["id"],
                "name": r["name"],
                "model_family": r["model_family"],
                "world_size": r["world_size"],
                "device_type": r["device_type"],
                "status": r["status"],
                "started_at": r["started_at"],
                "last_seen_at": r["last_seen_at"],
                "git_commit": r["git_commit"],
                "steps": s.get("n_steps", 0),
                "mfu": s.get("mfu"),
                "tokens_per_s": tps,
                "tokens_per_s_per_gpu": tps / r["world_size"] if tps is not None and r["world_size"] else None,
                "step_s_p50": s.get("step_s"),
                "step_s_p95": s.get("step_s_p95"),
                "top_bottleneck": top,
                "alerts_firing": int(alerts.get(r["id"], 0)),
                "config_signature": r["config_signature"],
            }
        )
    return out


def families(engine: Engine) -> list[str]:
    """Model families with at least one run."""
    with engine.connect() as c:
        return [r[0] for r in c.execute(text("SELECT DISTINCT model_family FROM runs WHERE model_family IS NOT NULL ORDER BY 1"))]


def run_options(engine: Engine, limit: int = 1000) -> list[dict[str, Any]]:
    """(id, name, family, world size) of recent runs, for pickers."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT id, name, model_family, world_size FROM runs ORDER BY started_at DESC, id DESC LIMIT :n"), {"n": limit}
        ).fetchall()
    return [dict(r._mapping) for r in rows]


def run_series(engine: Engine, run_id: int, *, max_points: int = 600) -> dict[str, Any]:
    """Per-step series of a run, reduced for charts: decomposition (mean per bucket), step time of the
    median and slowest rank (min/max per bucket), MFU, throughput, memory, packing efficiency."""
    run = queries.get_run(engine, run_id) or {}
    s = queries.run_steps(engine, run_id)
    steps = s["step"]
    out: dict[str, Any] = {"n_steps": int(steps.size)}
    if not steps.size:
        return out
    x, comps, f = mean_buckets(steps, {k: s[k] for k, _ in COMPONENTS}, max_points)
    out["decomposition"] = {"step": x, **comps, "factor": f}
    out["step_s"] = minmax_series(steps, s["step_s"], 2 * max_points)
    out["step_s_max"] = minmax_series(steps, s["step_s_max"], 2 * max_points)
    peak = run.get("peak_flops")
    mp = max(1, run.get("mp_size") or 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        if peak:
            out["mfu"] = minmax_series(steps, s["flops"] / (s["n_ranks"] * s["step_s"] * peak), 2 * max_points)
        tps = s["tokens"] / mp / s["step_s"]
        if np.any(~np.isnan(tps)):
            out["tokens_per_s"] = minmax_series(steps, tps, 2 * max_points)
        if np.nansum(s["padded_tokens"]) > 0:
            out["packing"] = minmax_series(steps, s["tokens"] / s["padded_tokens"], 2 * max_points)
    if np.any(~np.isnan(s["mem_peak_bytes"])):
        out["mem_peak_bytes"] = minmax_series(steps, s["mem_peak_bytes"], 2 * max_points)
        out["mem_reserved_bytes"] = minmax_series(steps, s["mem_reserved_bytes"], 2 * max_points)
    retries = np.nan_to_num(s["alloc_retries"])
    out["alloc_retry_steps"] = steps[retries > 0][:500]
    out["neg_residual_steps"] = int(np.nansum(s["neg_residual"]))
    return out


def modality_series(engine: Engine, run_id: int, *, max_points: int = 400) -> dict[str, Any] | None:
    """Tokens per modality per step (summed per bucket of steps); None when the run has none."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, modality, tokens FROM run_modalities WHERE run_id = :id ORDER BY step"), {"id": run_id}
        ).fetchall()
    if not rows:
        return None
    steps = np.unique(np.array([r[0] for r in rows], dtype=np.int64))
    idx = {s: i for i, s in enumerate(steps.tolist())}
    mods: dict[str, np.ndarray] = {}
    for step, mod, tok in rows:
        mods.setdefault(mod, np.full(steps.size, np.nan))[idx[step]] = tok
    x, sums, f = sum_buckets(steps, mods, max_points)
    totals = {m: float(np.nansum(v)) for m, v in mods.items()}
    return {"step": x, "tokens": sums, "factor": f, "totals": totals}


def _topology(run: dict[str, Any]) -> dict[str, Any]:
    meta = run.get("meta") or {}
    cfg = run.get("config") or {}
    return meta.get("topology") or cfg.get("topology") or {}


def collectives_view(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Collectives by op × group × message size with busbw and, where the run declares its topology
    (``meta.topology``: ``intra_node_bytes_per_s``, ``inter_node_bytes_per_s``, ``gpus_per_node``),
    efficiency = busbw / peak of the group's slowest link."""
    eff = analysis("collective_efficiency", engine, run_id=run_id)
    if isinstance(eff, list) and eff:
        return eff
    rows = queries.run_collectives(engine, run_id)
    run = queries.get_run(engine, run_id) or {}
    topo = _topology(run)
    per_node = topo.get("gpus_per_node")
    for r in rows:
        peak = None
        if topo:
            inter = per_node is not None and r["group_size"] > int(per_node)
            peak = topo.get("inter_node_bytes_per_s" if inter else "intra_node_bytes_per_s")
        r["link_peak_bytes_per_s"] = peak
        bus = r.get("busbw_bytes_per_s")
        r["efficiency"] = bus / peak if bus is not None and peak else None
    return rows


def run_events(engine: Engine, run_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """Run events (checkpoints, evals, restarts, ...) in time order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, seq, kind, ts, step, data FROM run_events WHERE run_id = :id ORDER BY ts NULLS LAST, rank, seq "
                 "LIMIT :n"),
            {"id": run_id, "n": limit},
        ).fetchall()
    return [dict(r._mapping) for r in rows]


def run_traces(engine: Engine, run_id: int) -> Any:
    """Trace summaries of a run via ``traces_store.run_traces`` when that module exists, else None."""
    try:
        mod = importlib.import_module(f"{__package__}.traces_store")
    except ImportError:
        return None
    fn = getattr(mod, "run_traces", None)
    if fn is None:
        return None
    try:
        return fn(engine, run_id)
    except Exception:  # noqa: BLE001 - an optional section must not break the run page
        log.exception("run_traces failed for run %s", run_id)
        return None


def analysis(name: str, engine: Engine, **kwargs: Any) -> Any:
    """Call ``server.analysis.<module>.<name>`` when it exists; None when it does not (yet) or fails.

    Looks for ``name`` in ``server.analysis`` first, then in a submodule of the same name."""
    try:
        pkg = importlib.import_module(f"{__package__}.analysis")
    except ImportError:
        return None
    fn = getattr(pkg, name, None)
    if fn is None:
        try:
            fn = getattr(importlib.import_module(f"{__package__}.analysis.{name}"), name, None)
        except ImportError:
            return None
    if not callable(fn):
        return None
    try:
        return fn(engine, **kwargs)
    except Exception:  # noqa: BLE001 - analysis is optional on a page; its failure is logged, not shown as data
        log.exception("analysis %s(%s) failed", name, kwargs)
        return None


def _normalised(r: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    ws = r.get("world_size") or 1
    tps = s.get("tokens_per_s")
    per_gpu = tps / ws if tps is not None else None
    step = s.get("step_s")
    tokens_per_step_gpu = per_gpu * step if per_gpu is not None and step else None
    return {
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": s.get("mfu"),
        "step_s": step,
        "step_s_p95": s.get("step_s_p95"),
        # step time per 1k tokens processed by one GPU (ms): comparable across batch sizes and scales
        "step_ms_per_1k_tokens": (step * 1e3 / (tokens_per_step_gpu / 1e3)) if tokens_per_step_gpu else None,
        "packing_efficiency": s.get("packing_efficiency"),
        "mem_peak_bytes": s.get("mem_peak_bytes"),
        **{k: (s.get("decomposition") or {}).get(k) for k, _ in COMPONENTS},
    }


def compare_view(engine: Engine, run_ids: list[int], *, max_points: int = 400) -> dict[str, Any]:
    """Runs side by side: normalised metrics, config diff and step-time series aligned by step."""
    with engine.connect() as c:
        runs = _runs(c, "WHERE id = ANY(:ids)", {"ids": run_ids}, limit=len(run_ids) or 1)
    by_id = {r["id"]: r for r in runs}
    ordered = [by_id[i] for i in run_ids if i in by_id]
    sums = run_summaries(engine, ordered)
    metrics = {r["id"]: _normalised(r, sums.get(r["id"], {})) for r in ordered}
    keys = sorted({k for r in ordered for k in (r.get("config") or {})})
    config_rows = []
    for k in keys:
        vals = [(r.get("config") or {}).get(k) for r in ordered]
        config_rows.append({"key": k, "values": vals, "differs": len({repr(v) for v in vals}) > 1})
    series = {}
    for r in ordered:
        s = queries.run_steps(engine, r["id"], ("step", "step_s"))
        if s["step"].size:
            series[r["id"]] = minmax_series(s["step"], s["step_s"], max_points)
    missing = [i for i in run_ids if i not in by_id]
    return {"runs": ordered, "metrics": metrics, "config": config_rows, "series": series, "missing": missing}


_SCALING_VOLATILE = ("batch", "world", "seed", "nodes", "gpus", "name")


def _config_group(r: dict[str, Any]) -> str:
    cfg = {k: v for k, v in (r.get("config") or {}).items() if not any(t in k.lower() for t in _SCALING_VOLATILE)}
    items = ", ".join(f"{k}={cfg[k]}" for k in sorted(cfg))
    return f"{r.get('device_type') or '?'}" + (f" · {items}" if items else "")


def scaling_view(engine: Engine, family: str) -> dict[str, Any]:
    """Throughput and scaling efficiency against world size per configuration of a family.

    Per (configuration, world size) the median over runs; weak-scaling efficiency
    (throughput(n)/n)/(throughput(n0)/n0) when the global batch grows with n, strong-scaling
    (step(n0)·n0)/(step(n)·n) when it is fixed (metrics.md "Scaling")."""
    with engine.connect() as c:
        runs = _runs(c, "WHERE model_family = :f", {"f": family}, limit=5000)
    sums = run_summaries(engine, runs)
    groups: dict[str, dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]] = {}
    for r in runs:
        s = sums.get(r["id"]) or {}
        if not s.get("n_steps") or s.get("tokens_per_s") is None:
            continue
        groups.setdefault(_config_group(r), {}).setdefault(int(r["world_size"]), []).append((r, s))
    out = []
    for name, by_n in groups.items():
        sizes = sorted(by_n)
        pts = []
        batches = set()
        for n in sizes:
            items = by_n[n]
            for r, _ in items:
                gb = next((v for k, v in (r.get("config") or {}).items() if "global_batch" in k.lower()), None)
                batches.add(repr(gb))
            med = {k: float(np.median([s[k] for _, s in items if s.get(k) is not None] or [np.nan]))
                   for k in ("tokens_per_s", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "mfu")}
            pts.append({"world_size": n, "runs": [r["id"] for r, _ in items], "run_names": [r["name"] for r, _ in items], **med})
        strong = len(batches) == 1 and "None" not in batches and len(sizes) > 1
        n0, p0 = sizes[0], pts[0]
        for p in pts:
            n = p["world_size"]
            if strong:
                p["efficiency"] = (p0["step_s"] * n0) / (p["step_s"] * n) if p["step_s"] else None
            else:
                p["efficiency"] = (p["tokens_per_s"] / n) / (p0["tokens_per_s"] / n0) if p0["tokens_per_s"] else None
            p["ideal_tokens_per_s"] = p0["tokens_per_s"] * n / n0
        out.append({"config": name, "mode": "strong" if strong else "weak", "points": pts})
    out.sort(key=lambda g: -len(g["points"]))
    return {"family": family, "configs": out, "n_runs": len(runs)}


def alerts_view(engine: Engine, *, state: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
    """Alerts, newest first, optionally by state."""
    sql = (
        "SELECT a.id, a.kind, a.metric, a.state, a.run_id, r.name AS run_name, r.model_family, a.before, a.after, "
        "a.change, a.significance, a.first_bad, a.details, a.url, a.created_at, a.updated_at, a.resolved_at "
        "FROM alerts a LEFT JOIN runs r ON r.id = a.run_id"
    )
    params: dict[str, Any] = {"n": limit}
    if state:
        sql += " WHERE a.state = :state"
        params["state"] = state
    sql += " ORDER BY a.created_at DESC, a.id DESC LIMIT :n"
    with engine.connect() as c:
        return [dict(r._mapping) for r in c.execute(text(sql), params)]


_RUN_METRICS = {"tokens_per_s", "step_s", "step_s_p95", "mfu", "packing_efficiency", "data_s", "compute_s",
                "comm_exposed_s", "other_s", "mem_peak_bytes"}


def alert_series(engine: Engine, alert: dict[str, Any], *, max_points: int = 1000) -> dict[str, Any] | None:
    """The series an alert was raised on, with the index of the change point.

    Uses ``details.series`` when the detector stored it; otherwise rebuilds it: a change within a run
    (``first_bad.step``) → that run's step time; a run-level metric → the metric over the comparable
    runs of the family (same world size and device) in start order, the first bad run marked."""
    details = alert.get("details") or {}
    first_bad = alert.get("first_bad") or {}
    ser = details.get("series")
    if isinstance(ser, dict) and "y" in ser:
        y = ser["y"]
        x = ser.get("x") or list(range(len(y)))
        return {"x": x, "y": y, "labels": ser.get("labels"), "change_index": details.get("change_index", first_bad.get("index")),
                "xlabel": ser.get("xlabel", "index"), "source": "detector"}
    if isinstance(ser, list) and ser:
        return {"x": list(range(len(ser))), "y": ser, "labels": None, "change_index": details.get("change_index"),
                "xlabel": "index", "source": "detector"}
    run_id = alert.get("run_id") or first_bad.get("run_id")
    if first_bad.get("step") is not None and run_id:
        s = queries.run_steps(engine, int(run_id), ("step", "step_s"))
        red = minmax_series(s["step"], s["step_s"], max_points)
        return {"x": red.x.tolist(), "y": red.y.tolist(), "labels": None, "change_x": first_bad["step"], "xlabel": "step",
                "metric": "step_s", "factor": red.factor, "source": "run steps"}
    metric = alert.get("metric")
    if run_id and metric in _RUN_METRICS:
        with engine.connect() as c:
            base = c.execute(text("SELECT model_family, world_size, device_type FROM runs WHERE id = :id"), {"id": run_id}).fetchone()
            if base is None:
                return None
            runs = _runs(
                c, "WHERE model_family IS NOT DISTINCT FROM :f AND world_size = :w AND device_type IS NOT DISTINCT FROM :d",
                {"f": base[0], "w": base[1], "d": base[2]}, limit=1000,
            )
        runs.reverse()  # oldest first
        sums = run_summaries(engine, runs)
        xs, ys, labels, change = [], [], [], None
        bad_id = first_bad.get("run_id") or run_id
        for r in runs:
            s = sums.get(r["id"]) or {}
            v = s.get(metric) if metric in s else (s.get("decomposition") or {}).get(metric)
            if v is None:
                continue
            if r["id"] == bad_id:
                change = len(xs)
            xs.append(r["started_at"])
            ys.append(v)
            labels.append(f"{r['name']} ({r.get('git_commit') or 'no commit'})")
        return {"x": xs, "y": ys, "labels": labels, "change_index": change, "xlabel": "run start", "metric": metric,
                "source": "family runs"}
    return None


def benchmarks_view(engine: Engine) -> list[dict[str, Any]]:
    """Microbenchmark series (name, cluster, params, unit) with their points in time order."""
    with engine.connect() as c:
        series = [dict(r._mapping) for r in c.execute(
            text("SELECT id, name, cluster, params_key, params, unit FROM benchmark_series ORDER BY name, cluster, params_key"))]
        pts = c.execute(
            text("SELECT series_id, ts, value, git_commit FROM benchmark_points ORDER BY series_id, ts")
        ).fetchall()
    by: dict[int, list[tuple[Any, float, Any]]] = {}
    for sid, ts, v, commit in pts:
        by.setdefault(sid, []).append((ts, v, commit))
    for s in series:
        p = by.get(s["id"], [])
        s["ts"] = [t for t, _, _ in p]
        s["value"] = [v for _, v, _ in p]
        s["git_commit"] = [g for _, _, g in p]
    return series
