"""Overlap and bucketing guidance (docs/metrics.md, "Overlap and bucketing guidance"): one rank-step's
communication placed on its timeline against backward, and what to change when exposed communication
is a top bottleneck. Pure: decoded blocks and plain values in, dicts out.

**Timeline of a rank-step** (times in seconds from the step's ``ts``). Measured: each collective's issue
(``start_ts − ts``), its duration (``total_s``) and the part the training thread waited for
(``exposed_s``). A collective's bar runs from ``start_s`` to ``end_s = start_s + total_s``; its exposed
part is the last ``exposed_s`` of the bar (a wait ends when the work completes; for DDP's buckets the
agent splits the wait after the last bucket's issue exactly so). Estimated: where backward lies. The
agent measures phase *durations*, not positions, and excludes the waits from them, so the training
thread is taken to run data → forward → backward → optimizer with the measured waits where they were
(``_wall``): backward starts when data + forward time has elapsed outside waits. It ends at the issue
of the last gradient reduction (an all-reduce or reduce-scatter issued in backward: DDP issues its
last bucket, FSDP its last reduce-scatter, once the last gradient is ready — measured), else when
data + forward + backward time has elapsed outside waits.

* ``tail_s``: the waits after backward's end on collectives issued during backward — the gradient
  communication the optimizer waited for;
* ``overlap_ratio``: ``1 − Σ exposed / Σ total`` over the step's collectives (the rank-step's own
  ``1 − comm_exposed_s / comm_total_s``); ``backward_overlap_ratio`` the same over those issued in backward.

**Advice** (:func:`overlap_advice`) over the timelines of recent steps (each step's median rank),
each figure the median over steps; only when exposed communication is a top bottleneck, and only
within what the job's framework can do: DDP cannot split one parameter across buckets, so a smaller
``bucket_cap_mb`` is never advised below the largest gradient tensor (the agent's ``ddp`` facts; a
run without them gets no smaller-bucket advice), the first bucket (``first_bucket_bytes``) is left out
of the buckets' mean size, and FSDP's smaller-units advice needs units larger than the smallest one.
An item that cannot be given is returned with ``withheld`` (the reason): the diagnosis lists it in its
notes, never as advice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.wire import COLLECTIVE_OPS, busbw_factor

__all__ = [
    "RankStep", "Collective", "Timeline", "LIMITS", "GRAD_OPS", "median_rank", "representative_step",
    "rank_step", "rank_collectives", "timeline", "comm_is_top", "latency_fit", "overlap_advice",
    "bounded_collectives",
]  # fmt: skip

#: thresholds of the advice (documented in docs/metrics.md)
LIMITS = {
    "top_share": 0.10,  # exposed comm at least 10 % of the step ...
    "top_rank": 2,  # ... or first or second in the bottleneck ranking
    "min_gain_share": 0.01,  # a suggestion must be able to remove at least 1 % of the step
    "min_bucket_cut": 0.25,  # a smaller bucket cap must cut the buckets' mean size by a quarter at least
    "latency_dominates": 0.5,  # per-call overhead ≥ half of the gradient all-reduce time: fewer, larger buckets
    "latency_target": 0.1,  # the suggested bucket keeps the per-call overhead at 10 % of its time
}

GRAD_OPS = ("all_reduce", "reduce_scatter")
_EPS = 1e-6  # s: issue times equal up to the clocks' rounding
_MIB = float(1 << 20)  # DDP's bucket_cap_mb is in MiB


@dataclass(frozen=True)
class RankStep:
    """One rank's step as the agent measured it (NaN = not measured)."""

    step: int
    rank: int
    ts: float
    step_s: float
    data_s: float = float("nan")
    forward_s: float = float("nan")
    backward_s: float = float("nan")
    optimizer_s: float = float("nan")
    other_s: float = float("nan")
    comm_exposed_s: float = float("nan")
    comm_total_s: float = float("nan")
    mem_peak_bytes: float = float("nan")


@dataclass(frozen=True)
class Collective:
    """One collective record of a rank-step (``calls`` > 1: the agent aggregated several calls)."""

    op: str
    dim: str
    group_size: int
    bytes: float
    calls: int
    start_ts: float
    total_s: float
    exposed_s: float


@dataclass
class Placed:
    """A collective on the step's timeline."""

    op: str
    dim: str
    group_size: int
    bytes: float
    calls: int
    start_s: float
    end_s: float
    exposed_s: float
    phase: str = "unknown"
    gradient: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "dim": self.dim, "bytes": self.bytes, "calls": self.calls, "start_s": self.start_s,
                "end_s": self.end_s, "exposed_s": self.exposed_s, "phase": self.phase, "gradient": self.gradient}


