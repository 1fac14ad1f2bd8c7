"""A run's per-step rows, paged (``GET /api/v1/runs/{id}/steps``; the notebook client's ``.steps``):
the cross-rank rollup of each compacted step with its decomposition, MFU and throughput, the same
numbers the run page draws (``reports.pages.run_series``) before any downsampling."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text

from ..limits import MAX_PAGE_ROWS

__all__ = ["step_page", "STEP_FIELDS", "RANK_ROLLUP_COLUMNS", "count_steps", "rollup_rows"]

#: (output field, SQL over ``steps``) in the order a row lists them
_SQL_FIELDS: tuple[tuple[str, str], ...] = (
    ("step", "step"), ("ts", "ts"), ("n_ranks", "n_ranks"), ("step_s", "step_s"), ("step_s_max", "step_s_max"),
    ("data_s", "data_s"), ("compute_s", "compute_s"), ("comm_exposed_s", "comm_exposed_s"), ("other_s", "other_s"),
    ("straggler_wait_s", "greatest(coalesce(work_s_max - work_s, 0), 0)"), ("comm_total_s", "comm_total_s"),
    ("forward_s", "forward_s"), ("backward_s", "backward_s"), ("optimizer_s", "optimizer_s"),
    ("slowest_rank", "slowest_rank"), ("tokens", "tokens"), ("padded_tokens", "padded_tokens"), ("samples", "samples"),
    ("flops", "flops"), ("flops_per_dev_s", "flops / nullif(n_ranks * step_s, 0)"),
    ("tokens_per_s_raw", "tokens / nullif(step_s, 0)"), ("mem_peak_bytes", "mem_peak_bytes"),
)
#: the fields of one row (``mfu`` = FLOPs per device-second / peak; ``tokens_per_s`` counts each token
#: once per model replica; ``tokens_per_s_per_gpu`` = that / world size)
STEP_FIELDS: tuple[str, ...] = (*(f for f, _ in _SQL_FIELDS if f not in ("flops_per_dev_s", "tokens_per_s_raw")),
                                "mfu", "tokens_per_s", "tokens_per_s_per_gpu")


def step_page(engine: Engine, run_id: int, *, peak_flops: float | None, mp_size: int | None, world_size: int,
              offset: int = 0, limit: int = MAX_PAGE_ROWS, after: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(steps the run has, at most ``limit`` (≤ MAX_PAGE_ROWS) rows in step order from ``offset``, or
    after step ``after`` when given — the cheap cursor for reading a long run page by page)."""
    lim = max(0, min(int(limit), MAX_PAGE_ROWS))
    cols = ", ".join(f"{sql} AS {name}" for name, sql in _SQL_FIELDS)
    cond = "run_id = :id AND n_ranks > 0" + (" AND step > :after" if after is not None else "")
    with engine.connect() as c:
        total = int(c.execute(text("SELECT count(*) FROM steps WHERE run_id = :id AND n_ranks > 0"), {"id": run_id}).scalar() or 0)
        rows = c.execute(text(f"SELECT {cols} FROM steps WHERE {cond} ORDER BY step OFFSET :o LIMIT :n"),
                         {"id": run_id, "after": after, "o": max(0, int(offset)) if after is None else 0, "n": lim}).fetchall()
    mp = max(1, int(mp_size or 1))
    out = []
    for r in rows:
        d = {k: (float(v) if isinstance(v, float) else v) for k, v in r._mapping.items()}
        fpd, tps = d.pop("flops_per_dev_s"), d.pop("tokens_per_s_raw")
        d["mfu"] = fpd / peak_flops if fpd is not None and peak_flops else None
        d["tokens_per_s"] = float(tps) / mp if tps is not None else None
        d["tokens_per_s_per_gpu"] = d["tokens_per_s"] / world_size if d["tokens_per_s"] is not None and world_size else None
        for k in ("step", "n_ranks", "slowest_rank"):
            if d.get(k) is not None:
                d[k] = int(d[k])
        out.append(d)
    return total, out


# ------------------------------------------------------------------ one rank against the median rank

#: the rollup columns a rank's rows are set against (``GET /runs/{id}/ranks/{rank}/steps``): the step's
#: cross-rank medians (``work_s``: of step − exposed comm) and the slowest rank's work (``work_s_max``)
RANK_ROLLUP_COLUMNS: tuple[str, ...] = (
    "step", "ts", "n_ranks", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s",
    "forward_s", "backward_s", "optimizer_s", "work_s", "work_s_max",
)  # fmt: skip


def count_steps(engine: Engine, run_id: int, *, after: int | None = None) -> int:
    """Compacted steps of the run (after step ``after`` when given)."""
    cond = "run_id = :id AND n_ranks > 0" + (" AND step > :after" if after is not None else "")
    with engine.connect() as c:
        return int(c.execute(text(f"SELECT count(*) FROM steps WHERE {cond}"), {"id": run_id, "after": after}).scalar() or 0)


def rollup_rows(engine: Engine, run_id: int, *, offset: int = 0, limit: int = MAX_PAGE_ROWS, after: int | None = None,
                stride: int = 1) -> list[tuple[Any, ...]]:
    """``RANK_ROLLUP_COLUMNS`` of at most ``limit`` compacted steps in step order: from ``offset``, or
    after step ``after``; with ``stride`` k > 1 every k-th of them (counted from the first; offset ignored).
    Only the rollup columns are read: the per-rank blocks stay in their TOAST table."""
    cols = ", ".join(RANK_ROLLUP_COLUMNS)
    cond = "run_id = :id AND n_ranks > 0" + (" AND step > :after" if after is not None else "")
    args = {"id": run_id, "after": after, "o": max(0, int(offset)) if after is None else 0, "n": max(0, int(limit)),
            "k": max(1, int(stride))}
    with engine.connect() as c:
        if args["k"] == 1:
            return list(c.execute(text(f"SELECT {cols} FROM steps WHERE {cond} ORDER BY step OFFSET :o LIMIT :n"),
                                  args).fetchall())
        return list(c.execute(text(
            f"SELECT {cols} FROM (SELECT {cols}, row_number() OVER (ORDER BY step) - 1 AS i FROM steps WHERE {cond}) t "
            "WHERE i % :k = 0 ORDER BY step LIMIT :n"), args).fetchall())
