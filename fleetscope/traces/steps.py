"""docs/metrics.md's exact per-step decomposition from a trace: every instant of a ProfilerStep gets one
label (compute > exposed communication > data > other), on the GPU timeline, or on the CPU
timeline for traces without GPU events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import intervals as iv
from .classify import COMMUNICATION, COMPUTATION, ITER_NAME_RE, MEMORY
from .kept import Kept, as_number, merge

if TYPE_CHECKING:
    import numpy as np

__all__ = ["steps_gpu", "steps_cpu"]

_HTOD_PREFIXES = ("Memcpy HtoD", "hipMemcpyHtoD")


def steps_gpu(k: Kept) -> list[dict[str, Any]]:
    """Per ProfilerStep, docs/metrics.md's exact decomposition on the GPU timeline.

    The step is the ProfilerStep's wall-clock interval (Kineto puts CPU and GPU on one clock); every
    instant of it gets one label, by priority: compute (a non-communication kernel, memcpy or memset
    other than a host-to-device copy runs) > exposed communication (only NCCL kernels run) > data (a
    host-to-device copy runs or the host is in ``DataLoader.__next__``) > other (idle, host overhead).
    """
    import numpy as np

    ts, end, types = k.on_gpu(k.ts), k.on_gpu(k.end), k.on_gpu(k.types)
    names = k.rt.names
    htod_ids = np.array([n.startswith(_HTOD_PREFIXES) for n in names], dtype=bool)
    htod = htod_ids[k.on_gpu(k.name)] if len(names) else np.zeros(len(ts), dtype=bool)
    comp_mask = ((types == COMPUTATION) | (types == MEMORY)) & ~htod
    C = merge(ts[comp_mask], end[comp_mask])
    A = merge(ts[types == COMMUNICATION], end[types == COMMUNICATION])
    H = merge(ts[htod], end[htod])
    ALL = merge(ts, end)
    out = []
    for n, lo, hi in _windows(k):
        d = _clip_set(k.rt.dataloader, lo, hi, k.base)
        h = _clip_np(H, lo, hi)
        out.append(
            _decompose(
                n, lo, hi, _clip_np(C, lo, hi), _clip_np(A, lo, hi), iv.union(h, d), _clip_np(ALL, lo, hi)
            )
        )
    return out


def _clip_np(merged: tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> iv.IntervalList:
    """The part of a merged (sorted, disjoint) numpy interval list inside ``[lo, hi)``, as lists."""
    import numpy as np

    starts, ends = merged
    i = int(np.searchsorted(ends, lo, side="right"))
    j = int(np.searchsorted(starts, hi, side="left"))
    if i >= j:
        return [], []
    s = starts[i:j].tolist()
    e = ends[i:j].tolist()
    s[0] = max(s[0], lo)
    e[-1] = min(e[-1], hi)
    return s, e


def steps_cpu(k: Kept) -> list[dict[str, Any]]:
    """CPU-only traces: the same decomposition on the CPU timeline (data loading > collectives > ops)."""
    rt = k.rt
    out = []
    for n, lo, hi in _windows(k):
        d = _clip_set(rt.dataloader, lo, hi, k.base)
        a = iv.difference(_clip_set(rt.cpu_comm, lo, hi, k.base), d)
        ops = _clip_set(rt.cpu_ops, lo, hi, k.base) if rt.cpu_ops is not None else iv.EMPTY
        c = iv.difference(ops, iv.union(d, a))
        out.append(_decompose(n, lo, hi, c, a, d, iv.union(ops, d, a)))
    return out


def _clip_set(s: iv.IntervalSet, lo: float, hi: float, base: float) -> iv.IntervalList:
    """The part of an absolute-time CPU interval set inside the rank-relative window ``[lo, hi)``."""
    starts, ends = s.clipped(lo + base, hi + base)
    return [x - base for x in starts], [x - base for x in ends]


def _windows(k: Kept) -> list[tuple[str, float, float]]:
    return sorted((s for s in k.kept_steps if s[2] > s[1]), key=lambda s: s[1])


def _decompose(
    name: str,
    lo: float,
    hi: float,
    c: iv.IntervalList,
    a: iv.IntervalList,
    d: iv.IntervalList,
    busy: iv.IntervalList,
) -> dict[str, Any]:
    """One step ``[lo, hi)`` from its already clipped sets: compute ``c``, communication ``a``, data
    ``d`` and everything that ran ``busy``."""
    m = ITER_NAME_RE.match(name)
    step_us = hi - lo
    compute = iv.measure(c)
    comm_total = iv.measure(a)
    exposed = iv.measure(iv.difference(a, c))
    data = iv.measure(iv.difference(d, iv.union(c, a)))
    other = step_us - compute - exposed - data
    idle = step_us - iv.measure(busy)

    def s(x: float) -> float:
        return round(x / 1e6, 9)

    return {
        "step": int(m.group(1)) if m else None,
        "offset_us": as_number(lo),
        "step_s": s(step_us),
        "data_s": s(data),
        "compute_s": s(compute),
        "comm_exposed_s": s(exposed),
        "comm_total_s": s(comm_total),
        "other_s": s(other),
        "idle_s": s(idle),
        "overlap_ratio": round(1 - exposed / comm_total, 6) if comm_total > 0 else None,
    }
