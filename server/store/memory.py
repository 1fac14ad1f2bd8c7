"""The latest ``memory`` event of each rank (the agent's per-rank memory figures for the run so far:
agent/memory.py), projected to its numbers: bounded by MAX_EVENTS_PER_KIND rows, every field read only
when it is a JSON number (or, for ``source``, a short string), whatever a client stored."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, text

from ..limits import MAX_EVENTS_PER_KIND

__all__ = ["RankMemory", "MEMORY_FIELDS", "rank_memory", "RankModuleTotals", "rank_module_totals", "rank_modules",
           "MAX_MODULE_RANKS"]

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


# --- memory per module (agent/memory_modules.py): the latest ``memory_modules`` event of each rank ---
#: ranks whose per-module totals one read returns at most (the rest are counted, not listed)
MAX_MODULE_RANKS = 4096

_MODULE_TOTALS_SQL = text(
    "SELECT rank, data -> 'totals', data -> 'forwards', data -> 'micro_batch', data -> 'device_total_bytes', "
    "data -> 'cost_s', data -> 'forward_flops' FROM (SELECT DISTINCT ON (rank) rank, data FROM run_events "
    "WHERE run_id = :id AND kind = 'memory_modules' ORDER BY rank, seq DESC) t ORDER BY rank LIMIT :n"
)
_MODULE_DATA_SQL = text(
    "SELECT data FROM run_events WHERE run_id = :id AND kind = 'memory_modules' AND rank = :rank "
    "ORDER BY seq DESC LIMIT 1"
)


@dataclass(frozen=True, slots=True)
class RankModuleTotals:
    rank: int
    totals: dict[str, float]
    forwards: float | None
    micro_batch: float | None
    device_total_bytes: float | None
    cost_s: float | None
    forward_flops: float | None


def _jnum(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if 0 <= f <= 1e21 else None


def rank_module_totals(engine: Engine, run_id: int, limit: int = MAX_MODULE_RANKS) -> list[RankModuleTotals]:
    """Per rank (by rank, at most ``limit``), the totals of its latest ``memory_modules`` event."""
    with engine.connect() as c:
        rows = c.execute(_MODULE_TOTALS_SQL, {"id": run_id, "n": max(0, int(limit))}).fetchall()
    out = []
    for r in rows:
        tot = r[1] if isinstance(r[1], dict) else {}
        out.append(RankModuleTotals(int(r[0]), {k: v for k, v in ((k, _jnum(v)) for k, v in tot.items())
                                                if v is not None and isinstance(k, str)},
                                    _jnum(r[2]), _jnum(r[3]), _jnum(r[4]), _jnum(r[5]), _jnum(r[6])))
    return out


def rank_modules(engine: Engine, run_id: int, rank: int) -> dict[str, object] | None:
    """The data of the rank's latest ``memory_modules`` event (its per-module columns); None without one."""
    with engine.connect() as c:
        row = c.execute(_MODULE_DATA_SQL, {"id": run_id, "rank": int(rank)}).fetchone()
    return row[0] if row is not None and isinstance(row[0], dict) else None
