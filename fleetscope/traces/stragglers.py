"""Late-starting-communication straggler detection across ranks (TRACE_FORMULAS.md §2.7, HTA's
``find_stragglers_with_late_start_comm_kernels``).

In a synchronous job every rank's collective ends at about the same time, so the rank whose last
long communication kernel of an iteration *starts* latest is the one the others waited for.
``late_start_stragglers(corrected=False)`` reproduces HTA, including its failure modes (reported as
``error`` rather than raised). ``corrected=True`` also takes ``ncclDevKernel_*`` names: HTA only
takes ``ncclKernel*`` and so finds nothing on NCCL >= 2.19 (HTA issue #360).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from .analysis import StragglerInput
from .classify import is_straggler_comm_kernel

__all__ = ["late_start_stragglers"]


def _std(xs: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return math.nan
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def late_start_stragglers(
    inputs: list[StragglerInput],
    *,
    num_candidates: int = 1,
    corrected: bool = False,
    min_normalized_duration: float = 0.01,
) -> dict[str, Any]:
    """Ranks ordered by how often they started the dominant communication kernel last."""
    k = max(1, num_candidates)
    out: dict[str, Any] = {
        "ranks": [],
        "error": None,
        "comm_kernel_rule": "ncclKernel* or ncclDevKernel*" if corrected else "ncclKernel* (HTA)",
        "num_candidates": k,
    }
    steps = sorted(set().union(*(i.kept_steps for i in inputs))) if inputs else []
    if not steps:
        out["error"] = (
            "no ProfilerStep in the analysed window (HTA: invalid value for argument: profiler_steps)"
        )
        return out
    sset = set(steps)
    present: set[int] = set()
    t_min = math.inf
    max_end = -math.inf
    for inp in inputs:
        for it, (lo, hi) in inp.windows.items():
            if it in sset:
                present.add(it)
                t_min = min(t_min, lo)
                max_end = max(max_end, hi)
    n_iters = len(present)
    if n_iters == 0:
        out["error"] = "no event in the analysed iterations"
        return out
    mean_iter = (max_end - t_min) / float(n_iters)
    min_dur = mean_iter * min_normalized_duration
    out["iterations"] = sorted(present)
    out["mean_iteration_us"] = mean_iter

    last: dict[tuple[int, int, int, str], tuple[float, float]] = {}
    for inp in inputs:
        for stream, it, name, ts, dur in inp.comm:
            if it > 0 and it in sset and dur >= min_dur and is_straggler_comm_kernel(name, corrected):
                last[(inp.rank, stream, it, name)] = (ts, dur)  # file order: the last one wins
    if not last:
        out["error"] = (
            "no communication kernel lasting >= 1% of the mean iteration time "
            "(HTA: attempt to get argmax of an empty sequence)"
        )
        return out
    by_group: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    for (_rank, stream, it, name), (_ts, dur) in sorted(last.items()):
        by_group[(stream, it, name)].append(dur / mean_iter)
    per_kernel: dict[tuple[int, str], list[float]] = defaultdict(list)
    for (stream, _it, name), durs in sorted(by_group.items()):
        sd = _std(durs)
        if not math.isnan(sd):
            per_kernel[(stream, name)].append(sd)
    if not per_kernel:
        out["error"] = (
            "no communication kernel is shared by two ranks on the same stream "
            "(HTA: Encountered all NA values; it needs >= 2 ranks)"
        )
        return out
    best = max(sorted(per_kernel), key=lambda key: sum(per_kernel[key]) / len(per_kernel[key]))
    stream, name = best
    cand = sorted(
        (rank, it, (ts - t_min) / mean_iter)
        for (rank, s, it, n), (ts, _d) in last.items()
        if s == stream and n == name
    )
    out["kernel"] = {"stream": stream, "name": name}
    out["metric"] = [{"rank": r, "iteration": it, "normalized_start": v} for r, it, v in cand]
    iters = sorted({it for _, it, _ in cand})
    counts: dict[int, int] = {}
    for it in iters:
        if it < 0:
            continue
        vals = [(r, v) for r, i, v in cand if i == it]
        ordered = sorted((v for _, v in vals), reverse=True)
        if len(ordered) < k:
            out["error"] = (
                f"only {len(ordered)} ranks ran the kernel in iteration {it}, fewer than num_candidates={k}"
            )
            return out
        threshold = ordered[k - 1]
        for r, v in vals:
            counts[r] = counts.get(r, 0) + (1 if v >= threshold else 0)
    ranked = sorted(sorted(counts), key=lambda r: -counts[r])  # stable: ties keep rank order
    out["counts"] = {str(r): counts[r] for r in sorted(counts)}
    out["ranks"] = ranked[:k]
    return out
