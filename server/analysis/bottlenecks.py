"""Bottleneck attribution (docs/metrics.md): each component's share of step time and its Amdahl ceiling.

Per step, from the cross-rank medians of the ``steps`` rollup: data, compute, other, exposed comm
and straggler wait (max work − median work over ranks). In a synchronous job the median rank does
that waiting *inside* its collectives, so the wait is carved out of its exposed comm (never counted
twice); shares are sums over steps divided by the summed total, so they add up to 1
(``figures.component_shares``). Eliminating a component of share p speeds a step up by at most
1/(1 − p). Components are ranked by that ceiling; findings name a cause where the data shows one.

The ceiling is given (``max_speedup``) only where it is physical (:func:`physical_ceiling`): not for
compute (the work itself: no step is faster without it), not for a part under 10 % of the step (not
a cause worth a ceiling) nor over 90 % (nearly the whole step: no one change removes it). "Most ranks"
is said only of more than half of the ranks (each rank's own data share).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..store.rows import RankRollups
from .figures import RunFigures, amdahl_ceiling

__all__ = ["bottleneck_report", "summary_bottlenecks", "data_stall_ranks", "data_share_ranks", "physical_ceiling",
           "base_finding", "FINDING_LIMITS"]

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
    "ceiling_min_share": 0.10,  # an Amdahl ceiling for parts from 10 % of the step ...
    "ceiling_max_share": 0.90,  # ... up to 90 % of it (compute: never)
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


def physical_ceiling(component: str, share: float) -> float | None:
    """1 / (1 − share) when removing the part is a physical bound worth stating: not compute, and the
    share within [``ceiling_min_share``, ``ceiling_max_share``]; else None."""
    lim = FINDING_LIMITS
    if component == "compute" or not (lim["ceiling_min_share"] <= share <= lim["ceiling_max_share"]):
        return None
    return amdahl_ceiling(share)


def base_finding(component: str, share: float, max_speedup: float | None) -> str:
    """A component's plain-words statement: its share, and its ceiling when there is one (else why not)."""
    head = f"{_NAMES.get(component, component)}: {_pct(share)} of step time"
    if max_speedup is not None:
        return f"{head}; removing it entirely would speed steps up at most {max_speedup:.2f}x"
    if component == "compute":
        return f"{head}; it is the work itself: no ceiling from removing it"
    return f"{head}; no ceiling shown (given for a ranked cause between 10 % and 90 % of the step)"


def _rank_data_shares(roll: RankRollups | None) -> np.ndarray:
    if roll is None:
        return np.empty(0)
    a = roll.arr
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(a["step_s"] > 0, a["data_s"] / a["step_s"], np.nan)


def data_share_ranks(roll: RankRollups | None) -> tuple[int, int]:
    """(ranks spending at least ``data_share_high`` of their own step in data, ranks with a known share)."""
    share = _rank_data_shares(roll)
    known = share[np.isfinite(share)]
    return int((known >= FINDING_LIMITS["data_share_high"]).sum()), int(known.size)


