"""The ``steps`` table: per-step rollup columns as numpy frames, and the per-rank blocks.

``PER_STEP`` holds the per-step quantities derived from rollup columns (FLOPs per device-second,
raw tokens/s, tokens per rank, straggler wait, skew) as SQL expressions: the one place they are
written. The step frame loads them as columns and the per-run aggregates
(``aggregates.load_aggregates``) take medians over the same expressions; what a figure means once
the run's constants (peak FLOP/s, model-parallel size) are applied is ``analysis.figures``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sqlalchemy import Engine, text

from ..codec import COLL_BLOCK_FIELDS, STEP_BLOCK_FIELDS, decode_block
from ..db import raw_connection
from .rows import StepFrame

__all__ = [
    "rank_span",
    "recent_comm_blocks",
    "StepFrame",
    "ROLLUP_COLUMNS",
    "PER_STEP",
    "load_steps",
    "step_tail",
    "rank_step_matrix",
    "recent_blocks",
    "iter_blocks",
    "blocks_of_steps",
]

#: the rollup columns of ``steps`` a frame may hold (NaN = not measured)
ROLLUP_COLUMNS: tuple[str, ...] = (
    "step", "n_ranks", "ts", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s",
    "forward_s", "backward_s", "optimizer_s", "step_s_max", "work_s", "work_s_max", "slowest_rank", "tokens",
    "padded_tokens", "samples", "flops", "mem_peak_bytes", "mem_reserved_bytes", "alloc_retries", "neg_residual",
    "hw_flops",
)  # fmt: skip

#: per-step quantities derived from the rollup columns; loadable as frame columns by name
PER_STEP: dict[str, str] = {
    # FLOPs done per device-second of the step: MFU = this / peak FLOP/s (analysis.figures.mfu)
    "flops_per_dev_s": "flops / nullif(n_ranks * step_s, 0)",
    # hardware FLOPs (padding and recomputation included) per device-second: HFU = this / peak
    "hw_flops_per_dev_s": "hw_flops / nullif(n_ranks * step_s, 0)",
    # tokens per second of the step, before dividing by the model-parallel size (analysis.figures.tokens_per_s)
    "tokens_per_s_raw": "tokens / nullif(step_s, 0)",
    "tokens_per_rank": "tokens / nullif(n_ranks, 0)",
    # FLOPs one rank executed in the step (model / hardware), the ranks' mean
    "flops_per_rank": "flops / nullif(n_ranks, 0)",
    "hw_flops_per_rank": "hw_flops / nullif(n_ranks, 0)",
    # time the median rank waits for the slowest one: max work − median work, never negative
    "wait_s": "greatest(coalesce(work_s_max - work_s, 0), 0)",
    # the part of that wait spent inside exposed communication (carved out of exposed comm)
    "wait_in_comm_s": "least(greatest(coalesce(work_s_max - work_s, 0), 0), coalesce(comm_exposed_s, 0))",
    # slowest rank's work over the median rank's
    "skew": "work_s_max / nullif(work_s, 0)",
    "packing": "tokens / nullif(padded_tokens, 0)",
}

DEFAULT_COLUMNS: tuple[str, ...] = (*ROLLUP_COLUMNS, "flops_per_dev_s", "tokens_per_s_raw")


def _expr(col: str) -> str:
    if col in PER_STEP:
        return f"{PER_STEP[col]} AS {col}"
    if col in ROLLUP_COLUMNS:
        return col
    raise ValueError(f"unknown step column {col!r}")


def load_steps(engine: Engine, run_id: int, columns: tuple[str, ...] | None = None) -> StepFrame:
    """The run's compacted steps (``n_ranks > 0``) as a frame of ``columns`` (rollups and ``PER_STEP``)."""
    cols = columns or DEFAULT_COLUMNS
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT {', '.join(_expr(k) for k in cols)} FROM steps WHERE run_id = :id AND n_ranks > 0 ORDER BY step"),
            {"id": run_id},
        ).fetchall()
    if not rows:
        return StepFrame({k: np.empty(0) for k in cols})
    arr = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64)
    return StepFrame({k: arr[:, i] for i, k in enumerate(cols)})


def step_tail(engine: Engine, run_id: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, median step time) of the run's most recent ``limit`` measured steps, in step order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, step_s FROM steps WHERE run_id = :id AND n_ranks > 0 AND step_s IS NOT NULL "
                 "ORDER BY step DESC LIMIT :k"),
            {"id": run_id, "k": limit},
        ).fetchall()
    rows = rows[::-1]
    return (np.array([r[0] for r in rows], dtype=np.int64), np.array([float(r[1]) for r in rows], dtype=np.float64))


