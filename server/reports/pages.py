"""Run page data for the dashboard: per-section reports, reduced for charts (``downsample``), each
saying by how much (``factor``: source points per plotted point), and cached until the run changes."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Engine

from .. import rank_matrix
from ..analysis import parallel
from ..analysis.bottlenecks import physical_ceiling
from ..analysis.figures import COMPONENT_LABELS, COMPONENTS, SHARE_KEYS, mfu, tokens_per_s
from ..downsample import mean_buckets, minmax_series, sum_buckets
from ..store import collectives, steps
from ..store import runs as run_store
from . import _cache
from .runs import collective_efficiency, figures, parallel_summary, run_summary, stragglers

__all__ = [
    "run_page_summary",
    "run_series",
    "modality_series",
    "collectives_view",
    "straggler_view",
    "bottleneck_report",
    "ranking_from_shares",
    "rank_heatmap",
    "rank_slowdown",
    "comm_dim_series",
    "comm_by_dim_of_runs",
]

_SERIES_COLUMNS = ("step", "n_ranks", "step_s", "step_s_max", "data_s", "compute_s", "comm_exposed_s", "other_s",
                   "flops_per_dev_s", "tokens_per_s_raw", "padded_tokens", "packing", "mem_peak_bytes",
                   "mem_reserved_bytes", "alloc_retries", "neg_residual")


def run_page_summary(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """``run_summary`` for the run page, reused until the run changes."""
    return _cache.cached_by_id("summary", engine, run_id, lambda: run_summary(engine, run_id))


def run_series(engine: Engine, run_id: int, *, max_points: int = 600) -> dict[str, Any]:
    """Per-step series of a run, reduced for charts: decomposition (mean per bucket), step time of the
    median and slowest rank (min/max per bucket), MFU, throughput, memory, packing efficiency."""
    return _cache.cached_by_id(("series", max_points), engine, run_id, lambda: _run_series(engine, run_id, max_points))


def _run_series(engine: Engine, run_id: int, max_points: int) -> dict[str, Any]:
    run = run_store.get_run(engine, run_id, pending=False)
    s = steps.load_steps(engine, run_id, _SERIES_COLUMNS)
    x = s.steps
    out: dict[str, Any] = {"n_steps": int(x.size)}
    if not x.size or run is None:
        return out
    xb, comps, f = mean_buckets(x, {k: s[k] for k, _ in COMPONENTS}, max_points)
    out["decomposition"] = {"step": xb, **comps, "factor": f}
    out["step_s"] = minmax_series(x, s["step_s"], 2 * max_points)
    out["step_s_max"] = minmax_series(x, s["step_s_max"], 2 * max_points)
    if run.peak_flops:
        m = mfu(s["flops_per_dev_s"], run.peak_flops)
        bad = m > 1.0  # implausible (more FLOPs than peak × step time): not drawn, counted
        if np.any(bad):
            out["mfu_implausible_steps"] = int(np.sum(bad))
            m = np.where(bad, np.nan, m)
        out["mfu"] = minmax_series(x, m, 2 * max_points)
    tps = tokens_per_s(s["tokens_per_s_raw"], run.mp_size)
    if np.any(~np.isnan(tps)):
        out["tokens_per_s"] = minmax_series(x, tps, 2 * max_points)
    if np.nansum(s["padded_tokens"]) > 0:
        out["packing"] = minmax_series(x, s["packing"], 2 * max_points)
    if np.any(~np.isnan(s["mem_peak_bytes"])):
        out["mem_peak_bytes"] = minmax_series(x, s["mem_peak_bytes"], 2 * max_points)
        out["mem_reserved_bytes"] = minmax_series(x, s["mem_reserved_bytes"], 2 * max_points)
    retries = np.nan_to_num(s["alloc_retries"])
    out["alloc_retry_steps"] = x[retries > 0][:500]
    out["neg_residual_steps"] = int(np.nansum(s["neg_residual"]))
    return out


def modality_series(engine: Engine, run_id: int, *, max_points: int = 400) -> dict[str, Any] | None:
    """Tokens per modality per step (summed per bucket of steps); None when the run has none."""
    return _cache.cached_by_id(("modalities", max_points), engine, run_id,
                               lambda: _modality_series(engine, run_id, max_points))


def _modality_series(engine: Engine, run_id: int, max_points: int) -> dict[str, Any] | None:
    rows = collectives.run_modalities(engine, run_id)
    if not rows:
        return None
    x = np.unique(np.array([r[0] for r in rows], dtype=np.int64))
    idx = {s: i for i, s in enumerate(x.tolist())}
    mods: dict[str, np.ndarray] = {}
    for step, mod, tok in rows:
        mods.setdefault(mod, np.full(x.size, np.nan))[idx[step]] = tok
    xb, sums, f = sum_buckets(x, mods, max_points)
    totals = {m: float(np.nansum(v)) for m, v in mods.items()}
    return {"step": xb, "tokens": sums, "factor": f, "totals": totals}


def collectives_view(engine: Engine, run_id: int) -> dict[str, Any]:
    """Collectives by op × group × message size, most time first, with busbw and — where the run
    declares its topology (``meta.topology``) — efficiency = busbw / peak of the group's slowest link."""
    return _cache.cached_by_id("collectives_view", engine, run_id, lambda: _collectives_view(engine, run_id))


