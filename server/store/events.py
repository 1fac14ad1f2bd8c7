"""``run_events``: checkpoints, evaluations, restarts, agent drop counts … (JSONB payloads)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text

__all__ = ["run_events", "job_events", "events_of_kind", "seq_len_bins"]


def run_events(engine: Engine, run_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """The run's events (rank, seq, kind, ts, step, data) in time order."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, seq, kind, ts, step, data FROM run_events WHERE run_id = :id ORDER BY ts NULLS LAST, rank, seq "
                 "LIMIT :n"),
            {"id": run_id, "n": limit},
        ).fetchall()
    return [dict(r._mapping) for r in rows]


def job_events(engine: Engine, run_id: int) -> list[tuple[str, float | None, int | None, dict[str, Any] | None]]:
    """(kind, ts, step, data) of the events of the lowest reporting rank (it speaks for the job), in time order."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT kind, ts, step, data FROM run_events WHERE run_id = :id AND rank = "
                "(SELECT min(rank) FROM run_events WHERE run_id = :id) ORDER BY ts NULLS LAST, seq"
            ),
            {"id": run_id},
        ).fetchall()
    return [(k, t, s, d) for k, t, s, d in rows]



def events_of_kind(engine: Engine, run_id: int, kinds: tuple[str, ...],
                   limit: int = 20_000) -> list[tuple[int, str, int | None, dict[str, Any]]]:
    """(rank, kind, step, data) of the run's events of these kinds, by rank then sequence."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, kind, step, data FROM run_events WHERE run_id = :id AND kind = ANY(:k) "
                 "ORDER BY rank, seq LIMIT :n"),
            {"id": run_id, "k": list(kinds), "n": limit},
        ).fetchall()
    return [(int(r), k, s, d if isinstance(d, dict) else {}) for r, k, s, d in rows]


def seq_len_bins(engine: Engine, run_id: int) -> dict[int, int]:
    """{log2 bin: sequences} summed over the run's ``seq_lens`` events (every rank, every window)."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT b.key, sum(CASE WHEN jsonb_typeof(b.value) = 'number' THEN (b.value)::text::numeric END) "
                 "FROM run_events e, jsonb_each(CASE WHEN jsonb_typeof(e.data->'bins') = 'object' "
                 "THEN e.data->'bins' ELSE '{}'::jsonb END) b "
                 "WHERE e.run_id = :id AND e.kind = 'seq_lens' GROUP BY b.key"),
            {"id": run_id},
        ).fetchall()
    out: dict[int, int] = {}
    for k, v in rows:
        if isinstance(k, str) and k.isdigit() and v is not None and int(k) < 64:
            out[int(k)] = int(v)
    return out
