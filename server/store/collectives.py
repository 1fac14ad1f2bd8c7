"""Per-run rollups of communication and tokens: ``run_collectives`` (additive, by op × group size ×
message-size bucket) and ``run_modalities`` (tokens per modality per step)."""

from __future__ import annotations

from sqlalchemy import Engine, text

from fleetscope.wire import COLLECTIVE_OPS

from .rows import CollectiveRow

__all__ = ["CollectiveRow", "run_collectives", "run_modalities"]


def run_collectives(engine: Engine, run_id: int) -> list[CollectiveRow]:
    """The run's collective rollup, most total time first."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT op, group_size, size_bucket, records, calls, bytes, total_s, exposed_s FROM run_collectives "
                "WHERE run_id = :id ORDER BY total_s DESC"
            ),
            {"id": run_id},
        ).fetchall()
    return [CollectiveRow(COLLECTIVE_OPS[op] if 0 <= op < len(COLLECTIVE_OPS) else "other", int(n), int(b), int(rec),
                          int(calls), float(nbytes), float(tot), float(exp))
            for op, n, b, rec, calls, nbytes, tot, exp in rows]


def run_modalities(engine: Engine, run_id: int) -> list[tuple[int, str, int]]:
    """(step, modality, tokens summed over ranks) of the run, in step order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, modality, tokens FROM run_modalities WHERE run_id = :id ORDER BY step"), {"id": run_id}
        ).fetchall()
    return [(int(s), m, int(t)) for s, m, t in rows]
