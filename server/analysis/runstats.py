"""Per-run figures for comparisons across runs (scaling, compare, regressions, ``check``).

Each figure is the median over steps of a per-step value from the ``steps`` rollup (the same
definitions as the run summary in ``queries.run_summary``), plus sums for shares. Results are cached
in ``run_stats`` and recomputed when the run has new rank-steps or changed status, so comparing a
family's history reads one row per run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["run_stats", "RUN_INFO_COLS", "scaling_signature", "comparable_key", "METRICS"]

RUN_INFO_COLS = (
    "id, name, model_family, config, config_signature, world_size, mp_size, device_type, peak_flops, git_commit, "
    "status, meta, started_at, finished_at, steps, rank_steps"
)

#: metrics compared across runs: name -> (unit, higher_is_better)
METRICS: dict[str, tuple[str, bool]] = {
    "step_s": ("s", False),
    "tokens_per_s_per_gpu": ("tokens/s/GPU", True),
    "mfu": ("", True),
}

_AGG_SQL = """
SELECT run_id, count(*) AS n,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY step_s) AS step_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY data_s) AS data_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY compute_s) AS compute_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY comm_exposed_s) AS comm_exposed_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY other_s) AS other_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY comm_total_s) AS comm_total_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY work_s_max - work_s) AS straggler_wait_s,
  sum(step_s) AS sum_step_s, sum(data_s) AS sum_data_s, sum(compute_s) AS sum_compute_s,
  sum(comm_exposed_s) AS sum_comm_exposed_s, sum(other_s) AS sum_other_s, sum(comm_total_s) AS sum_comm_total_s,
  sum(work_s_max - work_s) AS sum_straggler_wait_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY tokens / nullif(step_s, 0)) AS tokens_per_s_raw,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY flops / nullif(n_ranks * step_s, 0)) AS flops_per_dev_s,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY tokens / nullif(n_ranks, 0)) AS tokens_per_rank_step,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY tokens) AS tokens_per_step,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY n_ranks) AS n_ranks,
  sum(alloc_retries) AS alloc_retries, min(ts) AS first_ts, max(ts) AS last_ts
