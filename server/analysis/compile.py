"""torch.compile health of a run (docs/metrics.md, "Compile health"), from what its ranks reported
(``store.compile.load_compile``; the agent's events, agent/compile_watch.py).

Ranks of a data-parallel job compile the same graphs, so a run's figure is the maximum over ranks of
each rank's figure, not their sum: ``compiles`` and ``recompiles`` (Dynamo frame compiles; lazy
backward compiles and CUDA-graph recordings are not counted, their time is), ``compile_s`` (the
rank's summed compile time), ``cudagraph_replays``. A rank's figure is the larger of what its
``compile`` events count and what its final ``compile_summary`` says (it also counts compiles the
agent did not send an event for). ``graph_breaks`` is the number of distinct graph-break reasons
(a reason names the break type and the user's line); a reason's ``count`` is the maximum over
ranks of how often that rank met it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["compile_health", "TOP_REASONS"]

TOP_REASONS = 20
"""Reasons of each kind in the summary, most frequent first."""


def _max(values: Sequence[float | int | None]) -> Any:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def compile_health(
    totals: Sequence[tuple[int, str, int | None, int | None, float | None]],
    reasons: Sequence[tuple[str, str, int, int]],
    recompile_steps: Sequence[int],
    replays: Sequence[tuple[int, int]],
    *,
    has_events: bool,
    top: int = TOP_REASONS,
) -> dict[str, Any] | None:
    """The summary's ``compile`` object; None when the run has no compile events.

    ``totals``: ``(rank, source, compiles, recompiles, compile_s)`` with source "events" or
    "summary"; ``reasons``: ``(kind, reason, count, distinct of that kind)``, count already the
    maximum over ranks; ``replays``: ``(rank, replays)``."""
    if not has_events:
        return None
    per_rank: dict[int, list[Any]] = {}
    for rank, _source, compiles, recompiles, seconds in totals:
        cur = per_rank.setdefault(rank, [None, None, None])
        for i, v in enumerate((compiles, recompiles, seconds)):
            if v is not None and (cur[i] is None or v > cur[i]):
                cur[i] = v
    ranks = list(per_rank.values())
    out_reasons: dict[str, list[dict[str, Any]]] = {"recompile": [], "graph_break": []}
    distinct = {"recompile": 0, "graph_break": 0}
    for kind, reason, count, n in reasons:
        if kind not in out_reasons:
            continue
        out_reasons[kind].append({"reason": reason, "count": int(count)})
        distinct[kind] = max(distinct[kind], int(n))
    for kind, items in out_reasons.items():
        items.sort(key=lambda d: (-d["count"], d["reason"]))
        distinct[kind] = max(distinct[kind], len(items))
        out_reasons[kind] = items[:top]
    seconds = _max([r[2] for r in ranks])
    return {
        "compiles": int(_max([r[0] for r in ranks]) or 0),
        "recompiles": int(_max([r[1] for r in ranks]) or 0),
        "graph_breaks": distinct["graph_break"],
        "compile_s": float(seconds) if seconds is not None else 0.0,
        "reasons": out_reasons,
        "recompile_reasons": distinct["recompile"],
        "recompile_steps": sorted({int(s) for s in recompile_steps}),
        "cudagraph_replays": int(_max([n for _, n in replays]) or 0),
        "ranks": len(per_rank),
    }
