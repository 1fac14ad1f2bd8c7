"""Cardinality bounds of ``server/limits.py`` that need state: the names a run keeps (``run_names``)
and how many records were folded or dropped to keep each bound (``run_folded``), migration 0014.

Names are admitted first come, first kept, under a per-run lock, so a bound holds across batches and
server instances: phase names by the compactor (which holds the run's partition lock), node names at
ingest under :func:`lock_run_names` (the batch's transaction). Reads of the counts: :func:`folded`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["BOUNDS", "OVERFLOW_PHASE", "lock_run_names", "kept_names", "count_names", "admit_names", "add_folded",
           "add_folded_in", "folded"]

#: the bounds counted in ``run_folded`` (the summary's ``folded`` lists each, 0 when nothing was folded):
#: phase records folded into ``OVERFLOW_PHASE``; collective records dropped beyond the per-rank-step cap;
#: ranks whose host / node name was dropped; kernel rows of uploaded trace summaries summed into "others"
BOUNDS = ("phase_names", "collectives", "node_names", "kernels")

OVERFLOW_PHASE = "other_phases"
"""The phase later custom phase names fold into: the agent's own (``fleetscope.agent.run.OVERFLOW_PHASE``);
not counted in ``MAX_PHASE_NAMES_PER_RUN``."""

_LOCK_KEY = 727279  # with the run id: pg_advisory_xact_lock(key, run_id) around admitting a run's node names


def lock_run_names(cur: Any, run_id: int) -> None:
    """The run's transaction-level lock for admitting names at ingest (released at commit)."""
    cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_KEY, int(run_id)))


def kept_names(cur: Any, kind: str, run_ids: Sequence[int], names: Sequence[str] | None = None) -> dict[int, set[str]]:
    """{run: the names of ``kind`` it keeps} (only those among ``names`` when given)."""
    if names is None:
        rows = cur.execute("SELECT run_id, name FROM run_names WHERE kind = %s AND run_id = ANY(%s)",
                           (kind, [int(r) for r in run_ids])).fetchall()
    else:
        # a join planned for these arrays each time (never a cached generic plan, which guesses 10 names
        # and may compare every stored name with every name asked for)
        rows = cur.execute(
            "SELECT n.run_id, n.name FROM unnest(%s::int[]) AS r(id) CROSS JOIN unnest(%s::text[]) AS u(name) "
            "JOIN run_names n ON n.run_id = r.id AND n.kind = %s AND n.name = u.name",
            ([int(r) for r in run_ids], list(dict.fromkeys(names)), kind), prepare=False).fetchall()
    out: dict[int, set[str]] = {}
    for r, n in rows:
        out.setdefault(int(r), set()).add(str(n))
    return out


def count_names(cur: Any, kind: str, run_id: int) -> int:
    """How many names of ``kind`` the run keeps."""
    return int(cur.execute("SELECT count(*) FROM run_names WHERE run_id = %s AND kind = %s",
                           (int(run_id), kind)).fetchone()[0])


def admit_names(cur: Any, kind: str, rows: Iterable[tuple[int, str]]) -> None:
    """Keep these (run, name) of ``kind`` (already kept: nothing happens)."""
    params = [(int(r), kind, n) for r, n in rows]
    if params:
        cur.executemany("INSERT INTO run_names (run_id, kind, name) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING", params)


def add_folded(cur: Any, rows: Iterable[tuple[int, str, int]]) -> None:
    """Add (run, bound, records) to the run's folded counts (rows with 0 records are skipped)."""
    params = [(int(r), b, int(n)) for r, b, n in rows if n > 0]
    if params:
        cur.executemany(
            "INSERT INTO run_folded (run_id, bound, records) VALUES (%s, %s, %s) ON CONFLICT (run_id, bound) "
            "DO UPDATE SET records = run_folded.records + excluded.records",
            params,
        )


def add_folded_in(conn: Any, rows: Iterable[tuple[int, str, int]]) -> None:
    """:func:`add_folded` on a SQLAlchemy connection (inside the caller's transaction)."""
    params = [{"r": int(r), "b": b, "n": int(n)} for r, b, n in rows if n > 0]
    if params:
        conn.execute(text("INSERT INTO run_folded (run_id, bound, records) VALUES (:r, :b, :n) ON CONFLICT (run_id, bound) "
                          "DO UPDATE SET records = run_folded.records + excluded.records"), params)


def folded(engine: Engine, run_id: int) -> dict[str, int]:
    """{bound: records folded or dropped} of the run, every bound of ``BOUNDS`` (0: none)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT bound, records FROM run_folded WHERE run_id = :id ORDER BY bound LIMIT 64"),
                         {"id": run_id}).fetchall()
    got = {str(b): int(n) for b, n in rows}
    return {b: got.get(b, 0) for b in BOUNDS} | {b: n for b, n in got.items() if b not in BOUNDS}