def _collectives_view(engine: Engine, run_id: int) -> dict[str, Any]:
    eff = collective_efficiency(engine, run_id)
    if eff is None:
        return {"rows": [], "efficiency_large_messages": None,
                "note": "link peak unknown: declare meta.topology to get efficiency"}
    rows = sorted(eff["collectives"], key=lambda r: -r["total_s"])
    return {"rows": rows, "efficiency_large_messages": eff["efficiency_large_messages"], "note": eff["note"]}


def straggler_view(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The straggler report for the run page (None for no such run)."""
    return _cache.cached_by_id("straggler_view", engine, run_id, lambda: stragglers(engine, run_id))


def ranking_from_shares(shares: dict[str, float] | None, step_s: float | None) -> list[dict[str, Any]]:
    """Components ranked by share of step time, with seconds of the median step and Amdahl ceiling."""
    if not shares:
        return []
    out: list[dict[str, Any]] = []
    for k, p in shares.items():
        key = SHARE_KEYS.get(k, k)
        p = float(p or 0.0)
        out.append({"component": COMPONENT_LABELS.get(key, k), "key": key, "share": p, "seconds": p * (step_s or 0.0),
                    "max_speedup": physical_ceiling(k, p)})  # None for compute, under 10 % or over 90 %
    out.sort(key=lambda d: -d["share"])
    return out


def bottleneck_report(engine: Engine, run_id: int, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary's bottlenecks as the run page ranks them, each with its findings (``source``:
    "analysis"; "none" when the run has no decomposition yet)."""
    summary = summary if summary is not None else (run_page_summary(engine, run_id) or {})
    comps = summary.get("bottlenecks") or []
    if not comps:
        return {"ranking": [], "findings": [], "source": "none"}
    ranking = ranking_from_shares({c["component"]: c["share"] for c in comps},
                                  (summary.get("decomposition") or {}).get("step_s"))
    by_key = {SHARE_KEYS.get(c["component"], c["component"]): c for c in comps}
    for r in ranking:
        r["findings"] = list(by_key.get(r["key"], {}).get("findings") or [])
        r["max_speedup"] = by_key.get(r["key"], {}).get("max_speedup")  # the summary's: only for a ranked cause
    return {"ranking": ranking, "findings": [f for r in ranking for f in r["findings"]], "source": "analysis"}


def rank_heatmap(engine: Engine, run_id: int, *, field: str = "step_s", how: str = "max", max_ranks: int = 256,
                 max_steps: int = 400) -> dict[str, Any] | None:
    """Ranks × steps of ``field`` reduced server-side (``rank_matrix.rank_heatmap``)."""
    return rank_matrix.rank_heatmap(engine, run_id, field=field, how=how, max_ranks=max_ranks, max_steps=max_steps)


def rank_slowdown(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """Per-rank slowdown and per-node medians (``rank_matrix.rank_slowdown``)."""
    return rank_matrix.rank_slowdown(engine, run_id)


def comm_dim_series(engine: Engine, run_id: int, *, max_points: int = 600) -> dict[str, Any]:
    """Per step, each parallel dimension's exposed and total communication seconds (cross-rank
    medians; ``analysis.parallel.comm_dim_series``): ``{"steps": [...], "dims": {dim: {"exposed_s",
    "total_s"}}}``, thinned to ``max_points`` steps."""
    return _cache.cached_by_id(("comm_dim_series", max_points), engine, run_id,
                               lambda: parallel.comm_dim_series(collectives.step_comm(engine, run_id), max_points))


def comm_by_dim_of_runs(engine: Engine, run_ids: list[int]) -> dict[int, dict[str, dict[str, float]]]:
    """``comm_by_dim`` of each run (the summary's figure), for the compare and scaling pages: only the
    parallelism part of the summary (cached per run version), not the whole summary of every run."""
    runs = run_store.runs_by_ids(engine, run_ids)
    figs = figures(engine, list(runs.values()))
    return {rid: (parallel_summary(engine, runs[rid], figs[rid])["comm_by_dim"] if rid in runs else {}) for rid in run_ids}