FROM steps WHERE run_id = ANY(:ids) AND n_ranks > 0 GROUP BY run_id
"""

_SCALE_KEYS = {
    "global_batch_tokens", "global_batch_size", "global_batch", "world_size", "num_nodes", "nnodes", "nodes",
    "dp", "dp_size", "data_parallel", "gpus", "num_gpus", "seed", "run_name", "output_dir", "timestamp",
}


def scaling_signature(config: dict[str, Any] | None) -> str:
    """Config signature without the keys that change with cluster size (global batch, world size,
    data-parallel degree): the runs of one scaling curve share it."""
    import hashlib

    c = {k: v for k, v in (config or {}).items() if k not in _SCALE_KEYS}
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:16]


def comparable_key(run: dict[str, Any]) -> tuple[Any, ...]:
    """Runs are comparable baselines when family, config signature, device type and world size match."""
    return (run.get("model_family"), run.get("config_signature"), run.get("device_type"), run.get("world_size"))


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if f == f else None


def _derive(run: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    mp = max(int(run.get("mp_size") or 1), 1)
    ws = max(int(run.get("world_size") or 1), 1)
    tps = _num(a.get("tokens_per_s_raw"))
    tps = tps / mp if tps is not None else None
    peak = run.get("peak_flops")
    fps = _num(a.get("flops_per_dev_s"))
    total = sum(_num(a.get(f"sum_{k}")) or 0.0 for k in ("data_s", "compute_s", "comm_exposed_s", "other_s"))
    wait = _num(a.get("sum_straggler_wait_s")) or 0.0
    exposed = _num(a.get("sum_comm_exposed_s")) or 0.0
    shares = None
    if total > 0:
        # a synchronous job waits for the slowest rank inside the collectives: that wait is carved out
        # of exposed comm and shown as its own component (docs/metrics.md "Bottleneck attribution")
        wait_in = min(wait, exposed)
        shares = {
            "data": (_num(a.get("sum_data_s")) or 0.0) / total,
            "compute": (_num(a.get("sum_compute_s")) or 0.0) / total,
            "comm_exposed": (exposed - wait_in) / total,
            "other": (_num(a.get("sum_other_s")) or 0.0) / total,
            "straggler_wait": wait_in / total,
        }
    tprs = _num(a.get("tokens_per_rank_step"))
    step_s = _num(a.get("step_s"))
    return {
        "steps": int(a.get("n") or 0),
        "step_s": step_s,
        "data_s": _num(a.get("data_s")),
        "compute_s": _num(a.get("compute_s")),
        "comm_exposed_s": _num(a.get("comm_exposed_s")),
        "other_s": _num(a.get("other_s")),
        "comm_total_s": _num(a.get("comm_total_s")),
        "straggler_wait_s": _num(a.get("straggler_wait_s")),
        "overlap_ratio": (1 - a["comm_exposed_s"] / a["comm_total_s"]) if a.get("comm_total_s") and
        a.get("comm_exposed_s") is not None and a["comm_total_s"] > 0 else None,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / ws if tps is not None else None,
        "mfu": fps / peak if fps is not None and peak else None,
        "tokens_per_rank_step": tprs,
        "tokens_per_step": _num(a.get("tokens_per_step")),
        # GPU-seconds of one step per 1k tokens that GPU processed (= 1000 / tokens_per_s_per_gpu when mp = 1)
        "step_s_per_1k_tokens": step_s * 1000.0 / (tprs * mp) if step_s and tprs else None,
        "shares": shares,
        "alloc_retries": _num(a.get("alloc_retries")),
        "first_ts": _num(a.get("first_ts")),
        "last_ts": _num(a.get("last_ts")),
    }


def _run_info(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    for k in ("started_at", "finished_at"):
        if d.get(k) is not None:
            d[k] = d[k].isoformat()
    return d


def run_stats(engine: Engine, run_ids: Iterable[int] | None = None, *, family: str | None = None) -> dict[int, dict[str, Any]]:
    """{run_id: {"run": run info, **figures}} for the given runs (or a whole family), cached."""
    where: list[str] = []
    params: dict[str, Any] = {}
    if run_ids is not None:
        params["ids"] = [int(r) for r in run_ids]
        where.append("id = ANY(:ids)")
    if family is not None:
        params["family"] = family
        where.append("model_family = :family")
    sql = f"SELECT {RUN_INFO_COLS} FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "")
    out: dict[int, dict[str, Any]] = {}
    with engine.connect() as c:
        runs = {int(r.id): _run_info(r) for r in c.execute(text(sql), params)}
        if not runs:
            return {}
        cached = {
            int(r[0]): (int(r[1]), r[2], r[3])
            for r in c.execute(
                text("SELECT run_id, rank_steps, status, stats FROM run_stats WHERE run_id = ANY(:ids)"), {"ids": list(runs)}
            )
        }
        stale = [rid for rid, run in runs.items()
                 if rid not in cached or cached[rid][0] != run["rank_steps"] or cached[rid][1] != run["status"]]
        fresh: dict[int, dict[str, Any]] = {}
        if stale:
            for row in c.execute(text(_AGG_SQL), {"ids": stale}):
                a = dict(row._mapping)
                fresh[int(a["run_id"])] = _derive(runs[int(a["run_id"])], a)
    if fresh:
        with engine.begin() as c:
            c.execute(
                text(
                    "INSERT INTO run_stats (run_id, rank_steps, status, stats, computed_at) "
                    "VALUES (:id, :steps, :status, CAST(:stats AS jsonb), now()) ON CONFLICT (run_id) DO UPDATE SET "
                    "rank_steps = excluded.rank_steps, status = excluded.status, stats = excluded.stats, computed_at = now()"
                ),
                [{"id": rid, "steps": runs[rid]["rank_steps"], "status": runs[rid]["status"],
                  "stats": json.dumps(v, allow_nan=False)} for rid, v in fresh.items()],
            )
    for rid, run in runs.items():
        figs = fresh.get(rid) or (cached[rid][2] if rid in cached else None) or _derive(run, {})
        out[rid] = {"run": run, **figs}
    return out
