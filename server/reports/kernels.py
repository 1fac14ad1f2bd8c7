"""Kernel hotspots of a run (``GET /api/v1/runs/{id}/kernels``, the run page's Kernels panel): the
agent's sampled trace windows folded into bounded per-run sums when read (``store.kernels``,
``analysis.kernels``), then the top kernels by time with category, share, trend and rank spread."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from ..analysis.kernels import fold_rows, kernel_report, top_names
from ..store import kernels as store

__all__ = ["run_kernels"]


def run_kernels(engine: Engine, run_id: int, *, top: int = 20) -> dict[str, Any]:
    """Fold the run's new trace windows, then its top ``top`` kernels (docs/metrics.md, "Kernel hotspots")."""
    folded = store.fold_new_windows(engine, run_id, fold_rows)
    totals = store.kernel_totals(engine, run_id)
    names = top_names(totals, top)
    report = kernel_report(store.rank_summary(engine, run_id), totals, store.kernel_spread(engine, run_id, names), top)
    return {"run_id": run_id, **report, "folded_now": folded}
