"""The latest ``memory`` event of each rank (the agent's per-rank memory figures for the run so far:
agent/memory.py), projected to its numbers: bounded by MAX_EVENTS_PER_KIND rows, every field read only
when it is a JSON number (or, for ``source``, a short string), whatever a client stored."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, text

from ..limits import MAX_EVENTS_PER_KIND

__all__ = ["RankMemory", "MEMORY_FIELDS", "rank_memory"]

#: the numeric fields of a ``memory`` event the summary reads
MEMORY_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "fragmentation_bytes", "alloc_retries", "ooms")


@dataclass(frozen=True, slots=True)
class RankMemory:
    rank: int
    source: str | None
    peak_exact: bool | None
    peak_allocated_bytes: float | None
    peak_reserved_bytes: float | None
    fragmentation_bytes: float | None
    alloc_retries: float | None
    ooms: float | None


def _num(name: str) -> str:
    """The field as float8 when it is a JSON number in 0..1e18 (bytes, counts), else NULL (never a cast error)."""
    v = f"data -> '{name}'"
    return f"CASE WHEN jsonb_typeof({v}) = 'number' THEN CASE WHEN ({v})::numeric BETWEEN 0 AND 1e18 THEN ({v})::numeric::float8 END END"


_SQL = text(
    "SELECT rank, CASE WHEN jsonb_typeof(data -> 'source') = 'string' THEN left(data ->> 'source', 16) END, "
    "CASE WHEN jsonb_typeof(data -> 'peak_exact') = 'boolean' THEN (data ->> 'peak_exact')::boolean END, "
    + ", ".join(_num(f) for f in MEMORY_FIELDS)
    + " FROM (SELECT DISTINCT ON (rank) rank, data FROM (SELECT rank, seq, data FROM run_events "
    "WHERE run_id = :id AND kind = 'memory' ORDER BY rank, seq LIMIT :n) e ORDER BY rank, seq DESC) t ORDER BY rank"
)


def rank_memory(engine: Engine, run_id: int, limit: int = MAX_EVENTS_PER_KIND) -> list[RankMemory]:
    """Per rank (by rank), the figures of its latest ``memory`` event (by sequence); [] without any."""
    with engine.connect() as c:
        rows = c.execute(_SQL, {"id": run_id, "n": max(0, int(limit))}).fetchall()
    return [RankMemory(int(r[0]), r[1], r[2], *r[3:]) for r in rows]
