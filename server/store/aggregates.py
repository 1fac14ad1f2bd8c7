"""Per-run aggregates over ``steps`` — the one aggregate loader for any number of runs — and the
``run_stats`` table that caches the figures derived from them.

One set-based query gives, per run, the medians over steps of the rollup columns and of the
``steps.PER_STEP`` quantities, the sums the shares are made of, and the counts. Every per-run figure
of the API and the dashboard (summary, fleet table, compare, scaling, regressions, ``check``) is
derived from this row by ``analysis.figures.run_figures``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from sqlalchemy import Engine, text

from .rows import RunAggregate
from .steps import PER_STEP

__all__ = ["RunAggregate", "load_aggregates", "load_aggregates_without", "load_cached_figures", "save_figures"]


def _med(expr: str, name: str, q: float = 0.5) -> str:
    return f"percentile_cont({q}) WITHIN GROUP (ORDER BY {expr}) AS {name}"


_AGG_SQL = f"""
SELECT run_id, count(*) AS n,
  {_med("step_s", "step_s")}, {_med("step_s_max", "step_s_max_p95", 0.95)},
  {_med("data_s", "data_s")}, {_med("compute_s", "compute_s")}, {_med("comm_exposed_s", "comm_exposed_s")},
  {_med("other_s", "other_s")}, {_med("comm_total_s", "comm_total_s")},
  {_med("forward_s", "forward_s")}, {_med("backward_s", "backward_s")}, {_med("optimizer_s", "optimizer_s")},
  {_med("work_s_max - work_s", "straggler_wait_s")},
  sum(step_s) AS sum_step_s, sum(data_s) AS sum_data_s, sum(compute_s) AS sum_compute_s,
  sum(comm_exposed_s) AS sum_comm_exposed_s, sum(other_s) AS sum_other_s, sum(comm_total_s) AS sum_comm_total_s,
  sum({PER_STEP["wait_s"]}) AS sum_wait_s, sum({PER_STEP["wait_in_comm_s"]}) AS sum_wait_in_comm_s,
  {_med(PER_STEP["flops_per_dev_s"], "flops_per_dev_s")}, {_med(PER_STEP["tokens_per_s_raw"], "tokens_per_s_raw")},
  {_med(PER_STEP["tokens_per_rank"], "tokens_per_rank_step")}, {_med("tokens", "tokens_per_step")},
  {_med("n_ranks", "n_ranks")},
  sum(tokens) AS sum_tokens, sum(padded_tokens) AS sum_padded_tokens, max(mem_peak_bytes) AS mem_peak_bytes,
  sum(alloc_retries) AS alloc_retries, sum(neg_residual) AS neg_residual_steps,
  {_med(PER_STEP["skew"], "skew_p50")}, {_med(PER_STEP["skew"], "skew_p95", 0.95)}, max({PER_STEP["skew"]}) AS skew_max,
  min(ts) AS first_ts, max(ts) AS last_ts,
  {_med(PER_STEP["hw_flops_per_dev_s"], "hw_flops_per_dev_s")}, sum(hw_flops) AS sum_hw_flops,
  sum(flops) FILTER (WHERE hw_flops IS NOT NULL) AS sum_flops_with_hw,
  sum(tokens) FILTER (WHERE hw_flops IS NOT NULL) AS sum_tokens_with_hw,
  sum(padded_tokens) FILTER (WHERE hw_flops IS NOT NULL) AS sum_padded_with_hw,
  {_med(PER_STEP["flops_per_rank"], "flops_per_rank_step")},
  {_med(PER_STEP["hw_flops_per_rank"], "hw_flops_per_rank_step")}
FROM steps WHERE run_id = ANY(:ids) AND n_ranks > 0 GROUP BY run_id
"""

_FIELDS = tuple(f.name for f in fields(RunAggregate))


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


def load_aggregates(engine: Engine, run_ids: Iterable[int]) -> dict[int, RunAggregate]:
    """Aggregates of these runs (runs without a compacted step are absent), in one query."""
    ids = [int(r) for r in run_ids]
    if not ids:
        return {}
    out: dict[int, RunAggregate] = {}
    with engine.connect() as c:
        for row in c.execute(text(_AGG_SQL), {"ids": ids}):
            m = row._mapping
            out[int(m["run_id"])] = RunAggregate(n=int(m["n"]), **{k: _num(m[k]) for k in _FIELDS if k != "n"})
    return out


_WHERE = "FROM steps WHERE run_id = ANY(:ids) AND n_ranks > 0 GROUP BY run_id"
if _WHERE not in _AGG_SQL:  # the aggregate query changed shape: the steady-state variant must follow
    raise RuntimeError("aggregates: _AGG_SQL no longer ends with its WHERE clause")
#: a (run, step) pair as one bigint: run_id · 2^32 + step (steps are below 2^32); a plain filter on the
#: rows the run_id condition selects, so it runs unchanged on Citus (no join, no subquery)
_STEP_KEY = "run_id::bigint * 4294967296 + step"
_AGG_WITHOUT_SQL = _AGG_SQL.replace(
    _WHERE, f"FROM steps WHERE run_id = ANY(:ids) AND n_ranks > 0 AND NOT ({_STEP_KEY} = ANY(:skip)) GROUP BY run_id")


def load_aggregates_without(engine: Engine, run_ids: Iterable[int],
                            skip: Mapping[int, Iterable[int]]) -> dict[int, RunAggregate]:
    """:func:`load_aggregates` over each run's compacted steps except its ``skip[run]`` ones (the
    steady-state basis, ``analysis.steady``), in one query; runs left without a step are absent."""
    ids = [int(r) for r in run_ids]
    if not ids:
        return {}
    keys = [int(rid) * 4294967296 + int(st) for rid, sts in skip.items() for st in sts]
    out: dict[int, RunAggregate] = {}
    with engine.connect() as c:
        for row in c.execute(text(_AGG_WITHOUT_SQL), {"ids": ids, "skip": keys}):
            m = row._mapping
            out[int(m["run_id"])] = RunAggregate(n=int(m["n"]), **{k: _num(m[k]) for k in _FIELDS if k != "n"})
    return out


def load_cached_figures(engine: Engine, run_ids: Iterable[int]) -> dict[int, tuple[int, str, dict[str, Any]]]:
    """{run id: (rank_steps, status, figures)} as cached in ``run_stats`` when they were computed."""
    with engine.connect() as c:
        return {int(r[0]): (int(r[1]), r[2], r[3]) for r in c.execute(
            text("SELECT run_id, rank_steps, status, stats FROM run_stats WHERE run_id = ANY(:ids)"),
            {"ids": [int(i) for i in run_ids]})}


def save_figures(engine: Engine, rows: Mapping[int, tuple[int, str, dict[str, Any]]]) -> None:
    """Upsert {run id: (rank_steps, status, figures)} into ``run_stats`` (figures as strict JSON)."""
    if not rows:
        return
    with engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO run_stats (run_id, rank_steps, status, stats, computed_at) "
                "VALUES (:id, :steps, :status, CAST(:stats AS jsonb), now()) ON CONFLICT (run_id) DO UPDATE SET "
                "rank_steps = excluded.rank_steps, status = excluded.status, stats = excluded.stats, computed_at = excluded.computed_at"
            ),
            [{"id": rid, "steps": rs, "status": st, "stats": json.dumps(v, allow_nan=False)}
             for rid, (rs, st, v) in rows.items()],
        )
