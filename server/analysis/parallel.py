"""Parallelism-aware communication (docs/metrics.md, "Communication by dimension" and "Pipeline"):
``comm_by_dim``, the pipeline bubble, and findings per dimension. Pure: rows in, dicts out.

* ``comm_by_dim``: per dimension, the median over steps of the per-step figures, each of which is
  the cross-rank median of a rank's summed calls, bytes, total and exposed seconds in that dimension
  (a step without a call in the dimension counts 0) — the same statistic as the decomposition.
* the pipeline bubble of a step is the time a rank spends waiting in point-to-point calls (send /
  recv of any dimension): the cross-rank median per step, median over steps. It is part of exposed
  communication, not in addition to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..store.rows import P2P, StepCommRow

__all__ = ["P2P", "dim_label", "comm_by_dim", "pipeline_summary", "stage_figures", "group_spans", "node_index",
           "dim_findings", "comm_dim_series", "seq_len_histogram"]

UNKNOWN = "unknown"


def dim_label(dim: str | None, group_size: int, world_size: int | None) -> str:
    """The dimension shown for a record: its name; for a sender that named none, ``world`` when the
    group is all ranks, else ``g<size>``."""
    if dim:
        return dim
    if world_size and group_size == world_size:
        return "world"
    return f"g{group_size}"


def _by_dim(rows: Iterable[StepCommRow]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rows = list(rows)
    steps = np.unique(np.array([r.step for r in rows], dtype=np.int64)) if rows else np.empty(0, dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    for r in rows:
        name = r.dim if r.dim is not None else UNKNOWN
        a = out.get(name)
        if a is None:
            a = out[name] = np.zeros((len(steps), 4))
        i = int(np.searchsorted(steps, r.step))
        a[i] += (r.calls, r.bytes, r.total_s, r.exposed_s)
    return steps, out


def comm_by_dim(rows: Sequence[StepCommRow]) -> dict[str, dict[str, float]]:
    """{dim: {calls, bytes, total_s, exposed_s}} per step (median over steps), most exposed first;
    the point-to-point row is left out (it is the pipeline's)."""
    steps, per = _by_dim(r for r in rows if r.dim != P2P)
    res: dict[str, dict[str, float]] = {}
    for name, a in per.items():
        med = np.median(a, axis=0)
        if not med.any():
            continue  # used in a few steps only (a barrier at the end): not a per-step figure
        res[name] = {"calls": float(med[0]), "bytes": float(med[1]), "total_s": float(med[2]), "exposed_s": float(med[3])}
    return dict(sorted(res.items(), key=lambda kv: (-kv[1]["exposed_s"], -kv[1]["total_s"], kv[0])))


def comm_dim_series(rows: Sequence[StepCommRow], max_points: int = 600) -> dict[str, Any]:
    """Per-step exposed and total seconds per dimension (for the run page), thinned to ``max_points``."""
    steps, per = _by_dim(r for r in rows if r.dim != P2P)
    idx = np.arange(len(steps))
    if len(steps) > max_points:
        idx = np.unique(np.linspace(0, len(steps) - 1, max_points).astype(np.int64))
    return {"steps": steps[idx].tolist(),
            "dims": {name: {"exposed_s": a[idx, 3].tolist(), "total_s": a[idx, 2].tolist()} for name, a in per.items()}}


def stage_figures(stage_of: dict[int, int],
                  blocks: Sequence[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray] | None]],
                  p2p_codes: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per stage, over the given recent steps: the median of its ranks' point-to-point wait (bubble)
    and of their busy time (step minus every exposed communication)."""
    waits: dict[int, list[float]] = {}
    busy: dict[int, list[float]] = {}
    for _step, sb, cb in blocks:
        rank_wait: dict[int, float] = {}
        if cb is not None and len(cb["rank"]):
            m = np.isin(cb["op"], np.asarray(p2p_codes))
            for r, e in zip(cb["rank"][m].tolist(), np.nan_to_num(cb["exposed_s"][m]).tolist(), strict=True):
                rank_wait[int(r)] = rank_wait.get(int(r), 0.0) + e
        for r, s, ce in zip(sb["rank"].tolist(), sb["step_s"].tolist(), np.nan_to_num(sb["comm_exposed_s"]).tolist(),
                            strict=True):
            st = stage_of.get(int(r))
            if st is None:
                continue
            waits.setdefault(st, []).append(rank_wait.get(int(r), 0.0))
            busy.setdefault(st, []).append(max(0.0, s - ce))
    return {st: {"bubble_s": float(np.median(waits[st])), "busy_s": float(np.median(busy[st]))} for st in sorted(waits)}


def pipeline_summary(stage_events: Sequence[tuple[int, dict[str, Any]]], rows: Sequence[StepCommRow],
                     step_s: float | None, per_stage: dict[int, dict[str, float]]) -> dict[str, Any] | None:
    """``{"stages", "bubble_s", "bubble_fraction", "slowest_stage", "per_stage", ...}`` or None when no
    rank reported a pipeline stage. ``stage_events``: (rank, data of a ``pp_stage`` event)."""
    if not stage_events:
        return None
    n_stages = 0
    micro = None
    schedule = None
    for _rank, d in stage_events:
        ns = d.get("num_stages")
        if isinstance(ns, int) and ns > n_stages:
            n_stages = ns
        if isinstance(d.get("n_microbatches"), int):
            micro = d["n_microbatches"]
        if isinstance(d.get("schedule"), str):
            schedule = d["schedule"]
    if not n_stages:
        n_stages = len({d.get("stage") for _, d in stage_events if isinstance(d.get("stage"), int)})
    _steps, per = _by_dim(r for r in rows if r.dim == P2P)
    a = per.get(P2P)
    bubble = float(np.median(a[:, 3])) if a is not None and len(a) else 0.0
    frac = bubble / step_s if step_s else None
    slowest = max(per_stage, key=lambda st: per_stage[st]["busy_s"]) if per_stage else None
    return {"stages": n_stages, "bubble_s": bubble, "bubble_fraction": frac, "slowest_stage": slowest,
            "microbatches": micro, "schedule": schedule,
            "per_stage": [{"stage": st, **v} for st, v in per_stage.items()]}


def node_index(hosts: dict[int, tuple[str | None, str | None]]) -> np.ndarray:
    """``node_of[rank]``: an index per distinct node (its node name, else its host; -1 unknown) of every
    rank up to the highest one in ``hosts``."""
    node_of = np.full(max(hosts, default=-1) + 1, -1, dtype=np.int64)
    ids: dict[str, int] = {}
    for r, (host, node) in hosts.items():
        name = node or host
        if name is not None and r >= 0:
            node_of[r] = ids.setdefault(name, len(ids))
    return node_of


def group_spans(groups: Iterable[tuple[str, np.ndarray]], node_of: np.ndarray) -> dict[str, int]:
    """{dim: the most nodes one of its groups spans} from (dimension, the group's global ranks) — the
    run's stored groups (``run_groups``) — and ``node_of`` (``node_index``)."""
    out: dict[str, int] = {}
    for dim, ranks in groups:
        r = ranks[(ranks >= 0) & (ranks < len(node_of))]
        ids = node_of[r]
        ids = ids[ids >= 0]
        if ids.size:
            out[dim] = max(out.get(dim, 0), int(np.unique(ids).size))
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


_OP_WORDS = {"dp": "data-parallel", "dp_shard": "FSDP", "dp_replicate": "replicate", "tp": "TP", "pp": "PP",
             "cp": "CP", "ep": "EP", "sp": "SP", "world": "world"}


def dim_findings(by_dim: dict[str, dict[str, float]], step_s: float | None, spans: dict[str, int],
                 top_ops: dict[str, str], pipeline: dict[str, Any] | None, *, min_share: float = 0.05) -> list[dict[str, Any]]:
    """Plain-word findings per dimension whose exposed comm is at least ``min_share`` of the step,
    and for a pipeline bubble of at least that share."""
    out: list[dict[str, Any]] = []
    if step_s and step_s > 0:
        for dim, v in by_dim.items():
            share = v["exposed_s"] / step_s
            if share < min_share:
                continue
            who = _OP_WORDS.get(dim, dim)
            op = top_ops.get(dim, "communication").replace("_", "-")
            text = f"{who} {op} exposes {_pct(share)} of the step"
            n = spans.get(dim)
            if n and n > 1:
                text += f"; the {who} group spans {n} nodes"
                if dim in ("tp", "cp", "sp", "ep"):
                    text += f": keep {who} inside a node (make it the innermost mesh dimension)"
            elif dim in ("dp", "dp_shard", "world"):
                text += ": overlap it with backward or grow the per-rank batch"
            out.append({"dim": dim, "share": share, "finding": text})
    if pipeline and pipeline.get("bubble_fraction") and pipeline["bubble_fraction"] >= min_share:
        frac = pipeline["bubble_fraction"]
        text = f"pipeline bubble {_pct(frac)} with {pipeline['stages']} stages"
        if pipeline.get("microbatches"):
            text += f" and {pipeline['microbatches']} micro-batches"
        text += ": more micro-batches or an interleaved schedule"
        if pipeline.get("slowest_stage") is not None and len(pipeline.get("per_stage") or []) > 1:
            text += f"; stage {pipeline['slowest_stage']} is the slowest"
        out.append({"dim": "pp", "share": frac, "finding": text})
    return sorted(out, key=lambda f: -f["share"])


def seq_len_histogram(bins: dict[int, int]) -> dict[str, Any] | None:
    """The run's sequence-length histogram from log2 bins (bin k: lengths in [2^k, 2^(k+1))):
    ``{"bins": [{"lo", "hi", "count"}], "sequences", "p50_bin_lo", "p95_bin_lo", "max_bin_lo"}``, None
    without data. Percentiles are given as the lower bound of the bin they fall in."""
    if not bins or sum(bins.values()) <= 0:
        return None
    total = sum(bins.values())
    ks = sorted(bins)
    rows = [{"lo": 0 if k == 0 else 2**k, "hi": 2 ** (k + 1), "count": int(bins[k])} for k in ks]

    def pct(q: float) -> int:
        acc = 0
        for k in ks:
            acc += bins[k]
            if acc >= q * total:
                return 0 if k == 0 else 2**k
        return 2 ** ks[-1]

    return {"bins": rows, "sequences": int(total), "p50_bin_lo": pct(0.5), "p95_bin_lo": pct(0.95),
            "max_bin_lo": 0 if ks[-1] == 0 else 2 ** ks[-1]}
