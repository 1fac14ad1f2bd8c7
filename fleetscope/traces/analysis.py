"""Per-rank figures from a parsed trace, exactly as Holistic Trace Analysis defines them.

TRACE_FORMULAS.md (shared/data/kineto) is the specification; section numbers below refer to it.
numpy is imported inside the functions (never at import time): the bulk steps (sorting all GPU
events, the correlation join, HTA's interval merge) run on the compact columns without creating a
Python object per event, which is what keeps the importer's memory bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .classify import (
    COMMUNICATION,
    COMPUTATION,
    ITER_NAME_RE,
    MEMORY,
    TYPE_NAMES,
    is_straggler_comm_kernel,
)
from .kept import Kept, as_number, merge
from .parse import F_KERNEL_CAT, RankTrace
from .steps import steps_cpu, steps_gpu

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RankResult", "StragglerInput", "analyze_rank", "np_round", "CONSECUTIVE_KERNEL_DELAY_US"]

CONSECUTIVE_KERNEL_DELAY_US = 30  # HTA's default; its docstring says ns, the unit is the trace's µs
_IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")


def np_round(x: float | None, decimals: int = 2) -> float | None:
    """numpy/pandas ``round``: scale, round half to even, unscale (what HTA's tables print)."""
    if x is None or not math.isfinite(x):
        return None
    scale = 10.0**decimals
    return round(x * scale) / scale


@dataclass
class StragglerInput:
    """What the cross-rank late-start analysis (§2.7) needs from one rank."""

    rank: int
    kept_steps: set[int]
    windows: dict[int, tuple[float, float]]  # iteration -> (min ts, max end) over its events
    comm: list[tuple[int, int, str, float, float]]  # (stream, iteration, name, ts, dur), file order


@dataclass
class RankResult:
    summary: dict[str, Any]
    kernel_type_us: dict[str, float] = field(default_factory=dict)
    straggler: StragglerInput | None = None


def _describe(values: np.ndarray) -> dict[str, float | None]:
    """pandas ``describe()`` of the idle intervals (count, mean, std ddof=1, linear quartiles)."""
    import numpy as np

    n = len(values)
    if n == 0:
        return {
            "count": 0,
            "mean": None,
            "std": None,
            "min": None,
            "p25": None,
            "p50": None,
            "p75": None,
            "max": None,
        }
    q = np.quantile(values, [0.25, 0.5, 0.75])
    return {
        "count": n,
        "mean": np_round(float(values.mean())),
        "std": np_round(float(values.std(ddof=1))) if n > 1 else None,
        "min": np_round(float(values.min())),
        "p25": np_round(float(q[0])),
        "p50": np_round(float(q[1])),
        "p75": np_round(float(q[2])),
        "max": np_round(float(values.max())),
    }


_SWEEP_CHUNK = 1 << 15


def _sweep(layers: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[int, float]:
    """HTA's +bit/-bit sweep over merged interval layers: time during which exactly the layers of
    ``mask`` run (masks with no time left out). The state after all boundaries of one instant holds
    until the next, so ties in the sort do not change the result.

    Done in time windows of ~32k intervals of the largest layer, so the temporaries stay small."""
    import numpy as np

    biggest = max((st for st, _ in layers.values()), key=len, default=np.zeros(0))
    cuts = [-math.inf, *biggest[_SWEEP_CHUNK::_SWEEP_CHUNK].tolist(), math.inf]
    totals: dict[int, float] = {}
    for a, b in zip(cuts, cuts[1:], strict=False):
        parts_t: list[np.ndarray] = []
        parts_v: list[np.ndarray] = []
        for bit, (st, en) in layers.items():
            i = int(np.searchsorted(en, a, side="right"))
            j = int(np.searchsorted(st, b, side="left"))
            if i >= j:
                continue
            s0 = st[i:j].copy()
            e0 = en[i:j].copy()
            s0[0] = max(s0[0], a)
            e0[-1] = min(e0[-1], b)
            parts_t += [s0, e0]
            parts_v += [np.full(j - i, bit, dtype=np.int64), np.full(j - i, -bit, dtype=np.int64)]
        if not parts_t:
            continue
        t = np.concatenate(parts_t)
        v = np.concatenate(parts_v)
        o = np.argsort(t, kind="stable")
        t = t[o]
        running = np.cumsum(v[o])[:-1]
        sums = np.bincount(running, weights=np.diff(t), minlength=1)
        for m, x in enumerate(sums.tolist()):
            if m > 0 and x > 0:
                totals[m] = totals.get(m, 0.0) + x
    return totals


def _temporal(ts: np.ndarray, end: np.ndarray, types: np.ndarray) -> dict[str, Any]:
    """§2.3 temporal breakdown and §2.4 comm/comp overlap on the rows with a stream."""
    merged = merge(ts, end)
    if len(merged[0]) == 0:
        return {}
    kernel_time = float(merged[1][-1] - merged[0][0])
    busy = float(merged[1].sum() - merged[0].sum())
    idle = kernel_time - busy
    comp = merge(ts[types == COMPUTATION], end[types == COMPUTATION])
    comm = merge(ts[types == COMMUNICATION], end[types == COMMUNICATION])
    compute = float(comp[1].sum() - comp[0].sum())
    non_compute = kernel_time - compute - idle
    comm_time = float(comm[1].sum() - comm[0].sum())
    inter = _sweep({1: comp, 2: comm}).get(3, 0.0)

    def pct(x: float) -> float | None:
        return np_round(100 * (x / kernel_time)) if kernel_time else None

    return {
        "kernel_time_us": as_number(kernel_time),
        "idle_time_us": as_number(idle),
        "compute_time_us": as_number(compute),
        "non_compute_time_us": as_number(non_compute),
        "idle_pct": pct(idle),
        "compute_pct": pct(compute),
        "non_compute_pct": pct(non_compute),
        "comm_time_us": as_number(comm_time),
        "comm_compute_overlap_us": as_number(inter),
        "comm_overlap_pct": np_round(100 * (inter / comm_time)) if comm_time else None,
    }


def _idle_breakdown(k: Kept, delay: float) -> list[dict[str, Any]]:
    """§2.5: per stream, each gap before a kernel is host_wait, kernel_wait or other."""
    import numpy as np

    sel = np.flatnonzero(k.gpu & ((k.flags & F_KERNEL_CAT) != 0))
    out: list[dict[str, Any]] = []
    if len(sel) == 0:
        return out
    streams = k.stream[sel]
    _, first = np.unique(streams, return_index=True)
    for s in streams[np.sort(first)]:
        rows = sel[streams == s]
        t = k.ts[rows]
        # pandas sort_values(by="ts") is numpy's (unstable) quicksort on the int64 column: use the
        # same one so that kernels starting at the same µs are ordered as HTA orders them
        ti = t.astype(np.int64) if np.all(np.floor(t) == t) else t
        o = np.argsort(ti, kind="quicksort")
        rows = rows[o]
        t = k.ts[rows]
        e = k.end[rows]
        prev_end = np.empty(len(rows))
        prev_end[0] = np.nan
        prev_end[1:] = e[:-1]
        gap = t - prev_end
        with np.errstate(invalid="ignore"):
            host = k.ts_runtime[rows] > prev_end
            kw = ~host & (gap < delay)
        cat = np.full(len(rows), 2, dtype=np.int8)
        cat[host] = 0
        cat[kw] = 1
        sums = {}
        for c in (0, 1, 2):
            m = cat == c
            if m.any():
                g = gap[m]
                g = g[~np.isnan(g)]
                sums[c] = (float(g.sum()) if len(g) else 0.0, g)
        total = sum(v[0] for v in sums.values())
        for c, (tot, g) in sums.items():
            out.append(
                {
                    "stream": int(s),
                    "idle_category": _IDLE_CATEGORIES[c],
                    "idle_time_us": as_number(np_round(tot) or 0.0),
                    "idle_time_ratio": np_round(tot / total) if total else None,
                    **{f"interval_{key}": v for key, v in _describe(g).items()},
                }
            )
    return out


def _kernel_type_time(ts: np.ndarray, end: np.ndarray, types: np.ndarray) -> dict[str, float]:
    """§2.6: time during which each combination of COMPUTATION/COMMUNICATION/MEMORY runs."""
    layers = {bit: merge(ts[types == bit], end[types == bit]) for bit in (COMPUTATION, COMMUNICATION, MEMORY)}
    out: dict[str, float] = {}
    for mask, t in sorted(_sweep(layers).items()):
        label = " overlapping ".join(TYPE_NAMES[b] for b in (COMPUTATION, COMMUNICATION, MEMORY) if mask & b)
        out[label] = as_number(t)
    return out


def _top_kernels(k: Kept, num_kernels: int, duration_ratio: float) -> list[dict[str, Any]]:
    """§2.6 per-kernel table: per type, kernels by total time; the tail folded into "others" the way
    HTA folds it (beyond ``num_kernels`` or past the ``duration_ratio`` quantile of the cumulative sum).

    Named kernels carry their own statistics over their launches (HTA re-aggregates per-name sums
    once it folds, so its max/min/mean of a named kernel then equal its sum); "others" carries the
    total, the number of launches and of distinct names it holds.
    """
    import numpy as np

    out: list[dict[str, Any]] = []
    gsel = np.flatnonzero(k.gpu)
    names = k.rt.names
    for ktype in (COMPUTATION, COMMUNICATION, MEMORY):
        rows = gsel[k.types[gsel] == ktype]
        if len(rows) == 0:
            continue
        nid = k.name[rows]
        dur = k.end[rows] - k.ts[rows]
        uniq, inv = np.unique(nid, return_inverse=True)
        sums = np.bincount(inv, weights=dur, minlength=len(uniq))
        cnt = np.bincount(inv, minlength=len(uniq))
        order_by_name = sorted(range(len(uniq)), key=lambda i: names[uniq[i]])
        order = sorted(order_by_name, key=lambda i: -sums[i])  # stable: ties keep name order
        fold: set[int] = set()
        if len(order) > num_kernels:
            cums = np.cumsum(sums[order])
            q = float(np.quantile(cums, duration_ratio))
            fold = {i for pos, i in enumerate(order) if cums[pos] > q or pos >= num_kernels}
        folded = [i for i in order if i in fold]
        for i in order:
            if i in fold:
                continue
            d = dur[inv == i]
            out.append(
                {
                    "kernel_type": TYPE_NAMES[ktype],
                    "name": names[uniq[i]],
                    "count": int(cnt[i]),
                    "sum_us": as_number(float(sums[i])),
                    "max_us": as_number(float(d.max())),
                    "min_us": as_number(float(d.min())),
                    "mean_us": float(d.mean()),
                    "std_us": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
                }
            )
        if folded:
            out.append(
                {
                    "kernel_type": TYPE_NAMES[ktype],
                    "name": "others",
                    "count": int(sum(int(cnt[i]) for i in folded)),
                    "kernels": len(folded),
                    "sum_us": as_number(float(sum(float(sums[i]) for i in folded))),
                }
            )
    return out


def analyze_rank(
    rt: RankTrace,
    *,
    rank: int,
    filter_on: bool,
    include_last_step: bool = False,
    num_kernels: int = 10,
    duration_ratio: float = 0.8,
    consecutive_kernel_delay: float = CONSECUTIVE_KERNEL_DELAY_US,
    with_straggler_input: bool = False,
) -> RankResult:
    """All per-rank figures of one parsed trace (HTA-exact; corrected variants under their own names)."""
    import numpy as np

    k = Kept(
        rt, filter_on=filter_on, include_last_step=include_last_step, with_iterations=with_straggler_input
    )
    gsel = k.gpu
    summary: dict[str, Any] = {
        "rank": rank,
        "source": rt.source,
        "world_size": rt.world_size,
        "include_last_step": include_last_step,
        "last_step_filter": k.filter_note,
        "events": rt.events,
        "gpu_events": int(gsel.sum()),
        "profiler_steps": sorted(
            {int(m.group(1)) for n, _, _ in k.kept_steps if (m := ITER_NAME_RE.match(n))}
        ),
        "timestamps_rounded": rt.round_ts,
    }
    notes: list[str] = []
    if rt.gpu_like_without_stream:
        notes.append(
            f"{rt.gpu_like_without_stream} GPU events without args.stream are not on the GPU timeline (as in HTA)"
        )
    g_ts, g_end, g_types = k.on_gpu(k.ts), k.on_gpu(k.end), k.on_gpu(k.types)
    temporal = _temporal(g_ts, g_end, g_types)
    kt: dict[str, float] = {}
    if temporal:
        summary["timeline"] = "gpu"
        summary.update(temporal)
        if temporal["comm_overlap_pct"] is None:
            notes.append("no communication kernels: comm_overlap_pct is undefined (HTA prints NaN)")
        types_corr = k.on_gpu(k.types_corr())
        differs = bool(np.any(g_types != types_corr))
        corrected = _temporal(g_ts, g_end, types_corr) if differs else temporal
        del types_corr
        summary["corrected_classification"] = {
            "differs_from_hta": differs,
            **{
                key: corrected[key]
                for key in ("compute_pct", "non_compute_pct", "comm_overlap_pct", "comm_time_us")
            },
        }
        summary["idle_breakdown"] = _idle_breakdown(k, consecutive_kernel_delay)
        kt = _kernel_type_time(g_ts, g_end, g_types)
        summary["kernel_types"] = [{"kernel_type": key, "time_us": v} for key, v in kt.items()]
        summary["top_kernels"] = _top_kernels(k, num_kernels, duration_ratio)
        summary["steps"] = steps_gpu(k)
        summary["streams"] = sorted(int(s) for s in np.unique(k.on_gpu(k.stream)))
    else:
        summary["timeline"] = "cpu"
        for key in (
            "kernel_time_us",
            "idle_time_us",
            "compute_time_us",
            "non_compute_time_us",
            "idle_pct",
            "compute_pct",
            "non_compute_pct",
            "comm_time_us",
            "comm_compute_overlap_us",
            "comm_overlap_pct",
        ):
            summary[key] = None
        summary["idle_breakdown"] = []
        summary["kernel_types"] = []
        summary["top_kernels"] = []
        summary["steps"] = steps_cpu(k)
        notes.append(
            "no GPU events in the analysed window: GPU figures are absent; steps are decomposed on the CPU timeline"
        )
    summary["notes"] = notes

    straggler = None
    if with_straggler_input:
        straggler = _straggler_input(k, rank)
    return RankResult(summary=summary, kernel_type_us=kt, straggler=straggler)


def _straggler_input(k: Kept, rank: int) -> StragglerInput:
    import numpy as np

    kept = {int(m.group(1)) for n, _, _ in k.kept_steps if (m := ITER_NAME_RE.match(n))}
    windows: dict[int, tuple[float, float]] = {}
    if k.rt.windows is not None:
        windows = {it: w for it, w in k.rt.windows.by_iteration().items() if it in kept}
    its = k.iteration
    for it in np.unique(its[its >= 0]).tolist():
        m = its == it
        lo, hi = float(k.ts[m].min()) + k.base, float(k.end[m].max()) + k.base
        if it in windows:
            plo, phi = windows[it]
            windows[it] = (min(plo, lo), max(phi, hi))
        else:
            windows[it] = (lo, hi)
    names = k.rt.names
    comm_name = (
        np.array([is_straggler_comm_kernel(n, corrected=True) for n in names], dtype=bool) if names else None
    )
    comm: list[tuple[int, int, str, float, float]] = []
    if comm_name is not None:
        sel = np.flatnonzero((k.stream > 0) & comm_name[k.name])
        for i in sel.tolist():
            comm.append(
                (
                    int(k.stream[i]),
                    int(its[i]),
                    names[k.name[i]],
                    float(k.ts[i]) + k.base,
                    float(k.end[i] - k.ts[i]),
                )
            )
    return StragglerInput(rank=rank, kept_steps=kept, windows=windows, comm=comm)