def data_stall_ranks(roll: RankRollups | None, hosts: dict[int, tuple[str | None, str | None]]) -> list[dict[str, Any]]:
    """Ranks whose data share (Σ data / Σ step over their steps) is far above the typical rank's (the
    lower median: with two ranks, the other one) — at most half of them ("some ranks only"); when more
    than half stall it is the data component's own finding ("most ranks")."""
    if roll is None:
        return []
    a = roll.arr
    n = len(a["rank"])
    if n < 2:
        return []
    lim = FINDING_LIMITS
    share = _rank_data_shares(roll)
    known = np.sort(share[np.isfinite(share)])
    med = float(known[(known.size - 1) // 2]) if known.size else 0.0
    bar = max(lim["data_rank_share"], lim["data_rank_factor"] * max(med, 1e-9))
    hit = np.flatnonzero((a["step_s"] > 0) & (np.nan_to_num(share, nan=-np.inf) >= bar))
    hit = hit[np.argsort(-share[hit], kind="stable")]
    if len(hit) * 2 > n:
        return []
    return [{"rank": int(a["rank"][j]), "host": hosts.get(int(a["rank"][j]), (None, None))[0],
             "data_share": float(share[j])} for j in hit]


def bottleneck_report(run_id: int, fig: RunFigures, *, efficiency_large_messages: float | None,
                      stall_ranks: list[dict[str, Any]], stragglers: dict[str, Any] | None,
                      data_ranks: tuple[int, int] | None = None) -> dict[str, Any]:
    """The bottleneck report: components ranked by Amdahl ceiling, each with its findings.

    ``efficiency_large_messages``: time-weighted busbw efficiency of ≥ 1 MiB collectives
    (``collectives.collective_efficiency``); ``stall_ranks``: :func:`data_stall_ranks`;
    ``stragglers``: the straggler report (``stragglers.straggler_report``); ``data_ranks``:
    :func:`data_share_ranks` (None: per-rank shares unknown, the cross-rank median decides alone)."""
    out: dict[str, Any] = {"run_id": run_id, "components": [], "findings": []}
    shares = fig.shares
    if not fig.steps or shares is None:
        return out
    findings: dict[str, list[str]] = {k: [] for k in shares}
    lim = FINDING_LIMITS

    # exposed communication: overlap and link efficiency
    comm_total, exposed = fig.sum_comm_total_s or 0.0, fig.sum_comm_exposed_s or 0.0
    wait_total = fig.sum_wait_s or 0.0
    overlap = None
    if comm_total > 0:
        # the straggler wait sits inside both exposed and total comm time: leave it out of the overlap
        w = min(wait_total, exposed)
        overlap = float(1 - max(exposed - w, 0) / max(comm_total - w, 1e-12))
        if overlap < lim["overlap_ratio_low"] and shares["comm_exposed"] >= lim["comm_share_min"]:
            findings["comm_exposed"].append(
                f"low overlap: only {_pct(overlap)} of communication is hidden behind compute "
                "(what to change, if anything, is in the diagnosis: it depends on the job's parallelism and on "
                "the message sizes)"
            )
    e = efficiency_large_messages
    if e is not None and e < lim["busbw_efficiency_low"]:
        findings["comm_exposed"].append(
            f"low bus bandwidth: large collectives reach {_pct(e)} of the link peak (check NCCL settings, "
            "topology, network)"
        )
    # compute: low MFU while compute-bound
    mfu = fig.mfu
    if mfu is not None and shares["compute"] >= lim["compute_bound_share"] and mfu < lim["mfu_low"]:
        findings["compute"].append(
            f"low MFU while compute-bound: {_pct(mfu)} of peak with compute {_pct(shares['compute'])} of the step "
            "(kernel efficiency: fusion, larger micro-batches, bf16, compile)"
        )
    # other: allocator retries
    retries = fig.alloc_retries or 0.0
    if retries > 0:
        findings["other"].append(
            f"allocator retries: the caching allocator had to free and retry {retries:.0f} times "
            "(memory pressure: lower the batch, set expandable_segments, reduce fragmentation)"
        )
    neg = fig.negative_residual_steps
    if neg:
        findings["other"].append(f"{neg} steps measured a negative residual (timing error), reported not clamped")
    # data: stalls on some ranks only / everywhere
    if stall_ranks:
        names = ", ".join(f"rank {x['rank']}" + (f" ({x['host']})" if x["host"] else "") for x in stall_ranks[:5])
        more = f" and {len(stall_ranks) - 5} more" if len(stall_ranks) > 5 else ""
        findings["data"].append(
            f"data stalls on some ranks only: {names}{more} spend up to {_pct(stall_ranks[0]['data_share'])} "
            "of their step waiting for input (their loader workers, disk or network)"
        )
    elif shares["data"] >= lim["data_share_high"]:
        hit, n = data_ranks if data_ranks is not None else (0, 0)
        where = (f"on most ranks ({hit} of {n})" if n and hit * 2 > n else
                 f"on {hit} of {n} ranks" if n else "(the cross-rank median)")
        findings["data"].append(
            f"input pipeline stalls: {_pct(shares['data'])} of the step waits for data {where} "
            "(more loader workers, prefetch, pinned memory)"
        )
    # straggler wait: name the rank / node
    st = stragglers
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
        ceiling = physical_ceiling(k, p)
        base = base_finding(k, p, ceiling)
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
