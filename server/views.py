"""Page data for the dashboard: batched and downsampled reads on top of the query layer.

The dashboard never issues SQL itself; it calls these functions (and ``queries``), so every number
it shows comes from the same definitions (docs/metrics.md) as the JSON API. Large series are reduced
here, and each result says by how much (``factor``: source points per plotted point).
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from . import queries
from .downsample import mean_buckets, minmax_series, sum_buckets
from .rank_matrix import rank_heatmap, rank_slowdown

__all__ = [
    "COMPONENTS",
    "cached",
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
    "bottleneck_report",
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

_summary_cache: dict[tuple[Any, int], tuple[tuple[Any, ...], dict[str, Any]]] = {}
_summary_lock = threading.Lock()


def _ekey(engine: Engine) -> tuple[int, str]:
    """Cache key of a database: the engine object and its URL (a new database never reuses entries)."""
    return id(engine), str(engine.url)


_page_cache: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = OrderedDict()
_PAGE_CACHE_ENTRIES = 256


def _run_version(engine: Engine, run_id: int) -> tuple[Any, ...] | None:
    with engine.connect() as c:
        row = c.execute(
            text("SELECT rank_steps, collective_records, steps, last_step, status FROM runs WHERE id = :id"), {"id": run_id}
        ).fetchone()
    return tuple(row) if row is not None else None


def cached(name: str, engine: Engine, run_id: int, fn: Any) -> Any:
    """``fn()`` for a run, reused until the run's counters or status change (a finished run's page data is
    computed once per process). Bounded LRU; the check costs one primary-key read."""
    version = _run_version(engine, run_id)
    key = (_ekey(engine), run_id, name)
    with _summary_lock:
        hit = _page_cache.get(key)
        if hit is not None and hit[0] == version:
            _page_cache.move_to_end(key)
            return hit[1]
    value = fn()
    with _summary_lock:
        _page_cache[key] = (version, value)
        _page_cache.move_to_end(key)
        while len(_page_cache) > _PAGE_CACHE_ENTRIES:
            _page_cache.popitem(last=False)
    return value


def amdahl_ranking(decomposition: dict[str, float | None], straggler_wait_s: float | None = None) -> list[dict[str, Any]]:
    """Components ranked by their Amdahl ceiling 1/(1-p), p = share of the step (docs/metrics.md).

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


def _runs(c: Any, where: str = "", params: dict[str, Any] | None = None, limit: int = 2000,
          order: str = "started_at DESC, id DESC") -> list[dict[str, Any]]:
    sql = f"SELECT {_RUN_COLS} FROM runs {where} ORDER BY {order} LIMIT :limit"
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
            hit = _summary_cache.get((_ekey(engine), rid))
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
        stats = analysis("run_stats", engine, run_ids=list(got)) if got else None
        for rid, d in got.items():
            st = (stats or {}).get(rid) or {}
            if st.get("shares"):
                # one definition of the top bottleneck on every page: the analysis layer's shares
                d["bottlenecks"] = _ranking_from_shares(st["shares"], d["step_s"])
        with _summary_lock:
            for rid in todo:
                d = got.get(rid) or {"n_steps": 0, "decomposition": {}, "bottlenecks": []}
                _summary_cache[(_ekey(engine), rid)] = (sig[rid], d)
                out[rid] = d
    return out


def fleet_rows(
    engine: Engine, *, family: str | None = None, status: str | None = None, q: str | None = None, limit: int = 2000
) -> list[dict[str, Any]]:
    """Runs (running ones first, then newest) with their summary figures, top bottleneck and firing alerts."""
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
        # active runs first, then the most recent
        runs = _runs(c, ("WHERE " + " AND ".join(where)) if where else "", params, limit,
                     order="(status = 'running') DESC, started_at DESC, id DESC")
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


def collectives_view(engine: Engine, run_id: int) -> dict[str, Any]:
    """Collectives by op × group × message size with busbw and, where the run declares its topology
    (``meta.topology``), efficiency = busbw / peak of the group's slowest link."""
    eff = analysis("collective_efficiency", engine, run_id=run_id)
    if isinstance(eff, dict) and eff.get("collectives") is not None:
        rows = sorted(eff["collectives"], key=lambda r: -r["total_s"])
        return {"rows": rows, "efficiency_large_messages": eff.get("efficiency_large_messages"), "note": eff.get("note")}
    rows = queries.run_collectives(engine, run_id)
    run = queries.get_run(engine, run_id) or {}
    topo = _topology(run)
    per_node = topo.get("gpus_per_node")
    for r in rows:
        peak = None
        if topo and per_node:
            inter = r["group_size"] > int(per_node)
            peak = topo.get("inter_node_bytes_per_s" if inter else "intra_node_bytes_per_s")
        r["link_peak_bytes_per_s"] = peak
        bus = r.get("busbw_bytes_per_s")
        r["efficiency"] = bus / peak if bus is not None and peak else None
    note = None if topo else "link peak unknown: declare meta.topology to get efficiency"
    return {"rows": rows, "efficiency_large_messages": None, "note": note}


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
    fn = _optional("traces_store", "run_traces")
    return _call(fn, engine, run_id) if fn else None


