"""Stragglers (docs/metrics.md): found by the work a rank does before it arrives, never by step time.

``work_s = step_s - comm_exposed_s``. Per step: skew = max work / median work, the slowest rank.
Per rank: slowdown = median over steps of (rank work / the step's median work). A rank is a
straggler when that median is above the threshold (1.05): *persistent* over the run, or *transient*
when only some windows of ``WINDOW_STEPS`` steps have it above. A node whose ranks are all
stragglers is named as the cause. Each straggler carries the component that made it late (its
excess over the step median in data, compute, other), its lateness at collectives where start
timestamps exist, the fleet time lost waiting for it, and where it was slow: its flagged windows as
merged step ranges (``slow_ranges``).

**Pipeline jobs** (``stages``: rank → pipeline stage, from the agent's ``pp_stage`` events): the stages
do different work by design (the last one also computes the head and the loss), so a rank is compared
with the ranks of its own stage — its slowdown divided by its stage's lower median slowdown (windows
likewise) — and a rank alone in its stage has no peer and is never a straggler. The report then says
``compared_within: "pipeline stage"``; each straggler keeps ``slowdown_vs_all``.

Source: the per-(run, rank) rollups kept at compaction (``rollups.py``, :func:`from_rollups`); runs
compacted without them (older data, a compactor without the fold) are analysed from the step blocks
of the most recent ``FALLBACK_STEPS`` steps (:func:`from_blocks`), and the result says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..store.rows import RankRollups, StepFrame
from .figures import RunFigures
from .rollups import HIST_BW, HIST_LO, HIST_NB, THRESHOLD, WINDOW_STEPS

__all__ = ["straggler_report", "from_rollups", "from_blocks", "per_step_view", "summary_stragglers",
           "FALLBACK_STEPS", "MIN_WINDOW_STEPS", "MAX_SLOW_RANGES"]

FALLBACK_STEPS = 512
MIN_WINDOW_STEPS = min(10, WINDOW_STEPS)  # a window counts once it holds this many of the rank's steps
_COMPONENTS = ("data", "compute", "other")


def from_rollups(roll: RankRollups) -> dict[str, Any]:
    """The per-rank figures as kept at compaction."""
    return {"arr": roll.arr, "flagged_windows": roll.flagged_windows, "n_windows": roll.n_windows, "source": "rollups"}


def from_blocks(blocks: list[tuple[int, dict[str, np.ndarray]]], world_size: int) -> dict[str, Any] | None:
    """The same per-rank figures computed from decoded step blocks ((step, columns), in step order)."""
    if not blocks:
        return None
    ws = max(world_size, 1)
    for _, d in blocks:
        if len(d["rank"]):
            ws = max(ws, int(d["rank"].max()) + 1)
    k = len(blocks)
    mats = {f: np.full((k, ws), np.nan) for f in ("work", "data", "compute", "other", "step")}
    steps = np.array([st for st, _ in blocks])
    for i, (_, d) in enumerate(blocks):
        rk = d["rank"]
        mats["work"][i, rk] = d["step_s"] - np.nan_to_num(d["comm_exposed_s"])
        mats["data"][i, rk] = d["data_s"]
        mats["compute"][i, rk] = d["compute_s"]
        mats["other"][i, rk] = d["other_s"]
        mats["step"][i, rk] = d["step_s"]
    with np.errstate(invalid="ignore", divide="ignore", all="ignore"):
        med = np.nanmedian(mats["work"], axis=1, keepdims=True)
        ratio = mats["work"] / med
        present = np.isfinite(ratio)
        arr: dict[str, np.ndarray] = {"rank": np.arange(ws, dtype=np.float64)}
        arr["steps"] = present.sum(axis=0).astype(np.float64)
        arr["above"] = (ratio > THRESHOLD).sum(axis=0).astype(np.float64)
        arr["slowdown"] = np.nanmedian(np.where(present, ratio, np.nan), axis=0)
        excess = mats["work"] - med
        arr["excess_s"] = np.nansum(excess, axis=0)
        for comp in _COMPONENTS:
            m = np.nanmedian(mats[comp], axis=1, keepdims=True)
            arr[f"{comp}_excess_s"] = np.nansum(mats[comp] - m, axis=0)
        slow = np.nanargmax(np.where(present, mats["work"], -np.inf), axis=1)
        lost = np.nanmax(np.where(present, excess, -np.inf), axis=1)
        arr["lost_s"] = np.bincount(slow, weights=np.where(np.isfinite(lost), lost, 0), minlength=ws)
        arr["slowest_steps"] = np.bincount(slow, minlength=ws).astype(np.float64)
        arr["step_s"] = np.nansum(mats["step"], axis=0)
        arr["data_s"] = np.nansum(mats["data"], axis=0)
    arr["late_s"] = np.zeros(ws)
    arr["late_n"] = np.zeros(ws)
    arr["last_arrivals"] = np.zeros(ws)
    keep = arr["steps"] > 0
    arr = {kk: v[keep] for kk, v in arr.items()}
    flagged_w: dict[int, list[tuple[int, float]]] = {}
    n_windows: dict[int, int] = {}
    win = steps // WINDOW_STEPS
    for w in np.unique(win):
        sel = win == w
        if sel.sum() < MIN_WINDOW_STEPS:
            continue
        r = ratio[sel][:, keep]
        cnt = np.isfinite(r).sum(axis=0)
        above = (r > THRESHOLD).sum(axis=0)
        mean_r = np.nanmean(np.minimum(r, 3.0), axis=0)
        for j, rank in enumerate(arr["rank"].astype(int)):
            if cnt[j] >= MIN_WINDOW_STEPS:
                n_windows[int(rank)] = n_windows.get(int(rank), 0) + 1
                if above[j] * 2 > cnt[j]:
                    flagged_w.setdefault(int(rank), []).append((int(w), float(mean_r[j])))
    return {"arr": arr, "flagged_windows": flagged_w, "n_windows": n_windows,
            "source": f"blocks (last {k} steps)"}


MAX_SLOW_RANGES = 32  # step ranges a straggler lists (the first ones)


def _ranges(wins: list[tuple[int, float]]) -> list[list[int]]:
    """The steps of a rank's flagged windows as merged ``[first, end)`` step ranges, at most
    ``MAX_SLOW_RANGES`` (the first ones): where the run page's scalars chart shades the straggler."""
    out: list[list[int]] = []
    for w in sorted({w for w, _ in wins}):
        lo, hi = w * WINDOW_STEPS, (w + 1) * WINDOW_STEPS
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        elif len(out) < MAX_SLOW_RANGES:
            out.append([lo, hi])
        else:
            break
    return out


