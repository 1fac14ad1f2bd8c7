"""Bottleneck attribution (docs/metrics.md): each component's share of step time and its Amdahl ceiling.

Per step, from the cross-rank medians of the ``steps`` rollup: data, compute, other, exposed comm
and straggler wait (max work − median work over ranks). In a synchronous job the median rank does
that waiting *inside* its collectives, so the wait is carved out of its exposed comm (never counted
twice); shares are sums over steps divided by the summed total, so they add up to 1. Eliminating a
component of share p speeds a step up by at most 1/(1 − p). Components are ranked by that ceiling;
findings name a cause where the data shows one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Engine

__all__ = ["run_bottlenecks", "summary_bottlenecks", "FINDING_LIMITS"]

#: thresholds of the findings (documented in docs/analysis.md)
FINDING_LIMITS = {
    "overlap_ratio_low": 0.5,  # less than half of the communication hidden behind compute
    "comm_share_min": 0.05,  # ... and exposed comm is at least 5 % of the step
    "busbw_efficiency_low": 0.5,  # large-message busbw below half the link peak
    "mfu_low": 0.35,  # MFU below 35 % ...
    "compute_bound_share": 0.6,  # ... while compute is at least 60 % of the step
    "data_rank_factor": 2.0,  # a rank's data share at least 2x the median rank's ...
    "data_rank_share": 0.05,  # ... and at least 5 % of its step time
    "data_share_high": 0.1,  # data loading at least 10 % of the step on most ranks
    "straggler_share": 0.02,  # waiting for stragglers at least 2 % of the step
}

_NAMES = {
    "data": "data loading",
    "compute": "compute",
    "comm_exposed": "exposed communication",
    "other": "other (host overhead, launch gaps, idle)",
    "straggler_wait": "waiting for the slowest rank",
}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.1f}%"


def _shares(s: dict[str, np.ndarray]) -> dict[str, float] | None:
    def tot(k: str) -> float:
        v = s[k]
        return float(np.nansum(v)) if v.size else 0.0

    wait_steps = np.clip(np.nan_to_num(s["work_s_max"] - s["work_s"]), 0, None)
    exposed = np.nan_to_num(s["comm_exposed_s"])
    wait_in = np.minimum(wait_steps, exposed)
    parts = {
        "data": tot("data_s"),
        "compute": tot("compute_s"),
        "comm_exposed": float(np.sum(exposed - wait_in)),
        "other": tot("other_s"),
        "straggler_wait": float(np.sum(wait_in)),
    }
    total = sum(parts.values())
    if total <= 0:
        return None
    return {k: v / total for k, v in parts.items()}


def _data_stall_ranks(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Ranks whose data share is far above the median rank's (from the per-rank rollups)."""
    from sqlalchemy import text

    lim = FINDING_LIMITS
    with engine.connect() as c:
        med, n = c.execute(
            text("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY data_s / nullif(step_s, 0)), count(*) "
                 "FROM rank_rollups WHERE run_id = :id AND steps > 0"),
            {"id": run_id},
        ).one()
        if not n or n < 2:
            return []
        bar = max(lim["data_rank_share"], lim["data_rank_factor"] * max(float(med or 0.0), 1e-9))
        rows = c.execute(
            text(
                "SELECT r.rank, k.host, r.data_s / r.step_s FROM rank_rollups r LEFT JOIN ranks k "
                "ON k.run_id = r.run_id AND k.rank = r.rank WHERE r.run_id = :id AND r.steps > 0 AND r.step_s > 0 "
                "AND r.data_s / r.step_s >= :bar ORDER BY 3 DESC LIMIT :lim"
            ),
            {"id": run_id, "bar": bar, "lim": int(n) // 4 + 1},
        ).fetchall()
    # "some ranks only": a minority; when most ranks stall it is the data component's own finding
    if len(rows) > int(n) // 4:
        return []
    return [{"rank": int(r[0]), "host": r[1], "data_share": float(r[2])} for r in rows]


def run_bottlenecks(
    engine: Engine,
    run_id: int,
    *,
    steps: dict[str, np.ndarray] | None = None,
    summary: dict[str, Any] | None = None,
    stragglers: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The bottleneck report: components ranked by Amdahl ceiling, each with its findings.

    ``steps``/``summary``/``stragglers`` may be passed by a caller that already has them (the
    run summary does), to avoid reading them twice."""
    from ..queries import get_run, run_steps
    from .collectives import collective_efficiency
    from .stragglers import run_stragglers

    if summary is None:
        run = get_run(engine, run_id)
        if run is None:
            return None
    else:
        run = summary["run"]
    s = steps if steps is not None else run_steps(engine, run_id)
    out: dict[str, Any] = {"run_id": run_id, "components": [], "findings": []}
    if not s["step"].size:
        return out
    shares = _shares(s)
    if shares is None:
        return out
    findings: dict[str, list[str]] = {k: [] for k in shares}
    lim = FINDING_LIMITS

    # exposed communication: overlap and link efficiency
    comm_total, exposed = np.nansum(s["comm_total_s"]), np.nansum(s["comm_exposed_s"])
    wait_total = float(np.nansum(np.clip(np.nan_to_num(s["work_s_max"] - s["work_s"]), 0, None)))
    overlap = None
    if comm_total > 0:
        # the straggler wait sits inside both exposed and total comm time: leave it out of the overlap
        w = min(wait_total, exposed)
        overlap = float(1 - max(exposed - w, 0) / max(comm_total - w, 1e-12))
        if overlap < lim["overlap_ratio_low"] and shares["comm_exposed"] >= lim["comm_share_min"]:
            findings["comm_exposed"].append(
                f"low overlap: only {_pct(overlap)} of communication is hidden behind compute "
                "(use larger gradient buckets / overlap the all-reduce with backward)"
            )
    eff = collective_efficiency(engine, run_id, run=run)
    if eff and eff["efficiency_large_messages"] is not None:
        e = eff["efficiency_large_messages"]
        if e < lim["busbw_efficiency_low"]:
            findings["comm_exposed"].append(
                f"low bus bandwidth: large collectives reach {_pct(e)} of the link peak (check NCCL settings, "
                "topology, network)"
            )
    # compute: low MFU while compute-bound
    mfu = summary.get("mfu") if summary else None
    if mfu is None and run.get("peak_flops") and s["flops"].size:
        with np.errstate(invalid="ignore", divide="ignore"):
            v = s["flops"] / (s["n_ranks"] * s["step_s"] * run["peak_flops"])
        v = v[np.isfinite(v)]
        mfu = float(np.median(v)) if v.size else None
    if mfu is not None and shares["compute"] >= lim["compute_bound_share"] and mfu < lim["mfu_low"]:
        findings["compute"].append(
            f"low MFU while compute-bound: {_pct(mfu)} of peak with compute {_pct(shares['compute'])} of the step "
            "(kernel efficiency: fusion, larger micro-batches, bf16, compile)"
        )
    # other: allocator retries
    retries = float(np.nansum(s["alloc_retries"])) if s["alloc_retries"].size else 0.0
    if retries > 0:
        findings["other"].append(
            f"allocator retries: the caching allocator had to free and retry {retries:.0f} times "
            "(memory pressure: lower the batch, set expandable_segments, reduce fragmentation)"
        )
    neg = int(np.nansum(s["neg_residual"])) if "neg_residual" in s and s["neg_residual"].size else 0
    if neg:
        findings["other"].append(f"{neg} steps measured a negative residual (timing error), reported not clamped")
    # data: stalls on some ranks only / everywhere
    stall_ranks = _data_stall_ranks(engine, run_id)
    if stall_ranks:
        names = ", ".join(f"rank {x['rank']}" + (f" ({x['host']})" if x["host"] else "") for x in stall_ranks[:5])
        more = f" and {len(stall_ranks) - 5} more" if len(stall_ranks) > 5 else ""
        findings["data"].append(
            f"data stalls on some ranks only: {names}{more} spend up to {_pct(stall_ranks[0]['data_share'])} "
            "of their step waiting for input (their loader workers, disk or network)"
        )
    elif shares["data"] >= lim["data_share_high"]:
        findings["data"].append(
            f"input pipeline stalls: {_pct(shares['data'])} of the step waits for data on most ranks "
            "(more loader workers, prefetch, pinned memory)"
        )
    # straggler wait: name the rank / node
    st = stragglers if stragglers is not None else run_stragglers(engine, run_id)
    if st and st["stragglers"] and shares["straggler_wait"] >= lim["straggler_share"]:
        if st["nodes"]:
            nd = st["nodes"][0]
            findings["straggler_wait"].append(
                f"straggler node {nd['node']}: all {len(nd['ranks'])} of its ranks are {nd['slowdown']:.2f}x slower "
                "than the median rank"
            )
        else:
            top = st["stragglers"][0]
            where = f" on {top['host']}" if top.get("host") else ""
            comp = f", in {top['component']}" if top.get("component") else ""
            findings["straggler_wait"].append(
                f"straggler rank {top['rank']}{where}: {top['slowdown']:.2f}x the median rank's work{comp}"
            )
    comps: list[dict[str, Any]] = []
    for k, p in shares.items():
        ceiling = 1.0 / (1.0 - p) if p < 1 else None
        base = f"{_NAMES[k]}: {_pct(p)} of step time; removing it entirely would speed steps up at most " + (
            f"{ceiling:.2f}x" if ceiling is not None else "without bound"
        )
        comps.append({
            "component": k,
            "share": round(p, 6),
            "max_speedup": round(ceiling, 4) if ceiling is not None else None,
            "finding": findings[k][0] if findings[k] else base,
            "findings": findings[k],
        })
    comps.sort(key=lambda c: -c["share"])
    out["components"] = comps
    out["findings"] = [f for c in comps for f in c["findings"]]
    out["overlap_ratio"] = overlap
    out["mfu"] = mfu
    return out


def summary_bottlenecks(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ``bottlenecks`` list of the run summary (ranked, every component with a share > 0)."""
    if not report:
        return []
    return [c for c in report["components"] if c["share"] > 0]