def _optional(module: str, name: str) -> Any:
    """``server.<module>.<name>`` if it exists (parts written in parallel appear over time), else None."""
    try:
        mod = importlib.import_module(f"{__package__}.{module}")
    except ImportError:
        return None
    fn = getattr(mod, name, None)
    return fn if callable(fn) else None


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an optional section must not break a page; logged, never shown as data
        log.exception("%s failed", getattr(fn, "__qualname__", fn))
        return None


def analysis(name: str, engine: Engine, **kwargs: Any) -> Any:
    """Call an analysis function by its short name when it exists; None when it does not (yet) or fails."""
    fn = _optional(*_ANALYSIS[name]) if name in _ANALYSIS else None
    return _call(fn, engine, **kwargs) if fn else None


_ANALYSIS = {
    "bottlenecks": ("analysis.bottlenecks", "run_bottlenecks"),
    "stragglers": ("analysis.stragglers", "run_stragglers"),
    "collective_efficiency": ("analysis.collectives", "collective_efficiency"),
    "goodput": ("analysis.goodput", "run_goodput"),
    "run_stats": ("analysis.runstats", "run_stats"),
    "scaling": ("analysis.scaling", "scaling"),
    "compare_runs": ("analysis.scaling", "compare_runs"),
}

_KEY_OF = {"data": "data_s", "compute": "compute_s", "comm_exposed": "comm_exposed_s", "other": "other_s",
           "straggler_wait": "straggler_wait_s"}


def _ranking_from_shares(shares: dict[str, float] | None, step_s: float | None) -> list[dict[str, Any]]:
    if not shares:
        return []
    labels = dict(COMPONENTS) | {"straggler_wait_s": "straggler wait"}
    out = []
    for k, p in shares.items():
        key = _KEY_OF.get(k, k)
        p = float(p or 0.0)
        out.append({"component": labels.get(key, k), "key": key, "share": p, "seconds": p * (step_s or 0.0),
                    "max_speedup": 1.0 / (1.0 - p) if p < 1 else None})
    out.sort(key=lambda d: -d["share"])
    return out


