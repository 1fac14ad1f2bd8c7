"""Scaling per model family and configuration, and cross-run comparison in normalised units.

Scaling (docs/metrics.md): the runs of one family whose configs match once the size-dependent keys are
left out (``figures.scaling_signature``) and that share a device type form one curve. Weak scaling
(per-device batch fixed): efficiency(n) = (throughput(n)/n) / (throughput(n0)/n0); strong scaling
(global batch fixed): efficiency(n) = step_s(n0)·n0 / (step_s(n)·n). The mode is read from the data:
tokens per rank-step constant across sizes → weak; tokens per step constant → strong. Several runs
at one size are combined by their median. The component whose share of step time grows most from
n0 to the largest n explains the loss.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ..store.rows import RunRow
from .figures import RunFigures, scaling_signature

__all__ = ["scaling", "compare_runs", "COMPARE_METRICS"]

RunWithFigures = tuple[RunRow, RunFigures]

_COMPONENTS = ("data", "compute", "comm_exposed", "other", "straggler_wait")
COMPARE_METRICS = ("tokens_per_s_per_gpu", "mfu", "step_s_per_1k_tokens", "step_s", "tokens_per_s", "overlap_ratio")


def _med(vals: list[float | None]) -> float | None:
    v = [x for x in vals if x is not None]
    return float(np.median(v)) if v else None


def _mode(points: list[dict[str, Any]]) -> str:
    per_dev = [p["tokens_per_rank_step"] for p in points if p["tokens_per_rank_step"]]
    glob = [p["tokens_per_step"] for p in points if p["tokens_per_step"]]
    if len(points) < 2:
        return "unknown"

    def cv(x: list[float]) -> float:
        return float(np.std(x) / np.mean(x)) if len(x) == len(points) and np.mean(x) > 0 else np.inf

    if cv(per_dev) <= 0.05:
        return "weak"
    if cv(glob) <= 0.05:
        return "strong"
    return "unknown"


#: run states whose figures do not describe the setup's scaling: set apart from the points by default
SET_APART_STATES = ("failed", "hung", "stalled", "aborted")
#: straggler wait at least this share of the step: the run had a flagged straggler (a sick node, not the
#: setup) and is set apart by default
STRAGGLER_SHARE = 0.10


def set_apart_reason(run: Any, fig: Any) -> str | None:
    """Why a run's point would mislead a scaling curve (its state, or a straggler), else None."""
    if run.status in SET_APART_STATES:
        return f"the run {run.status}"
    share = (fig.shares or {}).get("straggler_wait")
    if share is not None and share >= STRAGGLER_SHARE:
        return f"a straggler: {100 * share:.0f} % of the step waits for the slowest rank"
    return None


