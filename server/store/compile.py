"""torch.compile health of a run, from its ``run_events`` (the agent's ``compile``, ``graph_break``,
``compile_summary`` and ``cudagraph`` events, agent/compile_watch.py): one round trip, loaded as
plain tuples for ``analysis.compile.compile_health``.

Event data is free-form JSONB: every number is read only when it is a JSON number (anything else is
NULL), so a malformed event cannot fail the query. Bounded whatever an older server stored: at most
MAX_EVENTS_PER_RUN events are read, reasons are cut to MAX_REASON_CHARS, counts outside 0..MAX_HIST_COUNT
are ignored. Not cached: events can land after the steps that
version a run's cached reports (``RunRow.version``), so this is read fresh on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

from ..limits import MAX_EVENTS_PER_RUN, MAX_HIST_COUNT, MAX_REASON_CHARS

__all__ = ["CompileRows", "load_compile", "load_graph_collectives", "KINDS", "MAX_REASONS", "MAX_STEPS", "MAX_GRAPH_KEYS"]

KINDS = ("compile", "graph_break", "compile_summary", "cudagraph")
MAX_REASONS = 1000
"""Distinct reasons of each kind loaded (most frequent first); the total is counted in SQL."""
MAX_STEPS = 1000
"""Steps with a recompile loaded (the first ones)."""


@dataclass(frozen=True)
class CompileRows:
    """What the events say, before any figure is made of it.

    ``totals``: ``(rank, source, compiles, recompiles, compile_s)``, source "events" (counted from the
    rank's ``compile`` events; compiles = Dynamo frame compiles) or "summary" (the rank's last
    ``compile_summary``, which also counts what the agent did not send). ``reasons``: ``(kind,
    reason, count, distinct)``, kind "recompile" or "graph_break", count = the maximum over ranks of
    the rank's count, ``distinct`` = how many distinct reasons of that kind there are in all.
    ``recompile_steps``: steps where a rank recompiled, ascending. ``replays``: ``(rank, replays)``."""

    totals: list[tuple[int, str, int | None, int | None, float | None]] = field(default_factory=list)
    reasons: list[tuple[str, str, int, int]] = field(default_factory=list)
    recompile_steps: list[int] = field(default_factory=list)
    replays: list[tuple[int, int]] = field(default_factory=list)
    has_events: bool = False


def _num(expr: str) -> str:
    """``expr`` (a jsonb) as float8 when it is a JSON number in 0..MAX_HIST_COUNT, else NULL (an older
    server stored negative or 1e300 counts)."""
    v = f"({expr} #>> '{{}}')::float8"
    return f"(CASE WHEN jsonb_typeof({expr}) = 'number' THEN CASE WHEN {v} BETWEEN 0 AND {MAX_HIST_COUNT} THEN {v} END END)"


def _reason(expr: str) -> str:
    """``expr`` (text) cut to MAX_REASON_CHARS, marked "…" (an older server kept reasons whole)."""
    return f"(CASE WHEN length({expr}) > {MAX_REASON_CHARS} THEN left({expr}, {MAX_REASON_CHARS - 1}) || '…' ELSE {expr} END)"


def _array(expr: str) -> str:
    return f"(CASE WHEN jsonb_typeof({expr}) = 'array' THEN {expr} ELSE '[]'::jsonb END)"


_RECOMPILE = "data -> 'recompile' = 'true'::jsonb"
_DYNAMO = "coalesce(data ->> 'trigger', 'dynamo') = 'dynamo'"

_SQL = f"""
WITH ev AS (
    SELECT rank, seq, kind, step, data FROM run_events
    WHERE run_id = :id AND kind IN ('compile', 'graph_break', 'compile_summary', 'cudagraph')
    ORDER BY rank, seq LIMIT :max_events
), summ AS (
    SELECT DISTINCT ON (rank) rank, data FROM ev WHERE kind = 'compile_summary' ORDER BY rank, seq DESC
), per_rank_reason AS (
    SELECT 'recompile' AS k, rank, {_reason("data ->> 'reason'")} AS reason, count(*)::float8 AS n
    FROM ev WHERE kind = 'compile' AND {_RECOMPILE} AND jsonb_typeof(data -> 'reason') = 'string'
    GROUP BY rank, 3
    UNION ALL
    SELECT 'recompile', s.rank, {_reason("r.v ->> 'reason'")}, {_num("r.v -> 'count'")}
    FROM summ s, jsonb_array_elements({_array("s.data -> 'recompile_reasons'")}) WITH ORDINALITY r(v, i)
    WHERE jsonb_typeof(r.v -> 'reason') = 'string' AND r.i <= :max_reasons
    UNION ALL
    SELECT 'graph_break', rank, {_reason("data ->> 'reason'")}, coalesce({_num("data -> 'count'")}, 1)
    FROM ev WHERE kind = 'graph_break' AND jsonb_typeof(data -> 'reason') = 'string'
    UNION ALL
    SELECT 'graph_break', s.rank, {_reason("r.v ->> 'reason'")}, {_num("r.v -> 'count'")}
    FROM summ s, jsonb_array_elements({_array("s.data -> 'graph_breaks'")}) WITH ORDINALITY r(v, i)
    WHERE jsonb_typeof(r.v -> 'reason') = 'string' AND r.i <= :max_reasons
), reasons AS (
    SELECT k, reason, max(n) AS n FROM (
        SELECT k, rank, reason, max(n) AS n FROM per_rank_reason GROUP BY k, rank, reason
    ) x GROUP BY k, reason
), ranked AS (
    SELECT k, reason, n, count(*) OVER (PARTITION BY k) AS distinct_n,
           row_number() OVER (PARTITION BY k ORDER BY n DESC NULLS LAST, reason) AS i
    FROM reasons
)
SELECT 'events' AS what, rank, NULL::text AS reason,
       count(*) FILTER (WHERE {_DYNAMO})::float8 AS a,
       count(*) FILTER (WHERE {_DYNAMO} AND {_RECOMPILE})::float8 AS b,
       sum({_num("data -> 'compile_s'")}) AS c