def bottleneck_report(engine: Engine, run_id: int, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Components ranked by Amdahl ceiling with findings: the analysis layer's report (as the run
    summary carries it) when present, else shares of the median step (``source`` says which)."""
    summary = summary if summary is not None else (queries.run_summary(engine, run_id) or {})
    comps = summary.get("bottlenecks") or []
    if not comps:
        rep = analysis("bottlenecks", engine, run_id=run_id)
        comps = (rep or {}).get("components") or []
    step = (summary.get("decomposition") or {}).get("step_s")
    if comps:
        ranking = _ranking_from_shares({c["component"]: c["share"] for c in comps}, step)
        by_key = {_KEY_OF.get(c["component"], c["component"]): c for c in comps}
        for r in ranking:
            c = by_key.get(r["key"], {})
            r["findings"] = list(c.get("findings") or ([c["finding"]] if c.get("finding") and c.get("findings") is None else []))
        return {"ranking": ranking, "findings": [f for r in ranking for f in r["findings"]], "source": "analysis"}
    if not summary:
        return {"ranking": [], "findings": [], "source": "none"}
    wait = run_summaries(engine, [summary["run"]]).get(run_id, {}).get("straggler_wait_s")
    return {"ranking": amdahl_ranking(summary["decomposition"], wait), "findings": [], "source": "summary"}


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
    rep = analysis("compare_runs", engine, run_ids=[r["id"] for r in ordered]) if ordered else None
    for row in (rep or {}).get("runs") or []:
        m = metrics.get(row["id"])
        if m is None:
            continue
        # the analysis layer's figures win (one definition for compare, scaling, regressions and check)
        for k in ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_s", "overlap_ratio"):
            if row.get(k) is not None:
                m[k] = row[k]
        if row.get("step_s_per_1k_tokens") is not None:
            m["step_ms_per_1k_tokens"] = row["step_s_per_1k_tokens"] * 1e3
        for k, v in (row.get("decomposition") or {}).items():
            if v is not None:
                m[k] = v
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


_SCALING_VOLATILE = ("batch", "world", "seed", "nodes", "gpus", "name", "dp")
_SHARE_KEYS = ("data", "compute", "comm_exposed", "other", "straggler_wait")


def _config_label(device: str | None, config: dict[str, Any] | None) -> str:
    cfg = {k: v for k, v in (config or {}).items() if not any(t in k.lower() for t in _SCALING_VOLATILE)}
    items = ", ".join(f"{k}={cfg[k]}" for k in sorted(cfg))
    label = f"{device or '?'}" + (f" · {items}" if items else "")
    return label if len(label) <= 90 else label[:87] + "…"


def _scaling_from_analysis(rep: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in rep.get("groups") or []:
        pts = []
        for p in g["points"]:
            step = p.get("step_s")
            shares = p.get("shares") or {}
            comp = {_KEY_OF[k]: (shares.get(k) * step if shares.get(k) is not None and step else None) for k in _SHARE_KEYS}
            pts.append({"world_size": p["world_size"], "runs": p["runs"], "run_names": p["run_names"],
                        "tokens_per_s": p.get("throughput_tokens_per_s"), "ideal_tokens_per_s": p.get("ideal_throughput_tokens_per_s"),
                        "efficiency": p.get("efficiency"), "step_s": step, "mfu": p.get("mfu"), **comp})
        growth = g.get("growing_component")
        out.append({"config": _config_label(g.get("device_type"), g.get("config")), "mode": g.get("mode") or "unknown",
                    "points": pts, "growth": growth.get("explanation") if isinstance(growth, dict) else None})
    return out


def scaling_view(engine: Engine, family: str) -> dict[str, Any]:
    """Throughput and scaling efficiency against world size per configuration of a family.

    The analysis layer's curves when present (``analysis.scaling``); else, per (configuration, world
    size), the median over runs: weak-scaling efficiency (throughput(n)/n)/(throughput(n0)/n0) when
    the global batch grows with n, strong-scaling (step(n0)·n0)/(step(n)·n) when it is fixed."""
    rep = analysis("scaling", engine, family=family)
    if isinstance(rep, dict) and "groups" in rep:
        cfgs = _scaling_from_analysis(rep)
        return {"family": family, "configs": [c for c in cfgs if c["points"]], "source": "analysis"}
    with engine.connect() as c:
        runs = _runs(c, "WHERE model_family = :f", {"f": family}, limit=5000)
    sums = run_summaries(engine, runs)
    groups: dict[str, dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]] = {}
    for r in runs:
        s = sums.get(r["id"]) or {}
        if not s.get("n_steps") or s.get("tokens_per_s") is None:
            continue
        groups.setdefault(_config_label(r.get("device_type"), r.get("config")), {}).setdefault(int(r["world_size"]), []).append((r, s))
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
        out.append({"config": name, "mode": "strong" if strong else "weak", "points": pts, "growth": None})
    out.sort(key=lambda g: -len(g["points"]))
    return {"family": family, "configs": out, "source": "summary"}


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
    """The series an alert was raised on, with the change point (``change_index`` into x, or ``change_x``).

    By kind (server/analysis/regressions.py): ``run_series`` → the metric over the comparable runs
    (``details.runs``/``details.values``) in start order; ``benchmark`` → the benchmark's points;
    ``step_time_shift`` (or any ``first_bad.step``) → the run's step time (min/max reduced). Without
    details: the metric over the family's runs of the same world size and device."""
    details = alert.get("details") or {}
    first_bad = alert.get("first_bad") or {}
    metric = alert.get("metric")
    run_ids = details.get("runs")
    values = details.get("values")
    if isinstance(run_ids, list) and isinstance(values, list) and len(run_ids) == len(values) and run_ids:
        with engine.connect() as c:
            rows = {r.id: r for r in c.execute(text("SELECT id, name, git_commit, started_at FROM runs WHERE id = ANY(:ids)"),
                                                {"ids": [int(i) for i in run_ids]})}
        xs, labels = [], []
        for i, rid in enumerate(run_ids):
            r = rows.get(int(rid))
            xs.append(_iso(r.started_at) if r is not None else i)
            labels.append(f"{r.name} · {r.git_commit or 'no commit'}" if r is not None else f"run {rid}")
        return {"x": xs, "y": [float(v) if v is not None else None for v in values], "labels": labels,
                "run_ids": [int(i) for i in run_ids], "change_index": first_bad.get("index"), "xlabel": "run start",
                "metric": metric, "unit": details.get("unit"), "source": "comparable runs"}
    sid = details.get("series_id") or first_bad.get("series_id")
    if alert.get("kind") == "benchmark" and sid is not None:
        with engine.connect() as c:
            pts = c.execute(text("SELECT ts, value, git_commit FROM benchmark_points WHERE series_id = :id ORDER BY ts"),
                            {"id": int(sid)}).fetchall()
        return {"x": [_iso(p[0]) for p in pts], "y": [float(p[1]) for p in pts], "labels": [p[2] or "" for p in pts],
                "change_index": first_bad.get("index"), "xlabel": "time", "metric": metric, "unit": details.get("unit"),
                "source": "benchmark points"}
    run_id = alert.get("run_id") or first_bad.get("run_id")
    if first_bad.get("step") is not None and run_id:
        s = queries.run_steps(engine, int(run_id), ("step", "step_s"))
        red = minmax_series(s["step"], s["step_s"], max_points)
        return {"x": red.x.tolist(), "y": red.y.tolist(), "labels": None, "change_x": first_bad["step"], "xlabel": "step",
                "metric": "step_s", "unit": "s", "factor": red.factor, "source": "run steps"}
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
            labels.append(f"{r['name']} · {r.get('git_commit') or 'no commit'}")
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