@dataclass
class Timeline:
    """One rank-step's communication against its backward (see the module docstring)."""

    step: int
    rank: int
    step_s: float
    comm_exposed_s: float | None
    backward: tuple[float, float] | None
    collectives: list[Placed] = field(default_factory=list)
    tail_s: float | None = None
    overlap_ratio: float | None = None
    backward_overlap_ratio: float | None = None
    backward_end_measured: bool = False
    mem_peak_bytes: float | None = None

    def as_dict(self, limit: int | None = None) -> dict[str, Any]:
        """The timeline as the API shows it; with ``limit``, at most that many collectives are listed
        (:func:`bounded_collectives`), the rest summed in ``collectives_folded``."""
        shown, folded = bounded_collectives(self.collectives, limit)
        return {
            "step": self.step, "rank": self.rank, "step_s": self.step_s, "comm_exposed_s": self.comm_exposed_s,
            "backward": None if self.backward is None else {
                "start_s": self.backward[0], "end_s": self.backward[1],
                "start": "estimated", "end": "last gradient reduction issued" if self.backward_end_measured else "estimated"},
            "collectives": [c.as_dict() for c in shown],
            "collectives_total": len(self.collectives), "collectives_folded": folded,
            "tail_s": self.tail_s, "overlap_ratio": self.overlap_ratio,
            "backward_overlap_ratio": self.backward_overlap_ratio,
        }  # fmt: skip


def bounded_collectives(placed: Sequence[Placed], limit: int | None) -> tuple[list[Placed], list[dict[str, Any]]]:
    """(the collectives to list, the rest summed): with more than ``limit``, the ``limit`` longest
    (issue to completion; ties: the earlier record) in record order, and the others summed per (op,
    phase, gradient) into ``{"op", "phase", "gradient", "records", "calls", "bytes", "start_s" (the
    earliest issue), "end_s" (the latest completion), "total_s", "exposed_s"}`` rows, most time first —
    at most ``len(COLLECTIVE_OPS)`` × 5 phases × 2 = 120 rows, whatever the step holds."""
    if limit is None or len(placed) <= limit:
        return list(placed), []
    dur = np.array([c.end_s - c.start_s for c in placed], dtype=np.float64)
    keep = np.zeros(len(placed), dtype=bool)
    keep[np.argsort(-dur, kind="stable")[:max(int(limit), 0)]] = True
    groups: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for c, k in zip(placed, keep.tolist(), strict=True):
        if k:
            continue
        g = groups.get((c.op, c.phase, c.gradient))
        if g is None:
            g = groups[(c.op, c.phase, c.gradient)] = {
                "op": c.op, "phase": c.phase, "gradient": c.gradient, "records": 0, "calls": 0, "bytes": 0.0,
                "start_s": c.start_s, "end_s": c.end_s, "total_s": 0.0, "exposed_s": 0.0}
        g["records"] += 1
        g["calls"] += c.calls
        g["bytes"] += c.bytes
        g["start_s"] = min(g["start_s"], c.start_s)
        g["end_s"] = max(g["end_s"], c.end_s)
        g["total_s"] += c.end_s - c.start_s
        g["exposed_s"] += c.exposed_s
    return ([c for c, k in zip(placed, keep.tolist(), strict=True) if k],
            sorted(groups.values(), key=lambda g: (-g["total_s"], g["op"], g["phase"], g["gradient"])))


def _num(v: Any) -> float:
    x = float(v)
    return x if np.isfinite(x) else float("nan")


def _opt(v: float) -> float | None:
    return v if np.isfinite(v) else None