def _component(arr: dict[str, np.ndarray], j: int) -> tuple[str | None, dict[str, float]]:
    ex = {comp: float(arr[f"{comp}_excess_s"][j]) for comp in _COMPONENTS}
    pos = {k: v for k, v in ex.items() if v > 0}
    if not pos:
        return None, ex
    return max(pos, key=lambda k: pos[k]), ex


def per_step_view(frame: StepFrame, max_points: int) -> dict[str, Any]:
    """Slowest rank and skew per step (frame columns ``step``, ``slowest_rank``, ``skew``), reduced to
    ≤ max_points buckets keeping each bucket's worst step."""
    if not len(frame):
        return {"step": [], "slowest_rank": [], "skew": [], "bucket_steps": 1}
    step = frame["step"].astype(np.int64)
    rank = np.nan_to_num(frame["slowest_rank"], nan=-1).astype(np.int64)
    skew = frame["skew"]
    n = len(step)
    k = max(1, -(-n // max_points))
    if k > 1:
        m = -(-n // k)
        pad = m * k - n
        sk = np.r_[np.nan_to_num(skew, nan=-1.0), np.full(pad, -np.inf)].reshape(m, k)
        pick = np.arange(m) * k + np.argmax(sk, axis=1)
        pick = pick[pick < n]
        step, rank, skew = step[pick], rank[pick], skew[pick]
    return {"step": step.tolist(), "slowest_rank": [int(r) if r >= 0 else None for r in rank],
            "skew": [None if not np.isfinite(v) else float(v) for v in skew], "bucket_steps": k}


def _stage_scale(ranks: np.ndarray, slowdown: np.ndarray, stages: dict[int, int] | None) -> np.ndarray | None:
    """Per rank, its stage's (lower) median slowdown (NaN: alone in its stage, or no stage); None when the
    run is not a pipeline of ≥ 2 stages."""
    if not stages or len(set(stages.values())) < 2:
        return None
    st = np.array([stages.get(int(r), -1) for r in ranks])
    scale = np.full(len(ranks), np.nan)
    for s in np.unique(st[st >= 0]):
        m = (st == s) & np.isfinite(slowdown)
        if m.sum() >= 2:  # the lower median: of two peers, the faster one
            v = np.sort(slowdown[m])
            scale[st == s] = float(v[(len(v) - 1) // 2])
    return scale


def straggler_report(run_id: int, *, world_size: int, fig: RunFigures, hosts: dict[int, tuple[str | None, str | None]],
                     data: dict[str, Any] | None, threshold: float = THRESHOLD,
                     per_step: dict[str, Any] | None = None, stages: dict[int, int] | None = None) -> dict[str, Any]:
    """The straggler report of a run (see the module docstring). ``data``: :func:`from_rollups` or
    :func:`from_blocks`; ``fig``: the run's figures (step counts, fleet time lost, skew percentiles);
    ``per_step``: :func:`per_step_view`, included when given; ``stages``: rank → pipeline stage
    (ranks are then compared within their stage)."""
    lost = fig.sum_wait_s if fig.steps else None
    base = {
        "steps": fig.steps,
        "fleet_lost_s": lost,
        "fleet_lost_share": float(lost / fig.sum_step_s) if lost is not None and fig.sum_step_s else None,
        "skew_p50": fig.skew_p50,
        "skew_p95": fig.skew_p95,
        "skew_max": fig.skew_max,
    }
    world_size = int(world_size or 1)
    out: dict[str, Any] = {"run_id": run_id, "threshold": threshold, "window_steps": WINDOW_STEPS, **base,
                           "source": None, "stragglers": [], "nodes": [], "late_ranks": []}
    if per_step is not None:
        out["per_step"] = per_step
    if data is None:
        return out
    out["source"] = data["source"]
    arr = data["arr"]
    ranks = arr["rank"].astype(int)
    steps = arr["steps"]
    slowdown = arr["slowdown"]
    if threshold == THRESHOLD:
        persistent = arr["above"] * 2 > steps  # exact: the median is above the threshold
    else:
        persistent = np.nan_to_num(slowdown) > threshold
    scale = _stage_scale(ranks, slowdown, stages)
    slowdown_all = slowdown
    if scale is not None:  # a pipeline: against the rank's own stage; alone in its stage: no peer, no straggler
        out["compared_within"] = "pipeline stage"
        with np.errstate(invalid="ignore", divide="ignore"):
            slowdown = np.where(np.isfinite(scale) & (scale > 0), slowdown / scale, np.nan)
        persistent = np.nan_to_num(slowdown) > threshold
    n_lost_gpus = max(world_size - 1, 1)
    items: list[dict[str, Any]] = []
    for j in range(len(ranks)):
        rank = int(ranks[j])
        wins = data["flagged_windows"].get(rank, []) if threshold == THRESHOLD else []
        if scale is not None:
            sc = scale[j]
            wins = [(w, r / sc) for w, r in wins if np.isfinite(sc) and sc > 0 and r / sc > threshold]
        if not persistent[j] and not wins:
            continue
        comp, ex = _component(arr, j)
        host, node = hosts.get(rank, (None, None))
        late_n = arr["late_n"][j]
        item = {
            "rank": rank,
            "host": host,
            "node": node,
            "slowdown": round(float(slowdown[j]), 4) if np.isfinite(slowdown[j]) else None,
            "kind": "persistent" if persistent[j] else "transient",
            "slowdown_vs_all": round(float(slowdown_all[j]), 4) if np.isfinite(slowdown_all[j]) else None,
            "steps": int(steps[j]),
            "steps_above": int(arr["above"][j]),
            "windows_flagged": len(wins),
            "windows": int(data["n_windows"].get(rank, 0)),
            "first_window_step": (min(w for w, _ in wins) * WINDOW_STEPS) if wins else None,
            "slow_ranges": _ranges(wins),
            "peak_window_slowdown": round(max(r for _, r in wins), 4) if wins else None,
            "component": comp,
            "component_excess_s": {k: round(v, 6) for k, v in ex.items()},
            "lost_s": float(arr["lost_s"][j]),
            "lost_gpu_s": float(arr["lost_s"][j]) * n_lost_gpus,
            "slowest_steps": int(arr["slowest_steps"][j]),
            "lateness_s": float(arr["late_s"][j] / late_n) if late_n > 0 else None,
            "last_arrivals": int(arr["last_arrivals"][j]),
            "node_flagged": False,
        }
        items.append(item)
    # nodes: name a node when all of its (≥ 2) ranks are stragglers
    by_node: dict[str, list[int]] = {}
    for rank, (_h, node) in hosts.items():
        if node:
            by_node.setdefault(node, []).append(rank)
    flagged = {it["rank"] for it in items if it["kind"] == "persistent"}
    sd = {int(r): float(s) for r, s in zip(ranks, slowdown, strict=True) if np.isfinite(s)}
    for node, rks in sorted(by_node.items()):
        slow_ranks = [r for r in rks if r in flagged]
        if len(rks) >= 2 and len(slow_ranks) == len(rks):
            out["nodes"].append({"node": node, "host": hosts[rks[0]][0], "ranks": sorted(rks),
                                 "flagged_ranks": len(slow_ranks),
                                 "slowdown": float(np.median([sd[r] for r in rks if r in sd]))})
            for it in items:
                if it["node"] == node:
                    it["node_flagged"] = True
    items.sort(key=lambda it: (it["kind"] != "persistent", -(it["slowdown"] or 0), -(it["peak_window_slowdown"] or 0)))
    out["stragglers"] = items
    out["nodes"].sort(key=lambda x: -x["slowdown"])
    # late arrivals at collectives (where start timestamps exist): mean lateness well above the others'
    late = np.where(arr["late_n"] > 0, arr["late_s"] / np.maximum(arr["late_n"], 1), np.nan)
    if np.isfinite(late).sum() >= 2:
        med_late = float(np.nanmedian(late))
        step_med = float(np.sum(arr["step_s"]) / max(np.sum(steps), 1))
        bar = med_late + max(0.05 * step_med, 1e-4)
        for jj in np.flatnonzero(np.nan_to_num(late, nan=-1) > bar):
            j = int(jj)
            rank = int(ranks[j])
            out["late_ranks"].append({"rank": rank, "host": hosts.get(rank, (None, None))[0],
                                      "lateness_s": float(late[j]), "last_arrivals": int(arr["last_arrivals"][j])})
        out["late_ranks"].sort(key=lambda x: -x["lateness_s"])
    out["hist_bins"] = {"lo": HIST_LO, "width": HIST_BW, "n": HIST_NB}
    return out


def summary_stragglers(report: dict[str, Any] | None, limit: int = 20) -> list[dict[str, Any]]:
    """The ``stragglers`` list of the run summary: rank, host, slowdown and the cause, worst first."""
    if not report:
        return []
    out = []
    for it in report["stragglers"][:limit]:
        out.append({k: it[k] for k in ("rank", "host", "node", "slowdown", "kind", "component", "lost_s",
                                        "lateness_s", "node_flagged", "windows_flagged")})
        if it.get("cause") is not None:  # joined device telemetry (analysis/devices.py)
            out[-1]["cause"] = it["cause"]
        if out[-1]["slowdown"] is None:
            out[-1]["slowdown"] = 0.0
    return out