def rank_step_matrix(
    engine: Engine, run_id: int, field: str = "step_s", *, step_lo: int = 0, step_hi: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, ranks, values[step, rank]) of one per-rank field decoded from every block (the full,
    uncached decode; ``work_s`` = step_s − exposed comm)."""
    names = {n for n, _ in STEP_BLOCK_FIELDS}
    if field not in names and field != "work_s":
        raise ValueError(f"unknown rank-step field {field!r}")
    below = "" if step_hi is None else " AND step < :hi"
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT step, block FROM steps WHERE run_id = :id AND step >= :lo{below} AND n_ranks > 0 ORDER BY step"),
            {"id": run_id, "lo": step_lo, "hi": step_hi},
        ).fetchall()
        ws = c.execute(text("SELECT world_size FROM runs WHERE id = :id"), {"id": run_id}).scalar() or 1
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    mat = np.full((len(rows), int(ws)), np.nan)
    for i, (_, block) in enumerate(rows):
        d = decode_block(STEP_BLOCK_FIELDS, block)
        v = d["step_s"] - np.nan_to_num(d["comm_exposed_s"]) if field == "work_s" else d[field]
        ok = d["rank"] < ws
        mat[i, d["rank"][ok]] = v[ok]
    return steps, np.arange(int(ws)), mat


def recent_blocks(engine: Engine, run_id: int, k: int) -> list[tuple[int, dict[str, np.ndarray]]]:
    """The decoded blocks of the run's most recent ``k`` compacted steps, in step order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, block FROM steps WHERE run_id = :id AND n_ranks > 0 ORDER BY step DESC LIMIT :k"),
            {"id": run_id, "k": k},
        ).fetchall()
    return [(int(s), decode_block(STEP_BLOCK_FIELDS, b)) for s, b in rows[::-1]]


def recent_comm_blocks(engine: Engine, run_id: int,
                       k: int) -> list[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray] | None]]:
    """(step, rank-step block, collective block or None) of the run's most recent ``k`` compacted
    steps, decoded, in step order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, block, coll_block FROM steps WHERE run_id = :id AND n_ranks > 0 "
                 "ORDER BY step DESC LIMIT :k"),
            {"id": run_id, "k": k},
        ).fetchall()
    return [(int(s), decode_block(STEP_BLOCK_FIELDS, b), decode_block(COLL_BLOCK_FIELDS, cb) if cb is not None else None)
            for s, b, cb in rows[::-1]]


def iter_blocks(engine: Engine, run_id: int, after: int | None, chunk: int = 500,
                stride: int = 1) -> Iterator[list[tuple[int, bytes]]]:
    """Raw (step, block bytes) of the steps after ``after``, ``chunk`` steps at a time in step order;
    with ``stride`` k > 1 only the steps divisible by k (a sample of a run too large to hold whole).

    Binary protocol: bytea arrives as bytes, ~5x faster than the hex text form for 100+ MB of blocks."""
    lo = -1 if after is None else after
    with raw_connection(engine) as conn, conn.cursor(binary=True) as cur:
        while True:
            cur.execute(
                "SELECT step, block FROM steps WHERE run_id = %s AND step > %s AND n_ranks > 0 AND step %% %s = 0 "
                "ORDER BY step LIMIT %s",
                (run_id, lo, stride, chunk),
            )
            rows = cur.fetchall()
            if not rows:
                return
            yield [(int(s), bytes(b) if not isinstance(b, bytes) else b) for s, b in rows]
            if len(rows) < chunk:
                return
            lo = int(rows[-1][0])


def blocks_of_steps(engine: Engine, run_id: int, steps: list[int], chunk: int = 500) -> Iterator[list[tuple[int, bytes]]]:
    """Raw (step, block bytes) of the given compacted steps, in step order, ``chunk`` steps per query
    (so what one query holds stays bounded whatever the run's width); binary protocol, as ``iter_blocks``."""
    want = sorted({int(s) for s in steps})
    chunk = max(1, int(chunk))
    with raw_connection(engine) as conn, conn.cursor(binary=True) as cur:
        for lo in range(0, len(want), chunk):
            cur.execute("SELECT step, block FROM steps WHERE run_id = %s AND step = ANY(%s) AND n_ranks > 0 ORDER BY step",
                        (run_id, want[lo:lo + chunk]))
            rows = cur.fetchall()
            yield [(int(s), bytes(b) if not isinstance(b, bytes) else b) for s, b in rows]


def rank_span(engine: Engine, run_id: int) -> int | None:
    """1 + the highest rank that has compacted records (the straggler rollups keep one row per rank
    seen), or None before any compaction."""
    with engine.connect() as c:
        v = c.execute(text("SELECT max(rank) FROM rank_rollups WHERE run_id = :r"), {"r": run_id}).scalar()
    return None if v is None else int(v) + 1
