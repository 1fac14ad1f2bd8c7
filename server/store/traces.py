"""Reduced Kineto traces attached to a run: the ``trace_summaries`` table, plus the summaries the
agent's sampled tracing sends as ``trace_summary`` events.

One row per (run, rank, source file) holds that rank's summary (``fleetscope.traces``: temporal
breakdown, overlap, idle breakdown, kernel types, top kernels, per-step decomposition). The row with
``rank = -1`` holds what spans the ranks of one import (kernel-type totals, late-start stragglers).
Re-importing the same file replaces its row (upsert on the primary key).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine, text

from ..analysis.kernels import bound_top_kernels
from ..limits import MAX_KERNELS_PER_TRACE, MAX_PAGE_ROWS
from . import bounds

__all__ = ["save_traces", "run_traces", "SET_RANK"]

SET_RANK = -1  # the row of cross-rank figures of one import


def save_traces(engine: Engine, *, run_id: int, rows: list[tuple[int, str, dict[str, Any]]]) -> int:
    """Upsert ``(rank, source, summary)`` rows of one run in one transaction; returns how many. Each
    summary keeps at most ``MAX_KERNELS_PER_TRACE`` named kernels in ``top_kernels``, the rest summed
    into "others" rows (``analysis.kernels.bound_top_kernels``; counted as the run's folded "kernels")."""
    if not rows:
        return 0
    params = []
    n_folded = 0
    for rank, source, summary in rows:
        if isinstance(summary, dict) and "top_kernels" in summary:
            top, k = bound_top_kernels(summary["top_kernels"], MAX_KERNELS_PER_TRACE)
            if k or top is not summary["top_kernels"]:
                summary = {**summary, "top_kernels": top}
            n_folded += k
        params.append({"run": run_id, "rank": rank, "source": source, "summary": json.dumps(summary, allow_nan=False)})
    with engine.begin() as c:
        bounds.add_folded_in(c, [(run_id, "kernels", n_folded)])
        c.execute(
            text(
                "INSERT INTO trace_summaries (run_id, rank, source, summary, created_at) "
                "VALUES (:run, :rank, :source, CAST(:summary AS JSONB), now()) "
                "ON CONFLICT (run_id, rank, source) DO UPDATE SET summary = EXCLUDED.summary, "
                "created_at = EXCLUDED.created_at"
            ),
            params,
        )
    return len(rows)


#: stored (TOAST-compressed) bytes of trace summaries one read returns per source, at most
READ_BUDGET_BYTES = 16 << 20


def run_traces(engine: Engine, run_id: int, limit: int = MAX_PAGE_ROWS) -> list[dict[str, Any]]:
    """The run's trace summaries, ranks ascending (the cross-rank row, ``rank = -1``, first): at most
    ``limit`` imported and ``limit`` sampled ones, each within ``READ_BUDGET_BYTES`` of stored JSON, the
    first ``limit`` of them together.

    Each item: ``{"rank", "source", "created_at", "summary"}``. A rank's summary carries
    ``kernel_time_us``, ``idle_pct``, ``compute_pct``, ``non_compute_pct``, ``comm_overlap_pct``,
    ``idle_breakdown``, ``kernel_types``, ``top_kernels`` and ``steps`` (see docs/traces.md).
    """
    with engine.connect() as c:
        # bounded in bytes too (``READ_BUDGET_BYTES`` of stored JSON per source), not only in rows: the
        # running sum of the stored sizes is computed before any payload is read
        rows = c.execute(
            text("SELECT rank, source, created_at, summary FROM ("
                 "  SELECT rank, source, created_at, summary, sum(pg_column_size(summary)) OVER ("
                 "    ORDER BY rank, source ROWS UNBOUNDED PRECEDING) AS cum"
                 "  FROM (SELECT rank, source, created_at, summary FROM trace_summaries WHERE run_id = :run "
                 "        ORDER BY rank, source LIMIT :k) t) u "
                 "WHERE cum <= :budget ORDER BY rank, source"),
            {"run": run_id, "k": limit, "budget": READ_BUDGET_BYTES},
        ).fetchall()
        # the agent's sampled tracing sends its summaries as `trace_summary` events (agent/tracing.py)
        sampled = c.execute(
            text("SELECT rank, data FROM ("
                 "  SELECT rank, step, data, sum(pg_column_size(data)) OVER ("
                 "    ORDER BY rank, step ROWS UNBOUNDED PRECEDING) AS cum"
                 "  FROM (SELECT rank, step, data FROM run_events WHERE run_id = :run AND kind = 'trace_summary' "
                 "        ORDER BY rank, step LIMIT :k) t) u "
                 "WHERE cum <= :budget ORDER BY rank, step"),
            {"run": run_id, "k": limit, "budget": READ_BUDGET_BYTES},
        ).fetchall()
    out = [
        {"rank": r.rank, "source": r.source, "created_at": r.created_at.isoformat() if r.created_at is not None else None,
         "summary": r.summary}
        for r in rows
    ]
    for rank, data in sampled:
        summary = (data or {}).get("summary")
        if isinstance(summary, dict):
            out.append({"rank": rank, "source": summary.get("source") or "sampled", "created_at": None, "summary": summary})
    out.sort(key=lambda d: (d["rank"], d["source"]))
    return out[:limit]