FROM ev WHERE kind = 'compile' GROUP BY rank
UNION ALL
SELECT 'summary', rank, NULL, {_num("data -> 'compiles'")}, {_num("data -> 'recompiles'")},
       {_num("data -> 'compile_s'")}
FROM summ
UNION ALL
SELECT k, NULL, reason, n, distinct_n, NULL FROM ranked WHERE i <= :max_reasons
UNION ALL
SELECT 'cudagraph', rank, NULL, max({_num("data -> 'replays'")}), NULL, NULL
FROM ev WHERE kind = 'cudagraph' GROUP BY rank
UNION ALL
SELECT 'step', NULL, NULL, step, NULL, NULL FROM (
    SELECT DISTINCT step FROM ev WHERE kind = 'compile' AND {_RECOMPILE} AND step IS NOT NULL
    ORDER BY step LIMIT :max_steps
) s
UNION ALL
SELECT 'any', NULL, NULL, count(*), NULL, NULL FROM ev
"""


def _int(v: float | None) -> int | None:
    return int(v) if v is not None else None


def load_compile(engine: Engine, run_id: int) -> CompileRows:
    """The run's compile events, aggregated per rank and per reason (see ``CompileRows``)."""
    with engine.connect() as c:
        rows = c.execute(text(_SQL), {"id": run_id, "max_reasons": MAX_REASONS, "max_steps": MAX_STEPS,
                                      "max_events": MAX_EVENTS_PER_RUN}).fetchall()
    totals: list[tuple[int, str, int | None, int | None, float | None]] = []
    reasons: list[tuple[str, str, int, int]] = []
    steps: list[int] = []
    replays: list[tuple[int, int]] = []
    any_events = False
    for what, rank, reason, a, b, cc in rows:
        if what in ("events", "summary"):
            totals.append((int(rank), what, _int(a), _int(b), float(cc) if cc is not None else None))
        elif what in ("recompile", "graph_break"):
            reasons.append((what, reason, int(a) if a is not None else 0, int(b)))
        elif what == "cudagraph" and a is not None:
            replays.append((int(rank), int(a)))
        elif what == "step":
            steps.append(int(a))
        elif what == "any":
            any_events = bool(a)
    return CompileRows(totals=sorted(totals), reasons=reasons, recompile_steps=sorted(steps), replays=sorted(replays),
                       has_events=any_events)


# --------------------------------------------------------------------------- graph collectives

MAX_GRAPH_KEYS = 64
"""(op, dimension) pairs of graph collectives read per run (the most calls first)."""

_GRAPH_SQL = f"""
WITH ev AS (
    SELECT rank, data FROM run_events
    WHERE run_id = :id AND kind = 'graph_collectives'
    ORDER BY rank, seq LIMIT :max_events
), item AS (
    SELECT e.rank, left(b.v ->> 'op', 32) AS op, left(b.v ->> 'dim', 48) AS dim,
           {_num("b.v -> 'calls'")} AS calls, {_num("b.v -> 'bytes'")} AS bytes
    FROM ev e, jsonb_array_elements({_array("e.data -> 'by'")}) WITH ORDINALITY b(v, i)
    WHERE jsonb_typeof(b.v -> 'op') = 'string' AND jsonb_typeof(b.v -> 'dim') = 'string' AND b.i <= 64
)
SELECT op, dim, sum(calls) AS calls, sum(bytes) AS bytes, count(DISTINCT rank) AS ranks,
       (SELECT count(DISTINCT rank) FROM item) AS all_ranks
FROM item WHERE calls IS NOT NULL GROUP BY op, dim ORDER BY 3 DESC, op, dim LIMIT :max_keys
"""


def load_graph_collectives(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The collectives torch's Flight Recorder saw that the agent's own records did not (inside
    compiled graphs, or issued from C++), summed over ranks and steps from the agent's
    ``graph_collectives`` events: ``{"calls", "bytes", "ranks", "by": [{"op", "dim", "calls",
    "bytes", "ranks"}], "source": "flight_recorder", "timed": False}``; None when no rank sent any."""
    with engine.connect() as c:
        rows = c.execute(text(_GRAPH_SQL), {"id": run_id, "max_events": MAX_EVENTS_PER_RUN,
                                             "max_keys": MAX_GRAPH_KEYS}).fetchall()
    if not rows:
        return None
    by = [{"op": r.op, "dim": r.dim, "calls": int(r.calls), "bytes": int(r.bytes or 0), "ranks": int(r.ranks)}
          for r in rows]
    return {"calls": sum(b["calls"] for b in by), "bytes": sum(b["bytes"] for b in by),
            "ranks": int(rows[0].all_ranks), "by": by, "source": "flight_recorder", "timed": False}