def scaling(family: str, runs: Sequence[RunWithFigures], *, device_type: str | None = None,
            signature: str | None = None, status: tuple[str, ...] | None = None,
            exclude: Collection[int] = (), include: Collection[int] = ()) -> dict[str, Any]:
    """Scaling curves of a family from its runs' figures: one group per (scaling signature, device
    type), points by world size. Runs that failed, hung or stalled, or had a flagged straggler
    (:func:`set_apart_reason`), and the runs in ``exclude``, are set apart — listed in ``excluded`` with
    the reason, not in any point — unless named in ``include``."""
    groups: dict[tuple[str, str | None], list[RunWithFigures]] = {}
    excluded: list[dict[str, Any]] = []
    for run, fig in runs:
        if not fig.steps or fig.step_s is None:
            continue
        if status and run.status not in status:
            continue
        why = "excluded by hand" if run.id in exclude else (None if run.id in include else set_apart_reason(run, fig))
        if why is not None:
            excluded.append({"run": run.id, "name": run.name, "world_size": int(run.world_size or 1), "reason": why})
            continue
        if device_type and run.device_type != device_type:
            continue
        sig = scaling_signature(run.config)
        if signature and sig != signature:
            continue
        groups.setdefault((sig, run.device_type), []).append((run, fig))
    out_groups = []
    for (sig, dev), members in groups.items():
        by_n: dict[int, list[RunWithFigures]] = {}
        for run, fig in members:
            by_n.setdefault(int(run.world_size or 1), []).append((run, fig))
        points: list[dict[str, Any]] = []
        for n in sorted(by_n):
            ms = by_n[n]
            shares = {k: _med([(f.shares or {}).get(k) for _, f in ms]) for k in _COMPONENTS}
            points.append({
                "world_size": n,
                "runs": [r.id for r, _ in ms],
                "run_names": [r.name for r, _ in ms],
                "throughput_tokens_per_s": _med([f.tokens_per_s for _, f in ms]),
                "tokens_per_s_per_gpu": _med([f.tokens_per_s_per_gpu for _, f in ms]),
                "step_s": _med([f.step_s for _, f in ms]),
                "mfu": _med([f.mfu for _, f in ms]),
                "tokens_per_rank_step": _med([f.tokens_per_rank_step for _, f in ms]),
                "tokens_per_step": _med([f.tokens_per_step for _, f in ms]),
                "shares": shares,
            })
        mode = _mode(points)
        p0 = points[0]
        n0 = p0["world_size"]
        for p in points:
            n = p["world_size"]
            weak = strong = None
            if p["throughput_tokens_per_s"] and p0["throughput_tokens_per_s"]:
                weak = (p["throughput_tokens_per_s"] / n) / (p0["throughput_tokens_per_s"] / n0)
            if p["step_s"] and p0["step_s"]:
                strong = (p0["step_s"] * n0) / (p["step_s"] * n)
            p["weak_efficiency"] = weak
            p["strong_efficiency"] = strong
            p["efficiency"] = strong if mode == "strong" else weak
            p["ideal_throughput_tokens_per_s"] = (p0["throughput_tokens_per_s"] * n / n0
                                                  if p0["throughput_tokens_per_s"] else None)
        growth = None
        if len(points) >= 2:
            first, last = points[0]["shares"], points[-1]["shares"]
            deltas = {k: (last[k] - first[k]) for k in _COMPONENTS if last.get(k) is not None and first.get(k) is not None}
            if deltas:
                k = max(deltas, key=lambda c: deltas[c])
                if deltas[k] > 0:
                    growth = {"component": k, "share_at_n0": first[k], "share_at_max": last[k],
                              "n0": n0, "n_max": points[-1]["world_size"],
                              "explanation": f"{k} grows from {100 * first[k]:.0f}% of the step at {n0} GPUs to "
                                             f"{100 * last[k]:.0f}% at {points[-1]['world_size']}"}
        rep = members[0][0]
        out_groups.append({
            "signature": sig,
            "device_type": dev,
            "config": dict(rep.config or {}),
            "mode": mode,
            "n0": n0,
            "points": points,
            "growing_component": growth,
        })
    out_groups.sort(key=lambda g: (-len(g["points"]), str(g["device_type"]), g["signature"]))
    return {"family": family, "groups": out_groups, "excluded": excluded}


def compare_runs(run_ids: Sequence[int], found: dict[int, RunWithFigures]) -> dict[str, Any]:
    """Runs side by side in normalised units (tokens/s/GPU, MFU, GPU-seconds per 1k tokens), with the
    first run as the reference for relative figures, shares of step time, and the config keys that
    differ. ``found``: the runs of ``run_ids`` that exist, with their figures."""
    rows = []
    for rid in run_ids:
        item = found.get(int(rid))
        if item is None:
            continue
        run, fig = item
        rows.append({
            "id": run.id, "name": run.name, "model_family": run.model_family, "world_size": run.world_size,
            "device_type": run.device_type, "git_commit": run.git_commit, "status": run.status,
            "started_at": run.started_at,
            **{m: fig.get(m) for m in COMPARE_METRICS},
            "shares": fig.shares,
            "decomposition": fig.decomposition,
            "config": run.config or {},
        })
    relative: dict[str, list[float | None]] = {}
    if rows:
        ref = rows[0]
        for m in COMPARE_METRICS:
            relative[m] = [(r[m] / ref[m]) if r[m] is not None and ref[m] else None for r in rows]
    keys = sorted({k for r in rows for k in r["config"]})
    diff = {k: [r["config"].get(k) for r in rows] for k in keys
            if len({repr(r["config"].get(k)) for r in rows}) > 1}
    for field in ("model_family", "world_size", "device_type", "git_commit"):
        vals = [r[field] for r in rows]
        if len({repr(v) for v in vals}) > 1:
            diff[field] = vals
    missing = [int(r) for r in run_ids if int(r) not in found]
    return {"runs": rows, "relative_to_first": relative, "config_diff": diff, "missing": missing}