def median_rank(sb: Mapping[str, np.ndarray]) -> int | None:
    """The rank of a step block whose step time is the median one (the lower median; ties: lowest rank)."""
    ranks = np.asarray(sb["rank"])
    st = np.asarray(sb["step_s"], dtype=np.float64)
    ok = np.isfinite(st)
    if not ok.any():
        return None
    order = np.lexsort((ranks[ok], st[ok]))
    return int(ranks[ok][order][(int(ok.sum()) - 1) // 2])


def representative_step(steps: Sequence[int] | np.ndarray, step_s: Sequence[float] | np.ndarray) -> int | None:
    """The step whose (cross-rank median) step time is closest to the median of them; ties: the latest."""
    s = np.asarray(steps, dtype=np.int64)
    v = np.asarray(step_s, dtype=np.float64)
    ok = np.isfinite(v)
    if not ok.any():
        return int(s[-1]) if len(s) else None
    s, v = s[ok], v[ok]
    d = np.abs(v - float(np.median(v)))
    best = np.flatnonzero(d <= d.min() + 1e-15)
    return int(s[best].max())


def rank_step(step: int, sb: Mapping[str, np.ndarray], rank: int) -> RankStep | None:
    """The ``RankStep`` of ``rank`` in a decoded step block (None when the rank has no record)."""
    idx = np.flatnonzero(np.asarray(sb["rank"]) == rank)
    if not len(idx):
        return None
    i = int(idx[0])

    def g(k: str) -> float:
        return _num(sb[k][i]) if k in sb else float("nan")

    return RankStep(step, rank, g("ts"), g("step_s"), g("data_s"), g("forward_s"), g("backward_s"), g("optimizer_s"),
                    g("other_s"), g("comm_exposed_s"), g("comm_total_s"), g("mem_peak_bytes"))


def _dim_label(code: int, group_size: int, names: Mapping[int, str], world_size: int | None) -> str:
    name = names.get(int(code)) if code else None
    if name:
        return name
    if world_size and group_size == world_size:
        return "world"
    return f"g{group_size}"


def rank_collectives(cb: Mapping[str, np.ndarray] | None, rank: int, dim_names: Mapping[int, str],
                     world_size: int | None, limit: int | None = None) -> list[Collective]:
    """The collectives of ``rank`` in a decoded collective block, in record order (``seq``); with
    ``limit``, the first ``limit`` records only (what the compactor keeps of a rank-step)."""
    if cb is None or not len(cb["rank"]):
        return []
    idx = np.flatnonzero(np.asarray(cb["rank"]) == rank)
    idx = idx[np.argsort(np.asarray(cb["seq"])[idx], kind="stable")]
    if limit is not None:
        idx = idx[:max(int(limit), 0)]
    out = []
    for i in idx.tolist():
        code = int(cb["op"][i])
        n = int(cb["group_size"][i])
        out.append(Collective(COLLECTIVE_OPS[code] if 0 <= code < len(COLLECTIVE_OPS) else "other",
                              _dim_label(int(cb["dim"][i]), n, dim_names, world_size), n, float(cb["bytes"][i]),
                              max(int(cb["calls"][i]), 1), _num(cb["start_ts"][i]), max(_num(cb["total_s"][i]), 0.0),
                              _num(cb["exposed_s"][i])))
    return out


#: per-call bytes below which a collective carries a few scalars (a loss or metric all-reduce, a flag
#: all-gather), not gradients or parameters: never taken for a gradient reduction or an FSDP gather.
#: Lower than the diagnosis's latency-bound threshold (``SYNC_BYTES``): a tiny model's gradient
#: buckets are latency-bound, yet still gradient reductions that mark where backward ends.
SCALARS_MAX_BYTES = 1024


def _small(c: Placed) -> bool:
    """A synchronisation collective of a few scalars: under ``SCALARS_MAX_BYTES`` per call."""
    return c.bytes / max(c.calls, 1) < SCALARS_MAX_BYTES


def _merge(iv: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _wall(waits: Sequence[tuple[float, float]], busy: float, *, late: bool) -> float:
    """The time from the step's start at which ``busy`` seconds outside the (merged, sorted) ``waits``
    have elapsed: the earliest such time, or with ``late`` the latest (after a wait starting there)."""
    w = busy
    for a, b in waits:
        if a < w - _EPS or (late and a <= w + _EPS):  # equal within the clocks' rounding: at the point
            w += b - a
        else:
            break
    return w


def _ratio(colls: Sequence[Placed]) -> float | None:
    tot = sum(c.end_s - c.start_s for c in colls)
    return 1.0 - sum(c.exposed_s for c in colls) / tot if tot > 0 else None


def timeline(rs: RankStep, colls: Sequence[Collective]) -> Timeline:
    """Place the rank-step's collectives against its backward (module docstring)."""
    placed: list[Placed] = []
    for k in colls:
        if not np.isfinite(k.start_ts) or not np.isfinite(rs.ts):
            continue  # no issue time: cannot be placed
        t0 = k.start_ts - rs.ts
        exp = min(max(float(np.nan_to_num(k.exposed_s)), 0.0), k.total_s)
        placed.append(Placed(k.op, k.dim, k.group_size, k.bytes, k.calls, t0, t0 + k.total_s, exp))
    tl = Timeline(rs.step, rs.rank, rs.step_s, _opt(rs.comm_exposed_s), None, placed,
                  mem_peak_bytes=_opt(rs.mem_peak_bytes))
    inside = [c for c in placed if c.start_s >= -_EPS]
    for c in placed:
        if c.start_s < -_EPS:
            c.phase = "before_step"  # issued between the previous step and this one: not in its time
    tl.overlap_ratio = _ratio(inside)
    if not np.isfinite(rs.backward_s):
        return tl  # no backward measured (manual steps without phases): nothing to place against
    waits = _merge([(c.end_s - c.exposed_s, c.end_s) for c in inside if c.exposed_s > 0])
    before = float(np.nan_to_num(rs.data_s) + np.nan_to_num(rs.forward_s))
    start = _wall(waits, before, late=False)
    busy_end = before + rs.backward_s
    est_end = _wall(waits, busy_end, late=False)
    # issued in backward: up to the latest place backward can end — after the waits that follow it, and
    # after the step's other time in case that ran before backward, but not past the optimizer's time
    # (a collective issued after the optimizer is not a gradient's)
    other = float(np.nan_to_num(rs.other_s))
    slack = other if not np.isfinite(rs.optimizer_s) else min(other, rs.optimizer_s)
    hi = _wall(waits, busy_end + slack, late=True) + _EPS
    # a gradient reduction moves gradients: a small one (a loss or metric all-reduce) is a synchronisation
    grads = [c for c in inside if c.op in GRAD_OPS and start - _EPS <= c.start_s <= hi and not _small(c)]
    if grads:  # the gradients' group: the dimension reducing the most bytes (not a TP all-reduce)
        per_dim: dict[str, float] = {}
        for c in grads:
            per_dim[c.dim] = per_dim.get(c.dim, 0.0) + c.bytes
        top = max(sorted(per_dim), key=lambda d: per_dim[d])
        grads = [c for c in grads if c.dim == top]
    if grads:
        end = max(c.start_s for c in grads)
        tl.backward_end_measured = True
    else:
        end = est_end
    start = min(start, end)
    tl.backward = (start, end)
    grad_ids = {id(c) for c in grads}
    for c in inside:
        c.gradient = id(c) in grad_ids
        c.phase = "before_backward" if c.start_s < start - _EPS else "backward" if c.start_s <= end + _EPS else "after_backward"
    bwd = [c for c in inside if c.phase == "backward"]
    after = _merge([(max(c.end_s - c.exposed_s, end), c.end_s) for c in bwd if c.exposed_s > 0 and c.end_s > end])
    tl.tail_s = float(sum(b - a for a, b in after))
    tl.backward_overlap_ratio = _ratio(bwd)
    return tl


def comm_is_top(bottlenecks: Sequence[Mapping[str, Any]], comm_exposed_s: float | None, step_s: float | None) -> bool:
    """Exposed communication is a top bottleneck: first or second in the summary's ``bottlenecks``, or at
    least ``LIMITS["top_share"]`` of the step (its share there, or the decomposition's)."""
    names = [b.get("component") for b in bottlenecks]
    if "comm_exposed" in names[: int(LIMITS["top_rank"])]:
        return True
    share = next((b.get("share") for b in bottlenecks if b.get("component") == "comm_exposed"), None)
    if isinstance(share, (int, float)) and share >= LIMITS["top_share"]:
        return True
    return bool(comm_exposed_s and step_s and step_s > 0 and comm_exposed_s / step_s >= LIMITS["top_share"])


def latency_fit(samples: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(per-call overhead α s, seconds per byte β) of ``service = α + β × bytes`` by least squares over
    (bytes, service seconds) of single calls; None without ≥ 3 calls of ≥ 2 sizes (the largest at least
    twice the smallest). α is kept within [0, the fastest call]; β ≤ 0 (time does not grow with size)
    gives α = the median call and β = 0."""
    if len(samples) < 3:
        return None
    x = np.array([s[0] for s in samples], dtype=np.float64)
    y = np.array([s[1] for s in samples], dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y) & (y >= 0)
    x, y = x[ok], y[ok]
    if len(x) < 3 or x.min() <= 0 or x.max() < 2 * x.min():
        return None
    vx = float(np.var(x))
    beta = float(np.mean((x - x.mean()) * (y - y.mean())) / vx) if vx > 0 else 0.0
    if beta <= 0:
        return float(np.median(y)), 0.0
    alpha = float(y.mean() - beta * x.mean())
    return min(max(alpha, 0.0), float(y.min())), beta


def _service(colls: Sequence[Placed]) -> list[tuple[float, float]]:
    """(bytes, service s) of single-call collectives in issue order: each one's time from its issue, or
    the previous one's completion when later (one group's collectives run in order), to its completion."""
    out: list[tuple[float, float]] = []
    prev = -np.inf
    for c in sorted(colls, key=lambda c: c.start_s):
        if c.calls == 1:
            out.append((c.bytes, max(c.end_s - max(c.start_s, prev), 0.0)))
        prev = max(prev, c.end_s)
    return out


@dataclass
class _StepFigures:
    step_s: float
    grad_op: str | None
    grad_calls: float
    grad_bytes: float
    grad_min_bytes: float
    grad_exposed: float
    grad_service: float
    group_size: int
    tail: float
    band: float
    ag_fwd_exposed: float
    ag_bwd_exposed: float
    ag_bwd_bytes: float
    ag_bwd_calls: float
    ag_group: int
    samples: list[tuple[float, float]]


def _figures(t: Timeline) -> _StepFigures | None:
    if t.backward is None:
        return None
    grads = [c for c in t.collectives if c.gradient]
    by_op: dict[str, float] = {}
    for c in grads:
        by_op[c.op] = by_op.get(c.op, 0.0) + c.bytes
    op = max(by_op, key=lambda k: by_op[k]) if by_op else None
    main = [c for c in grads if c.op == op]
    samples = _service(main)
    # parameter all-gathers only: a small all-gather (HF's 16-byte one while loading data) is a synchronisation
    ag_f = [c for c in t.collectives if c.op == "all_gather" and c.phase == "before_backward" and not _small(c)]
    ag_b = [c for c in t.collectives if c.op == "all_gather" and c.phase == "backward" and not _small(c)]
    return _StepFigures(
        step_s=t.step_s, grad_op=op, grad_calls=float(sum(c.calls for c in main)),
        grad_bytes=float(sum(c.bytes for c in main)),
        grad_min_bytes=float(min((c.bytes / max(c.calls, 1) for c in main), default=0.0)),
        grad_exposed=float(sum(c.exposed_s for c in main)),
        grad_service=float(sum(s for _, s in samples)) if len(samples) == len(main) else float(
            sum(c.end_s - c.start_s for c in main)),
        group_size=max((c.group_size for c in main), default=1), tail=t.tail_s or 0.0,
        band=t.backward[1] - t.backward[0], ag_fwd_exposed=float(sum(c.exposed_s for c in ag_f)),
        ag_bwd_exposed=float(sum(c.exposed_s for c in ag_b)), ag_bwd_bytes=float(sum(c.bytes for c in ag_b)),
        ag_bwd_calls=float(sum(c.calls for c in ag_b)), ag_group=max((c.group_size for c in ag_b), default=1), samples=samples)  # fmt: skip


def _ms(v: float) -> str:
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %" if x < 0.1 else f"{100 * x:.0f} %"


def _mb(b: float) -> str:
    v = b / _MIB
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def _item(setting: str, suggestion: str, gain: float, step_s: float, why: str) -> dict[str, Any]:
    return {"setting": setting, "suggestion": suggestion, "expected_gain_s": gain,
            "expected_gain_share": gain / step_s if step_s > 0 else None, "bound": "upper", "why": why}


def _withheld(setting: str, why: str) -> dict[str, Any]:
    """An item that cannot be given (its precondition fails): the reason, no suggestion, no gain."""
    return {"setting": setting, "suggestion": None, "expected_gain_s": 0.0, "expected_gain_share": 0.0,
            "bound": "upper", "why": why, "withheld": why}


def _num_fact(facts: Mapping[str, Any] | None, key: str) -> float | None:
    v = (facts or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def _bucket_mean(nbytes: float, n_calls: float, min_call: float, ddp: Mapping[str, Any] | None) -> tuple[float, float, str]:
    """(mean bytes of the gradient buckets, their number, a note): DDP's first bucket is capped at
    ``first_bucket_bytes`` (1 MiB with the default cap), so when it is smaller than the cap it is left
    out of the mean (the smallest all-reduce of the step)."""
    first = _num_fact(ddp, "first_bucket_bytes")
    cap = _num_fact(ddp, "bucket_cap_bytes")
    if first is not None and cap is not None and first < cap and n_calls >= 2 and min_call <= first * 1.01:
        return (nbytes - min_call) / (n_calls - 1), n_calls - 1, f" besides the first bucket (≤ {_mb(first)} MiB)"
    return nbytes / max(n_calls, 1.0), n_calls, ""


#: the share of a device's memory advice may plan to fill (the rest is headroom: fragmentation, spikes)
MEMORY_FILL = 0.9


def _reshard_items(ag_bytes: float, ag_calls: float, n_ag: int, exposed: float, step: float,
                   peak: float | None, device_total: float | None,
                   fsdp: Mapping[str, Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(items, withheld) for all-gathers exposed in backward (``exposed`` s per step). Keeping the
    parameters unsharded from forward to backward (``reshard_after_forward=False``) removes them but
    holds each unit's gathered bytes less its local shard for the whole step. It is advised only when
    that fits: measured peak + extra ≤ ``MEMORY_FILL`` × the device's memory — for every unit whose
    all-gather is exposed, else for as many units as fit (the gain pro rata, at least ``min_gain_share``);
    otherwise, or when the peak or the device's memory is unknown, it is withheld with its memory cost and
    backward prefetch (``set_modules_to_backward_prefetch``: one more unit gathered at a time, its cost
    said) is advised instead — itself withheld when not even that one unit fits."""
    keep = (n_ag - 1) / max(n_ag, 1)  # gathered less the local shard
    extra_all = ag_bytes * keep
    calls = max(ag_calls, 1.0)
    big = _num_fact(fsdp, "largest_unit_bytes")
    unit = big * keep if big is not None and big > 0 else extra_all / calls
    peak = peak if peak is not None and peak > 0 else None
    total = device_total if device_total is not None and device_total > 0 else None
    cost = (f"keeping them unsharded from forward to backward (reshard_after_forward=False) holds ~{_gb(extra_all)} "
            f"more per rank for its {calls:.0f} unit{'s' if calls != 1 else ''} (~{_gb(unit)} per unit: gathered less the "
            "local shard)")
    items: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    if peak is not None and total is not None:
        room = MEMORY_FILL * total - peak
        fits = f"peak {_gb(peak)} + {{extra}} ≤ {MEMORY_FILL:.0%} of the device's {_gb(total)}"
        if extra_all <= room:
            items.append(_item(
                "reshard_after_forward",
                "fully_shard(..., reshard_after_forward=False) for the blocks whose all-gather is exposed in backward",
                exposed, step,
                f"all-gathers issued in backward expose {_ms(exposed)} per step; {cost}, and it fits: "
                + fits.format(extra=_gb(extra_all)) + f". At most {_ms(exposed)} ({_pct(exposed / step)} of the step)."))
            return items, held
        k = int(room // unit) if unit > 0 and room > 0 else 0
        k = min(k, int(calls) - 1)
        gain = exposed * k / calls
        if k >= 1 and gain >= LIMITS["min_gain_share"] * step:
            items.append(_item(
                "reshard_after_forward",
                f"fully_shard(..., reshard_after_forward=False) for at most {k} of the {calls:.0f} blocks whose "
                "all-gather is exposed in backward (the last blocks of forward: backward needs them first)",
                gain, step,
                f"all-gathers issued in backward expose {_ms(exposed)} per step; {cost}. All of them do not fit "
                f"(peak {_gb(peak)} + {_gb(extra_all)} > {MEMORY_FILL:.0%} of the device's {_gb(total)}); {k} "
                "units do: " + fits.format(extra=_gb(k * unit)) + f". At most {_ms(gain)} ({_pct(gain / step)} "
                f"of the step: {k} of {calls:.0f} all-gathers)."))
            return items, held
        why = (f"{cost}, but the device has no room for even one unit: peak {_gb(peak)} + {_gb(unit)} > "
               f"{MEMORY_FILL:.0%} of the device's {_gb(total)}" if k < 1 else
               f"{cost}, but the device ({_gb(total)}, {MEMORY_FILL:.0%} of it usable) has room beside the peak "
               f"({_gb(peak)}) for {k} of them only, removing at most {_ms(gain)} ({_pct(gain / step)} of the step)")
    else:
        known = (f"the peak is {_gb(peak)} per rank" if peak is not None else "the peak memory was not measured")
        why = (f"{cost}; {known} and the device's memory is not reported to fleetscope (nor is there one on CPU), so "
               "it is not advised blindly: check that the peak plus that fits before setting it")
    worth = exposed >= LIMITS["min_gain_share"] * step  # else not worth advice: nothing to explain
    if worth:
        held.append(_withheld("reshard_after_forward", why))
    if peak is not None and total is not None and peak + unit > MEMORY_FILL * total:
        # prefetching holds one more unit gathered: no room for that either
        if worth:
            held.append(_withheld("set_modules_to_backward_prefetch", (
                f"prefetching backward's all-gathers further ahead holds one more unit gathered (~{_gb(unit)} per "
                f"rank), and peak {_gb(peak)} + {_gb(unit)} > {MEMORY_FILL:.0%} of the device's {_gb(total)}: free "
                "memory first (activation checkpointing, a smaller micro-batch) or shorten the all-gathers "
                "(a faster interconnect, a smaller shard group)")))
        return items, held
    items.append(_item(
        "set_modules_to_backward_prefetch",
        "issue the backward all-gathers earlier: block.set_modules_to_backward_prefetch([the next blocks in backward]) "
        "(FSDP2)", exposed, step,
        f"all-gathers issued in backward expose {_ms(exposed)} per step: backward waits for its parameters. "
        "Prefetched further ahead they overlap the previous block's backward, for one more unit gathered at a "
        f"time (~{_gb(unit)} per rank) rather than every unit kept unsharded (~{_gb(extra_all)}, not advised: see "
        f"the note on reshard_after_forward). At most {_ms(exposed)} ({_pct(exposed / step)} of the step)."))
    return items, held


def overlap_advice(timelines: Sequence[Timeline], *, bottlenecks: Sequence[Mapping[str, Any]],
                   comm_exposed_s: float | None, step_s: float | None,
                   mem_peak_bytes: float | None = None, ddp: Mapping[str, Any] | None = None,
                   fsdp: Mapping[str, Any] | None = None,
                   device_total_bytes: float | None = None) -> list[dict[str, Any]]:
    """``[{"setting", "suggestion", "expected_gain_s", "expected_gain_share", "bound", "why"}]``, largest
    gain first; empty unless exposed communication is a top bottleneck (:func:`comm_is_top`). Items
    whose precondition fails carry ``withheld`` (the reason) and no suggestion, after the others.

    ``timelines``: recent steps (each step's median rank); ``step_s``: the run's median step (the share's
    denominator; the timelines' median when None); ``ddp`` / ``fsdp``: the job's facts as the agent
    recorded them (``agent/parallel_facts.py``; None: unknown); ``device_total_bytes``: one device's
    memory (None: not reported) — advice that keeps parameters unsharded is given only when they fit
    beside ``mem_peak_bytes`` (:func:`_reshard_items`). Every gain is an **upper bound**: the
    exposed seconds the change could at most remove, each figure the median over the steps."""
    if not comm_is_top(bottlenecks, comm_exposed_s, step_s):
        return []
    figs = [f for f in (_figures(t) for t in timelines) if f is not None]
    if not figs:
        return []

    def med(k: str) -> float:
        return float(np.median([getattr(f, k) for f in figs]))

    step = float(step_s) if step_s and step_s > 0 else med("step_s")
    if not step > 0:
        return []
    ops = [f.grad_op for f in figs if f.grad_op]
    grad_op = max(set(ops), key=ops.count) if ops else None
    n_calls, nbytes, exposed, service = med("grad_calls"), med("grad_bytes"), med("grad_exposed"), med("grad_service")
    tail, band = med("tail"), med("band")
    n_group = max(f.group_size for f in figs)
    unhideable = max(0.0, service - band)  # gradient communication longer than backward: no bucketing hides it
    out: list[dict[str, Any]] = []
    withheld: list[dict[str, Any]] = []
    latency_item = False

    if grad_op == "all_reduce" and n_calls >= 2:
        fit = latency_fit([s for f in figs for s in f.samples])
        if fit is not None:
            alpha, beta = fit
            latency = n_calls * alpha
            mean_b = nbytes / n_calls
            if latency >= LIMITS["latency_dominates"] * service and exposed > 0:
                latency_item = True
                t = LIMITS["latency_target"]
                target = alpha * (1 - t) / t / beta if beta > 0 else nbytes
                target = min(max(target, 2 * mean_b), max(nbytes, 2 * mean_b))
                gain = min(exposed, (n_calls - 1) * alpha)
                bw = (f"large messages reach {_gb(busbw_factor('all_reduce', n_group) / beta)}/s bus bandwidth"
                      if beta > 0 else "the call time does not grow with the message size")
                out.append(_item(
                    "bucket_cap_mb",
                    f"raise bucket_cap_mb to about {_mb(target)} (now {n_calls:.0f} gradient all-reduces of "
                    f"{_mb(mean_b)} MiB on average per step): fewer, larger buckets",
                    gain, step,
                    f"per-call overhead ≈ {_ms(alpha)} × {n_calls:.0f} calls = {_ms(latency)} of the "
                    f"{_ms(service)} the gradient all-reduces take per step (fit of each call's time against its "
                    f"bytes; {bw}). Merging them removes at most (calls − 1) × overhead, and only the exposed part "
                    f"({_ms(exposed)} per step) shortens the step: at most {_ms(gain)} ({_pct(gain / step)} of the "
                    "step). Larger buckets start later: watch the tail after backward."))
    if tail > 0 and not latency_item and grad_op is not None:
        gain = max(0.0, tail - unhideable)
        setting, sugg, what, why_extra = "", "", "", ""
        one_tensor = False
        held_before = len(withheld)
        if grad_op == "all_reduce":
            setting = "bucket_cap_mb"
            mean_b, n_b, first_note = _bucket_mean(nbytes, n_calls, med("grad_min_bytes"), ddp)
            largest = _num_fact(ddp, "largest_grad_bytes")
            cap = _num_fact(ddp, "bucket_cap_bytes")
            now = f"now bucket_cap_mb = {_mb(cap)}, " if cap is not None else "now "
            if largest is None:
                withheld.append(_withheld(setting, (
                    f"{_ms(tail)} per step of gradient all-reduce runs after backward, but the job's largest gradient "
                    "tensor is unknown (its agent recorded no DDP facts): DDP cannot split one parameter across "
                    "buckets, so no smaller bucket_cap_mb is advised without it")))
                setting = ""
            else:
                target = max(mean_b / 2, largest)
                if target > (1 - LIMITS["min_bucket_cut"]) * mean_b:
                    withheld.append(_withheld(setting, (
                        f"the gradient buckets ({n_b:.0f} of {_mb(mean_b)} MiB on average{first_note}) already hold "
                        f"about one gradient tensor each: the largest is {_mb(largest)} MiB and DDP cannot split one "
                        "parameter across buckets, so a smaller bucket_cap_mb cannot shorten the all-reduce left "
                        "after backward")))
                    setting = ""
                    one_tensor = True  # no bucketing hides any of the tail: only fewer bytes or fewer syncs do
                else:
                    gain *= min(1.0, (mean_b - target) / (mean_b / 2))
                    sugg = (f"lower bucket_cap_mb to about {_mb(target)} ({now}{n_b:.0f} buckets of {_mb(mean_b)} MiB "
                            f"on average{first_note}): more, smaller buckets, so less of the gradient all-reduce is "
                            "left when backward ends")
                    what = "the all-reduce of the last bucket(s)"
                    why_extra = (f" No bucket can be smaller than the largest gradient tensor ({_mb(largest)} MiB): DDP "
                                 "does not split a parameter across buckets.")
                    if (ddp or {}).get("gradient_as_bucket_view") is False:
                        why_extra += (" gradient_as_bucket_view is off: each bucket is a copy of its gradients, made "
                                      "before its all-reduce.")
        else:
            setting = "fully_shard units"
            units = _num_fact(fsdp, "units")
            big, small = _num_fact(fsdp, "largest_unit_bytes"), _num_fact(fsdp, "smallest_unit_bytes")
            if units is not None and big is not None and small is not None and big <= 2 * small:
                withheld.append(_withheld(setting, (
                    f"the job's {units:.0f} FSDP units are of similar size (the largest {_mb(big)} MiB, the smallest "
                    f"{_mb(small)} MiB of parameters): smaller units mean splitting its blocks, not wrapping them")))
                setting = ""
            else:
                sizes = (f" (now {units:.0f} units, the largest {_mb(big)} MiB of parameters)"
                         if units is not None and big is not None else "")
                sugg = ("apply fully_shard to each block (smaller units), so the reduce-scatter left when backward "
                        f"ends is the last unit's only{sizes}")
                what = "the last reduce-scatter(s)"
        if gain < LIMITS["min_gain_share"] * step:
            del withheld[held_before:]  # not worth advice even if it could be given: nothing to explain
        if setting:
            out.append(_item(
                setting, sugg, gain, step,
                f"{_ms(tail)} per step of gradient {grad_op.replace('_', '-')} runs after backward ends ({what}, issued "
                f"last) and the optimizer waits for it; of it, {_ms(unhideable)} cannot be hidden by any bucketing "
                f"(the gradient communication takes {_ms(service)}, backward {_ms(band)}): at most {_ms(gain)} "
                f"({_pct(gain / step)} of the step).{why_extra}"))
        if one_tensor:
            g = tail
            how = "compress gradients to bf16 (model.register_comm_hook(None, bf16_compress_hook))"
            out.append(_item(
                "gradient bytes", f"{how}, synchronise less often (gradient accumulation with no_sync), or a "
                "faster interconnect", g, step,
                f"{_ms(tail)} per step of gradient all-reduce runs after backward ends, and the buckets already hold "
                "one gradient tensor each (DDP cannot split a parameter): no bucket size shortens it; halving the "
                f"bytes or syncing less often removes at most {_ms(g)} ({_pct(g / step)} of the step)."))
        elif unhideable > 0:
            g = min(tail, unhideable)
            how = ("compress gradients to bf16 (model.register_comm_hook(None, bf16_compress_hook))"
                   if grad_op == "all_reduce" else "reduce in bf16 (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))")
            out.append(_item(
                "gradient bytes", f"{how}, synchronise less often (gradient accumulation with no_sync / "
                "set_requires_gradient_sync(False)), or a faster interconnect",
                g, step,
                f"the gradient communication ({_ms(service)} per step) is longer than backward ({_ms(band)}): "
                f"{_ms(unhideable)} of it cannot overlap whatever the buckets; halving the bytes or syncing less "
                f"often removes at most {_ms(g)} ({_pct(g / step)} of the step)."))
    ag_b, ag_f = med("ag_bwd_exposed"), med("ag_fwd_exposed")
    if ag_b > 0:
        out_b, held_b = _reshard_items(med("ag_bwd_bytes"), med("ag_bwd_calls"), max(f.ag_group for f in figs), ag_b,
                                       step, mem_peak_bytes, device_total_bytes, fsdp)
        out += out_b
        withheld += held_b
    if ag_f > 0:
        out.append(_item(
            "set_modules_to_forward_prefetch",
            "prefetch the next blocks' all-gathers in forward: block.set_modules_to_forward_prefetch([next blocks]) "
            "(FSDP2), so they run while the current block computes",
            ag_f, step,
            f"all-gathers issued before backward (forward) expose {_ms(ag_f)} per step: compute waits for its "
            f"parameters. Issued one block ahead they overlap the previous block: at most {_ms(ag_f)} "
            f"({_pct(ag_f / step)} of the step)."))
    keep = [a for a in out if a["expected_gain_s"] >= LIMITS["min_gain_share"] * step]
    return sorted(keep, key=lambda a: -a["expected_gain_s"]) + withheld
