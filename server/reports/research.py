"""Reports for research workflows: runs filtered / sorted / grouped by config, meta, tags, commit, time,
figures and training scalars (``GET /api/v1/runs``, the runs table page), a run's training scalars
(``/scalars``) and its per-step rows (``/steps``, the notebook client)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from ..analysis.goodput import CHECKPOINT_KINDS, EVAL_KINDS
from ..store import run_query, scalars, step_rows
from ..store import runs as run_store
from ..store.run_query import FIGURES, QueryError, RunQuery
from . import scope
from .runs import figures as run_figures

__all__ = ["runs_view", "groups_view", "run_scalars", "run_steps", "scalar_names", "CHECKPOINT_KINDS", "EVAL_KINDS", "QueryError", "RunQuery", "parse_query",
           "FIGURES", "STALE_REFRESH", "parse_clauses",
           "key_options"]

parse_query = run_query.parse_query
parse_clauses = run_query.parse_clauses
key_options = run_query.key_options
#: runs whose stored figures one query refreshes at most before it filters, sorts or groups by a figure
STALE_REFRESH = 200


def _uses_figures(q: RunQuery, columns: Sequence[str]) -> bool:
    names = [f.field for f in q.filters] + [n for n, _ in q.sort] + list(columns)
    return bool(q.group_by) or any(n in FIGURES for n in names)


def _refresh(engine: Engine) -> None:
    """Bring the stored figures of up to STALE_REFRESH runs up to date (missing or older than the run's
    counters), so that figure filters and sorts see what the pages show."""
    ids = run_query.stale_figure_runs(engine, STALE_REFRESH)
    if ids:
        run_figures(engine, list(run_store.runs_by_ids(engine, ids).values()))


def _figures(f: Any) -> dict[str, Any]:
    return {"steps": f.steps, **{k: getattr(f, k) for k in FIGURES if hasattr(f, k)}}


def runs_view(engine: Engine, q: RunQuery, *, columns: Sequence[str] = (), with_figures: bool = False) -> dict[str, Any]:
    """``{"runs": [run, …], "total", "offset", "limit"}``: each run as the API shows it, with ``figures``
    (fresh, when asked) and ``columns`` ({column: value} of the requested extra columns)."""
    if _uses_figures(q, columns):
        _refresh(engine)
    q.owners = scope.visible_keys()  # the reader's runs only (reports/scope.py)
    total, rows, extras = run_query.query_runs(engine, q, columns=columns)
    figs = run_figures(engine, rows) if with_figures and rows else {}
    out = []
    for r in rows:
        d = r.as_dict()
        if with_figures:
            d["figures"] = _figures(figs[r.id])
        if columns:
            d["columns"] = extras.get(r.id, {})
        out.append(d)
    return {"runs": out, "total": total, "offset": q.offset, "limit": q.limit}


def groups_view(engine: Engine, q: RunQuery) -> dict[str, Any]:
    """``{"groups": [{key: value, …, "count", "median_mfu", "median_tokens_per_s_per_gpu",
    "median_step_s"}], "group_by": [...], "total": runs matching}``."""
    _refresh(engine)
    q.owners = scope.visible_keys()
    groups = run_query.group_runs(engine, q)
    return {"groups": groups, "group_by": q.group_by, "total": sum(g["count"] for g in groups)}


def scalar_names(engine: Engine, run_id: int) -> list[str]:
    """The training scalars a run logged (names), for pickers; none for a run the reader may not see."""
    if not scope.is_visible(engine, run_id):
        return []
    return scalars.scalar_names(engine, run_id)


def run_scalars(engine: Engine, run_id: int, names: Sequence[str] | None, max_points: int) -> dict[str, Any]:
    scope.check_visible(engine, run_id)
    return {"scalars": scalars.run_scalars(engine, run_id, names, max_points),
            "names": scalars.scalar_names(engine, run_id)}


def run_steps(engine: Engine, run_id: int, *, offset: int, limit: int, after: int | None) -> dict[str, Any] | None:
    """``{"steps": [row, …], "total", "offset", "limit", "fields"}`` or None without such a run."""
    if not scope.is_visible(engine, run_id):
        return None
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    total, rows = step_rows.step_page(engine, run_id, peak_flops=run.peak_flops, mp_size=run.mp_size,
                                      world_size=run.world_size, offset=offset, limit=limit, after=after)
    return {"steps": rows, "total": total, "offset": offset, "limit": limit, "fields": list(step_rows.STEP_FIELDS)}
