"""Run health tables (migration 0016): ``run_positions``, ``run_failures``, ``run_pauses``, ``run_health``.

Write side at ingest (:func:`land`, called by ``events.land_events`` under the run's event lock):

- ``position`` events: the latest per (run, rank) is kept (upsert by the rank's event sequence), so the
  table is bounded by the world size; they never go to ``run_events``.
- ``failure`` events: one per (run, rank, source), the first; at most MAX_FAILURES_PER_RUN per run,
  the rest dropped and counted (``run_event_counts`` kind ``failure``); never in ``run_events``.
- ``pause`` events: applied to ``run_pauses`` (the open pause per rank and reason, seconds of ended
  ones; at most MAX_PAUSE_REASONS_PER_RUN reasons per run) and passed on to ``run_events`` as before.

Reads for the health pass and ``/health`` are bounded: failures by the cap and a LIMIT; positions are
never loaded whole: :func:`wave_summary` computes a run's wavefront in SQL (counts per step, per
collective and sequence number, per liveness; the ranks that never arrived, silent ranks, lost nodes)
and returns counts plus bounded lists (the first ranks and runs of ranks, nodes, a few stacks), under a
time budget (``SET LOCAL statement_timeout``) when the caller gives one; :func:`open_pause` finds the open
declared pause in SQL too, however many ranks declared one; :func:`silent_nodes` finds, for a failed
run, the nodes none of whose ranks sent a failure record or a live position and the ranks never heard
of (bounded lists and counts).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from ..analysis.health import RANGES_SHOWN, RankSet, SilentNodes, WaveSummary
from ..limits import MAX_FAILURES_PER_RUN, MAX_PAUSE_REASONS_PER_RUN

__all__ = ["land", "Position", "Failure", "Pause", "RunProgress", "positions", "failures", "failure_count",
           "pauses", "pause_totals", "last_pause_end", "open_pause", "progress", "save_health", "load_health",
           "set_status", "attempts", "health_rows", "step_p99", "steps_at_or_below", "wave_summary", "OverBudget",
           "is_over_budget", "node_map", "HEALTH_KINDS", "fleet_goodput_rows", "silent_nodes"]

HEALTH_KINDS = ("position", "failure", "pause")


# --------------------------------------------------------------------------------------------- write


def land(cur: Any, run_id: int, events: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Store the batch's health events (psycopg cursor, inside the batch's transaction, under the run's
    event lock). Returns (the events for ``run_events``: everything but positions and failures, how many
    positions and failures were kept or already stored)."""
    pos = [e for e in events if e["kind"] == "position"]
    fail = [e for e in events if e["kind"] == "failure"]
    pause = [e for e in events if e["kind"] == "pause"]
    rest = [e for e in events if e["kind"] not in ("position", "failure")]
    if not (pos or fail or pause):
        return rest, 0
    kept = 0
    dropped: dict[str, int] = {}
    if pos:
        kept += _land_positions(cur, run_id, pos)
    if fail:
        k, d = _land_failures(cur, run_id, fail)
        kept += k
        if d:
            dropped["failure"] = d
    if pause:
        d = _land_pauses(cur, run_id, pause)
        if d:
            dropped["pause_reasons"] = d
    folded: dict[str, int] = {}
    for e in pos + fail:
        if e.get("folded"):
            folded[e["kind"]] = folded.get(e["kind"], 0) + 1
    kinds = sorted({*dropped, *folded})
    if kinds:
        cur.execute(
            "INSERT INTO run_event_counts (run_id, kind, dropped, folded) "
            "SELECT %s, * FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) "
            "ON CONFLICT (run_id, kind) DO UPDATE SET dropped = run_event_counts.dropped + excluded.dropped, "
            "folded = run_event_counts.folded + excluded.folded",
            (run_id, kinds, [dropped.get(k, 0) for k in kinds], [folded.get(k, 0) for k in kinds]),
        )
    return rest, kept


def _land_positions(cur: Any, run_id: int, pos: Sequence[dict[str, Any]]) -> int:
    latest: dict[int, dict[str, Any]] = {}
    for e in pos:
        cur_e = latest.get(e["rank"])
        if cur_e is None or e["seq"] > cur_e["seq"]:
            latest[e["rank"]] = e
    rows = []
    for r, e in sorted(latest.items()):
        d = e["data"]
        c = d.get("collective") if isinstance(d.get("collective"), dict) else {}
        rows.append((r, e["seq"], e["ts"], e["step"], d.get("state"), d.get("phase"), d.get("open_s"),
                     c.get("op"), c.get("dim"), c.get("group"), c.get("seq"), c.get("bytes"), c.get("since_s"),
                     c.get("done"), json.dumps(d["stack"]) if d.get("stack") is not None else None, d.get("source")))
    cols = list(zip(*rows, strict=True))
    cur.execute(
        "INSERT INTO run_positions (run_id, rank, seq, ts, step, state, phase, open_s, coll_op, coll_dim, coll_group, "
        "coll_seq, coll_bytes, coll_since_s, coll_done, stack, source, received_at) "
        "SELECT %s, r, s, t, st, sta, ph, o, cop, cdim, cgr, cseq, cb, csince, cdone, stk::jsonb, src, now() FROM "
        "unnest(%s::int[], %s::bigint[], %s::float8[], %s::bigint[], %s::text[], %s::text[], %s::float8[], %s::text[], "
        "%s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::float8[], %s::bool[], %s::text[], %s::text[]) "
        "AS x(r, s, t, st, sta, ph, o, cop, cdim, cgr, cseq, cb, csince, cdone, stk, src) "
        "ON CONFLICT (run_id, rank) DO UPDATE SET seq = excluded.seq, ts = excluded.ts, step = excluded.step, "
        "state = excluded.state, phase = excluded.phase, open_s = excluded.open_s, coll_op = excluded.coll_op, "
        "coll_dim = excluded.coll_dim, coll_group = excluded.coll_group, coll_seq = excluded.coll_seq, "
        "coll_bytes = excluded.coll_bytes, coll_since_s = excluded.coll_since_s, coll_done = excluded.coll_done, "
        "stack = excluded.stack, source = excluded.source, received_at = excluded.received_at "
        "WHERE excluded.seq > run_positions.seq",
        (run_id, *[list(c) for c in cols]),
    )
    return len(pos)


def _land_failures(cur: Any, run_id: int, fail: Sequence[dict[str, Any]]) -> tuple[int, int]:
    first: dict[tuple[int, str], dict[str, Any]] = {}
    for e in fail:
        d = e["data"]
        rank = d["rank"] if type(d.get("rank")) is int else e["rank"]
        first.setdefault((rank, d["source"]), e)
    keys = list(first)
    have = {(int(r), str(s)) for r, s in cur.execute(
        "SELECT f.rank, f.source FROM run_failures f JOIN unnest(%s::int[], %s::text[]) AS k(r, s) "
        "ON f.rank = k.r AND f.source = k.s WHERE f.run_id = %s",
        ([k[0] for k in keys], [k[1] for k in keys], run_id)).fetchall()}
    n = int(cur.execute("SELECT count(*) FROM run_failures WHERE run_id = %s", (run_id,)).fetchone()[0])
    room = max(MAX_FAILURES_PER_RUN - n, 0)
    new = [k for k in keys if k not in have]
    take, over = new[:room], new[room:]
    if take:
        rows = []
        for k in take:
            e = first[k]
            d = e["data"]
            rows.append((k[0], k[1], e["ts"], e["step"], d.get("exception"), d.get("message"),
                         json.dumps(d["frames"]) if d.get("frames") is not None else None, d.get("phase"),
                         d.get("signal"), d.get("exit_code")))
        cols = list(zip(*rows, strict=True))
        cur.execute(
            "INSERT INTO run_failures (run_id, rank, source, ts, step, exception, message, frames, phase, signal, "
            "exit_code) SELECT %s, r, s, t, st, ex, m, fr::jsonb, ph, sg, ec FROM unnest(%s::int[], %s::text[], "
            "%s::float8[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::int[]) "
            "AS x(r, s, t, st, ex, m, fr, ph, sg, ec) ON CONFLICT DO NOTHING",
            (run_id, *[list(c) for c in cols]),
        )
    # every failure event not stored beyond the cap counts as dropped (copies of a stored one do not)
    dropped = sum(1 for e in fail if (e["data"]["rank"] if type(e["data"].get("rank")) is int else e["rank"],
                                     e["data"]["source"]) in set(over))
    return len(fail) - dropped, dropped


def _land_pauses(cur: Any, run_id: int, pause: Sequence[dict[str, Any]]) -> int:
    """Apply pause begin/end events in (rank, seq) order; returns the events dropped (a reason beyond
    MAX_PAUSE_REASONS_PER_RUN)."""
    known = {str(r) for (r,) in cur.execute(
        "SELECT DISTINCT reason FROM run_pauses WHERE run_id = %s", (run_id,)).fetchall()}
    evs = sorted(pause, key=lambda e: (e["rank"], e["seq"]))
    keys = sorted({(e["rank"], e["data"]["reason"]) for e in evs})
    rows: dict[tuple[int, str], list[Any]] = {}
    for r, reason, seq, since, exp, total, count in cur.execute(
            "SELECT p.rank, p.reason, p.seq, p.open_since, p.expected_s, p.total_s, p.count FROM run_pauses p "
            "JOIN unnest(%s::int[], %s::text[]) AS k(r, re) ON p.rank = k.r AND p.reason = k.re WHERE p.run_id = %s",
            ([k[0] for k in keys], [k[1] for k in keys], run_id)).fetchall():
        rows[(int(r), str(reason))] = [int(seq), since, exp, float(total), int(count)]
    dropped = 0
    now = dt.datetime.now(dt.timezone.utc).timestamp()
    for e in evs:
        d = e["data"]
        key = (e["rank"], d["reason"])
        if d["reason"] not in known:
            if len(known) >= MAX_PAUSE_REASONS_PER_RUN:
                dropped += 1
                continue
            known.add(d["reason"])
        row = rows.setdefault(key, [-1, None, None, 0.0, 0])
        if e["seq"] <= row[0]:
            continue  # a re-sent event: applied already
        row[0] = e["seq"]
        ts = float(e["ts"]) if e["ts"] is not None else now
        if d["state"] == "begin":
            row[1], row[2] = ts, d.get("expected_s")
        else:
            dur = d.get("duration_s")
            if dur is None and row[1] is not None:
                dur = max(ts - float(row[1]), 0.0)
            row[3] += float(dur or 0.0)
            row[4] += 1
            row[1] = row[2] = None
    if rows:
        items = sorted(rows.items())
        cur.execute(
            "INSERT INTO run_pauses (run_id, rank, reason, seq, open_since, expected_s, total_s, count, received_at) "
            "SELECT %s, r, re, s, o, x, t, c, now() FROM unnest(%s::int[], %s::text[], %s::bigint[], %s::float8[], "
            "%s::float8[], %s::float8[], %s::int[]) AS u(r, re, s, o, x, t, c) "
            "ON CONFLICT (run_id, rank, reason) DO UPDATE SET seq = excluded.seq, open_since = excluded.open_since, "
            "expected_s = excluded.expected_s, total_s = excluded.total_s, count = excluded.count, "
            "received_at = excluded.received_at",
            (run_id, [k[0] for k, _ in items], [k[1] for k, _ in items], [v[0] for _, v in items],
             [v[1] for _, v in items], [v[2] for _, v in items], [v[3] for _, v in items], [v[4] for _, v in items]),
        )
    return dropped


# --------------------------------------------------------------------------------------------- reads


@dataclass(frozen=True)
class Position:
    rank: int
    ts: float | None
    step: int | None
    state: str | None
    phase: str | None
    open_s: float | None
    op: str | None
    dim: str | None
    group: str | None
    seq: int | None
    bytes: int | None
    since_s: float | None
    done: bool | None
    stack: list[dict[str, Any]] | None
    source: str | None
    age_s: float  # seconds since the server received it


@dataclass(frozen=True)
class Failure:
    rank: int
    source: str
    ts: float | None
    step: int | None
    exception: str | None
    message: str | None
    frames: list[dict[str, Any]] | None
    phase: str | None
    signal: str | None
    exit_code: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "exception": self.exception, "message": self.message,
                "exit_code": self.exit_code, "signal": self.signal, "source": self.source, "ts": self.ts,
                "phase": self.phase, "frames": self.frames or []}


@dataclass(frozen=True)
class Pause:
    rank: int
    reason: str
    open_since: float | None
    expected_s: float | None
    total_s: float
    count: int


def _frames(v: Any) -> list[dict[str, Any]] | None:
    return [f for f in v if isinstance(f, dict)][:16] if isinstance(v, list) else None


def positions(engine: Engine, run_id: int, limit: int = 1024) -> list[Position]:
    """The latest positions of the first ``limit`` ranks that reported one, loaded whole (tests and small
    tools; the server computes the wavefront in SQL: :func:`wave_summary`)."""
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT {_POSITION_COLS} FROM run_positions WHERE run_id = :r ORDER BY rank LIMIT :n"),
            {"r": run_id, "n": limit}).fetchall()
    return [_position(r) for r in rows]


class OverBudget(Exception):
    """A health read did not fit its time budget (Postgres cancelled it, or nothing was left of it)."""


def is_over_budget(e: BaseException) -> bool:
    """Whether ``e`` is a statement cancelled by its budget (``statement_timeout``, or a cancel request)."""
    import psycopg

    return isinstance(e, OverBudget) or (isinstance(e, DBAPIError)
                                         and isinstance(getattr(e, "orig", None), psycopg.errors.QueryCanceled))


def _budget(c: Connection, deadline: float | None) -> None:
    """``SET LOCAL statement_timeout`` to what is left of the budget (inside the caller's transaction)."""
    if deadline is None:
        return
    ms = int((deadline - time.monotonic()) * 1000)
    if ms < 1:
        raise OverBudget("the budget is spent")
    c.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")


# the wavefront in SQL (analysis.health.wavefront is the reference: same ranks, same ties). A rank is live
# when its position is at most :silence seconds old; a collective is named by its dimension, else (no
# dimension, or '') by its process group; ties of the most common step / collective go to the one whose
# first rank is lowest (Counter.most_common over positions in rank order)
_LIVE = "received_at >= now() - make_interval(secs => CAST(:silence AS float8))"
_WDIM = "(CASE WHEN coll_dim <> '' THEN coll_dim END)"
_WGRP = "(CASE WHEN coll_dim IS NULL OR coll_dim = '' THEN coll_group END)"
_BLOCKED = "(coll_op IS NOT NULL AND coll_done IS FALSE)"

_WAVE_COUNTS = (
    f"WITH g AS (SELECT {_LIVE} AS live, step, {_WDIM} AS wdim, {_WGRP} AS wgrp, coll_op, coll_seq, "
    f"{_BLOCKED} AS blocked, count(*) AS n, min(rank) AS r0 FROM run_positions "
    "WHERE run_id = :r AND rank >= 0 AND rank < :w GROUP BY 1, 2, 3, 4, 5, 6, 7) "
    "SELECT (SELECT count(*) FROM run_positions WHERE run_id = :r), (SELECT coalesce(sum(n), 0) FROM g), "
    "(SELECT coalesce(sum(n), 0) FROM g WHERE live), "
    "(SELECT step FROM g WHERE live AND step IS NOT NULL GROUP BY step ORDER BY sum(n) DESC, min(r0) LIMIT 1), "
    "w.wdim, w.wgrp, w.coll_op, w.coll_seq, w.n FROM (SELECT 1) AS one LEFT JOIN LATERAL ("
    "SELECT wdim, wgrp, coll_op, coll_seq, sum(n) AS n FROM g WHERE live AND blocked "
    "GROUP BY 1, 2, 3, 4 ORDER BY sum(n) DESC, min(r0) LIMIT 1) AS w ON true"
)


def _rank_set_sql(cte: str) -> str:
    """Columns of a RankSet of the ranks in CTE ``cte`` (count, first :n, runs of consecutive ranks)."""
    isl = (f"(SELECT min(rank) AS a, max(rank) AS b FROM (SELECT rank, rank - row_number() OVER (ORDER BY rank) AS k "
           f"FROM {cte}) AS x GROUP BY k)")
    return (f"(SELECT count(*) FROM {cte}), "
            f"(SELECT array_agg(rank ORDER BY rank) FROM (SELECT rank FROM {cte} ORDER BY rank LIMIT :n) AS x), "
            f"(SELECT count(*) FROM {isl} AS i), "
            f"(SELECT array_agg(ARRAY[a, b] ORDER BY a) FROM (SELECT a, b FROM {isl} AS i ORDER BY a LIMIT :nr) AS x)")


def _nodes_sql(cte: str) -> str:
    """Columns: how many nodes in CTE ``cte`` (column ``node``), the first :n by code point."""
    return (f"(SELECT count(*) FROM {cte}), (SELECT array_agg(node ORDER BY node COLLATE \"C\") FROM "
            f"(SELECT node FROM {cte} ORDER BY node COLLATE \"C\" LIMIT :n) AS x)")


def _missing_sql(waiting: bool, complete: bool) -> str:
    """The ranks that never arrived: silent (no live position, or none at all), and with a collective
    waited in, the live ones not blocked in any collective unless already past it on its dimension, and
    those blocked in an earlier one of its dimension; with their nodes."""
    cond = f"NOT ({_LIVE})"
    if waiting:
        same = f"({_WDIM} IS NOT DISTINCT FROM CAST(:wdim AS text) AND {_WGRP} IS NOT DISTINCT FROM CAST(:wgrp AS text))"
        cond += (f" OR ({_BLOCKED} AND coll_seq < CAST(:wseq AS bigint) AND {same})"
                 f" OR (NOT {_BLOCKED} AND NOT coalesce(coll_op IS NOT NULL AND coll_seq >= CAST(:wseq AS bigint) "
                 f"AND {same}, false))")
    m = f"SELECT rank FROM run_positions WHERE run_id = :r AND rank >= 0 AND rank < :w AND ({cond})"
    if not complete:  # ranks in [0, world) without any position are silent too
        m += (" UNION ALL SELECT g FROM generate_series(0, :w - 1) AS g WHERE NOT EXISTS "
              "(SELECT 1 FROM run_positions q WHERE q.run_id = :r AND q.rank = g)")
    return (f"WITH m AS MATERIALIZED ({m}), "
            "mn AS (SELECT DISTINCT coalesce(node, host) AS node FROM ranks WHERE run_id = :r "
            "AND rank = ANY(ARRAY(SELECT rank FROM m)) AND coalesce(node, host) IS NOT NULL) "
            f"SELECT {_rank_set_sql('m')}, {_nodes_sql('mn')}")


# nodes all of whose ranks (in [0, world)) are silent; and every rank of those nodes
_LOST = (
    "WITH lost AS MATERIALIZED (SELECT coalesce(k.node, k.host) AS node FROM ranks k LEFT JOIN run_positions p "
    "ON p.run_id = k.run_id AND p.rank = k.rank WHERE k.run_id = :r AND k.rank >= 0 AND k.rank < :w "
    f"AND coalesce(k.node, k.host) IS NOT NULL GROUP BY 1 HAVING NOT bool_or(coalesce(p.{_LIVE}, false))), "
    "lr AS MATERIALIZED (SELECT rank FROM ranks WHERE run_id = :r AND coalesce(node, host) IN (SELECT node FROM lost)) "
    f"SELECT {_nodes_sql('lost')}, {_rank_set_sql('lr')}"
)

_POSITION_COLS = ("rank, ts, step, state, phase, open_s, coll_op, coll_dim, coll_group, coll_seq, coll_bytes, "
                  "coll_since_s, coll_done, stack, source, extract(epoch FROM now() - received_at)")


def _position(r: Any) -> Position:
    return Position(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12],
                    _frames(r[13]), r[14], float(r[15]))


def _rank_set(count: Any, listed: Any, run_count: Any, runs: Any, max_listed: int) -> RankSet:
    return RankSet(int(count or 0), [int(x) for x in listed or []][:max_listed],
                   [(int(a), int(b)) for a, b in runs or []], int(run_count or 0))


def wave_summary(engine: Engine, run_id: int, world_size: int, silence_s: float, *, max_listed: int = 1024,
                 max_stacks: int = 16, budget_s: float | None = None) -> WaveSummary:
    """The run's wavefront (``analysis.health.WaveSummary``) computed in SQL over ``run_positions`` and
    ``ranks``: a few aggregate statements in one repeatable-read transaction, each returning counts and
    bounded lists — never every rank's row. ``budget_s``: the whole read is cancelled by Postgres past it
    (``SET LOCAL statement_timeout`` to what is left before each statement) and :class:`OverBudget` or a
    cancelled-statement error (:func:`is_over_budget`) is raised."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    w = int(world_size)
    listed = max(int(max_listed), int(max_stacks), 1)  # the stacks are those of the first missing ranks
    base = {"r": run_id, "w": w, "silence": float(silence_s), "n": listed, "nr": RANGES_SHOWN}
    out = WaveSummary()
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as c, c.begin():
        _budget(c, deadline)
        row = c.execute(text(_WAVE_COUNTS), base).one()
        out.positions, in_range, out.live = int(row[0]), int(row[1]), int(row[2])
        if out.positions == 0:
            return out
        out.silent = w - out.live
        out.step = None if row[3] is None else int(row[3])
        if row[6] is not None:
            out.waiting = {"op": row[6], "dim": row[4], "group": row[5], "seq": None if row[7] is None else int(row[7]),
                           "ranks": int(row[8])}
        if out.live == 0:
            return out
        if out.silent:
            _budget(c, deadline)
            lost = c.execute(text(_LOST), base).one()
            out.lost_node_count, out.lost_nodes = int(lost[0] or 0), list(lost[1] or [])[:max_listed]
            out.lost = _rank_set(lost[2], lost[3], lost[4], lost[5], max_listed)
        if out.waiting is None and not out.silent:
            return out  # nothing is missing
        _budget(c, deadline)
        wt = out.waiting or {}
        miss = c.execute(text(_missing_sql(out.waiting is not None, complete=in_range == w)),
                         {**base, "wdim": wt.get("dim"), "wgrp": wt.get("group"), "wseq": wt.get("seq")}).one()
        out.missing = _rank_set(miss[0], miss[1], miss[2], miss[3], max_listed)
        out.missing_node_count, out.missing_nodes = int(miss[4] or 0), list(miss[5] or [])[:max_listed]
        first = [int(x) for x in miss[1] or []][:max(int(max_stacks), 1)]
        if first:
            _budget(c, deadline)
            rows = c.execute(text(f"SELECT {_POSITION_COLS} FROM run_positions WHERE run_id = :r AND rank = ANY(:ks) "
                                  "ORDER BY rank"), {"r": run_id, "ks": first}).fetchall()
            by_rank = {int(r[0]): _position(r) for r in rows}
            out.first = by_rank.get(first[0])
            for k in first[:max_stacks]:
                stack = by_rank[k].stack if k in by_rank else None
                if stack:
                    out.stacks[k] = stack
    return out


# the nodes of a failed run none of whose ranks (in [0, world)) sent a failure record or a live position,
# every rank of those nodes, and the ranks in [0, world) the server never heard of (no registration, no
# failure record). The failure records are few (MAX_FAILURES_PER_RUN): the nodes that did report are
# found by index from them; the ranks table is scanned once for its nodes
_SILENT = (
    "WITH f AS MATERIALIZED (SELECT DISTINCT rank FROM run_failures WHERE run_id = :r), "
    "said AS MATERIALIZED (SELECT DISTINCT coalesce(k.node, k.host) AS node FROM ranks k WHERE k.run_id = :r "
    "AND k.rank IN (SELECT rank FROM f) UNION SELECT DISTINCT coalesce(k.node, k.host) FROM run_positions p "
    f"JOIN ranks k ON k.run_id = p.run_id AND k.rank = p.rank WHERE p.run_id = :r AND p.{_LIVE}), "
    "k AS MATERIALIZED (SELECT rank, coalesce(node, host) AS node FROM ranks WHERE run_id = :r AND rank >= 0 "
    "AND rank < :w AND coalesce(node, host) IS NOT NULL), "
    "lost AS MATERIALIZED (SELECT DISTINCT node FROM k WHERE node NOT IN (SELECT node FROM said WHERE node IS NOT NULL)), "
    "lr AS MATERIALIZED (SELECT rank FROM k WHERE node IN (SELECT node FROM lost)) "
    f"SELECT {_nodes_sql('lost')}, {_rank_set_sql('lr')}, "
    "(SELECT count(*) FROM ranks WHERE run_id = :r AND rank >= 0 AND rank < :w)"
)
# the ranks in [0, world) without a registration nor a failure record (only read when some are missing)
_UNREPORTED = (
    "WITH u AS MATERIALIZED (SELECT g AS rank FROM generate_series(0, :w - 1) AS g EXCEPT (SELECT rank FROM ranks "
    "WHERE run_id = :r UNION SELECT rank FROM run_failures WHERE run_id = :r)) "
    f"SELECT {_rank_set_sql('u')}"
)


def silent_nodes(engine: Engine, run_id: int, world_size: int, silence_s: float, *, max_listed: int = 1024,
                 nodes_detailed: int = 16, ranks_per_node: int = 64, budget_s: float | None = None) -> SilentNodes:
    """The ranks of the run that never said why they stopped, by node (``analysis.health.SilentNodes``):
    bounded lists and counts whatever the world size, the first ``nodes_detailed`` nodes with their first
    ``ranks_per_node`` ranks. ``budget_s``: cancelled past it, as :func:`wave_summary`."""
    deadline = None if budget_s is None else time.monotonic() + budget_s
    w = int(world_size)
    base = {"r": run_id, "w": w, "silence": float(silence_s), "n": max(int(max_listed), 1), "nr": RANGES_SHOWN}
    out = SilentNodes()
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as c, c.begin():
        _budget(c, deadline)
        row = c.execute(text(_SILENT), base).one()
        out.count, out.nodes = int(row[0] or 0), list(row[1] or [])[:max_listed]
        out.ranks = _rank_set(row[2], row[3], row[4], row[5], max_listed)
        if int(row[6] or 0) < w:  # some ranks never registered
            _budget(c, deadline)
            u = c.execute(text(_UNREPORTED), base).one()
            out.unreported = _rank_set(u[0], u[1], u[2], u[3], max_listed)
        first = out.nodes[:nodes_detailed]
        if first:
            _budget(c, deadline)
            rows = c.execute(text(
                "SELECT coalesce(node, host) AS nd, count(*), (array_agg(rank ORDER BY rank))[1:CAST(:m AS int)] "
                "FROM ranks WHERE run_id = :r AND rank >= 0 AND rank < :w AND coalesce(node, host) = ANY(:nodes) "
                "GROUP BY 1"), {**base, "m": int(ranks_per_node), "nodes": first}).fetchall()
            by = {str(r[0]): (int(r[1]), [int(x) for x in r[2] or []]) for r in rows}
            out.by_node = [{"node": n, "ranks": by.get(n, (0, []))[1], "rank_count": by.get(n, (0, []))[0]}
                           for n in first]
    return out


def open_pause(engine: Engine, run_id: int, now: float, pause_max_s: float) -> dict[str, Any] | None:
    """The declared pause holding the run now (``analysis.health.open_pause`` in SQL, over every rank's
    pauses): the latest begun among the open ones within their bound (max(2 × expected, ``pause_max_s``)),
    with how many ranks have one of its reason open; None without one."""
    with engine.connect() as c:
        row = c.execute(text(
            "SELECT b.reason, b.open_since, b.expected_s, (SELECT count(*) FROM run_pauses q WHERE q.run_id = :r "
            "AND q.open_since IS NOT NULL AND q.reason = b.reason) FROM run_pauses b WHERE b.run_id = :r "
            "AND b.open_since IS NOT NULL AND CAST(:now AS float8) - b.open_since <= "
            "greatest(2 * coalesce(b.expected_s, 0), CAST(:pmax AS float8)) "
            "ORDER BY b.open_since DESC, b.rank, b.reason LIMIT 1"),
            {"r": run_id, "now": float(now), "pmax": float(pause_max_s)}).fetchone()
    if row is None:
        return None
    return {"reason": row[0], "since": row[1], "expected_s": row[2], "ranks": int(row[3])}


def failures(engine: Engine, run_id: int, limit: int = 64) -> list[Failure]:
    """The run's failures, first by time first (those without a time last), at most ``limit``."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, source, ts, step, exception, message, frames, phase, signal, exit_code FROM run_failures "
                 "WHERE run_id = :r ORDER BY ts NULLS LAST, received_at, rank, source LIMIT :n"),
            {"r": run_id, "n": limit}).fetchall()
    return [Failure(int(r[0]), r[1], r[2], r[3], r[4], r[5], _frames(r[6]), r[7], r[8], r[9]) for r in rows]


def failure_count(engine: Engine, run_id: int) -> tuple[int, int]:
    """(failure rows stored, distinct failed ranks)."""
    with engine.connect() as c:
        row = c.execute(text("SELECT count(*), count(DISTINCT rank) FROM run_failures WHERE run_id = :r"),
                        {"r": run_id}).one()
    return int(row[0]), int(row[1])


def pauses(engine: Engine, run_id: int, *, open_only: bool = False, limit: int = 65_536) -> list[Pause]:
    """The run's pause rows (open ones only with ``open_only``), at most ``limit``."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, reason, open_since, expected_s, total_s, count FROM run_pauses WHERE run_id = :r"
                 + (" AND open_since IS NOT NULL" if open_only else "") + " ORDER BY rank, reason LIMIT :n"),
            {"r": run_id, "n": limit}).fetchall()
    return [Pause(int(r[0]), r[1], r[2], r[3], float(r[4]), int(r[5])) for r in rows]


def last_pause_end(engine: Engine, run_id: int) -> float | None:
    """When the server received the latest end of a declared pause of the run (unix time), None without one."""
    with engine.connect() as c:
        v = c.execute(text("SELECT extract(epoch FROM max(received_at)) FROM run_pauses WHERE run_id = :r "
                           "AND open_since IS NULL AND count > 0"), {"r": run_id}).scalar()
    return None if v is None else float(v)


def pause_totals(engine: Engine, run_ids: Sequence[int]) -> dict[int, dict[str, float]]:
    """{run: {reason: seconds in ended pauses}}: per reason the largest over the ranks (the ranks pause
    together; the one that paused longest held the others)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT run_id, reason, max(total_s) FROM run_pauses WHERE run_id = ANY(:ids) "
                              "GROUP BY run_id, reason"), {"ids": list(run_ids)}).fetchall()
    out: dict[int, dict[str, float]] = {}
    for r, reason, s in rows:
        out.setdefault(int(r), {})[str(reason)] = float(s or 0.0)
    return out


def node_map(engine: Engine, run_id: int, ranks: Sequence[int] | None = None) -> dict[int, str]:
    """{rank: node (else host)} of the ranks that reported one (of ``ranks`` only, when given)."""
    only = " AND rank = ANY(:ks)" if ranks is not None else ""
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, coalesce(node, host) FROM ranks WHERE run_id = :r" + only),
                         {"r": run_id, "ks": [int(k) for k in ranks or []]}).fetchall()
    return {int(r): str(n) for r, n in rows if n is not None}


@dataclass(frozen=True)
class RunProgress:
    """A run as the health pass sees it."""

    run_id: int
    name: str
    status: str
    world_size: int
    started_at: float
    finished_at: float | None
    steps: int
    current_step: int | None  # compacted or landed
    state: str | None  # the health pass's last conclusion (None: never evaluated)
    seen_step: int | None
    progress_at: float | None  # server time the pass last saw the step advance
    since: float | None
    hang_s: float
    detail: dict[str, Any]
    now: float  # the database's now
    failures: int = 0  # failure rows stored


def progress(engine: Engine, run_ids: Sequence[int] | None = None, *, active_only: bool = True,
             limit: int = 10_000) -> list[RunProgress]:
    """The runs to evaluate: those not ended (running, stalled, hung) plus failed ones without a health
    row, or the given ones; with their compacted/landed last step and the last health row."""
    where = "WHERE r.id = ANY(:ids)" if run_ids is not None else (
        "WHERE r.status IN ('running', 'stalled', 'hung') OR h.state IN ('running', 'stalled', 'hung')"
        " OR (h.run_id IS NULL AND r.finished_at IS NULL)"
        " OR (h.state IS DISTINCT FROM 'failed' AND fc.n > 0)"
        # an ended run is assessed again when failure records landed since its last conclusion (one with
        # an earlier time changes the root cause), and while its cause is settling (a node not heard from)
        " OR (fc.n > 0 AND CAST(h.detail->>'failures_seen' AS bigint) IS DISTINCT FROM fc.n)"
        " OR (h.detail->>'settle_until') IS NOT NULL"
        if active_only else "")
    # joins to per-run aggregates, not subqueries correlated with r.id: on Citus `runs` is a reference
    # table, and a subquery on a distributed table correlated with it is refused
    # the pass counts only failures received in the last day (a failed run's health row says failed
    # already; a new failure is recent): it never scans every failure ever stored
    only = "WHERE run_id = ANY(:ids)" if run_ids is not None else ""
    recent = "WHERE received_at > now() - interval '1 day'"
    sql = (
        "SELECT r.id, r.name, r.status, r.world_size, extract(epoch FROM r.started_at), extract(epoch FROM r.finished_at), "
        "r.steps, greatest(r.last_step, g.m), "
        "h.state, h.last_step, extract(epoch FROM h.progress_at), extract(epoch FROM h.since), coalesce(h.hang_s, 0), "
        "coalesce(h.detail, '{}'::jsonb), extract(epoch FROM now()), coalesce(fc.n, 0) "
        "FROM runs r LEFT JOIN run_health h ON h.run_id = r.id "
        f"LEFT JOIN (SELECT run_id, max(step_max) AS m FROM ingest_fragments {only} GROUP BY run_id) g ON g.run_id = r.id "
        f"LEFT JOIN (SELECT run_id, count(*) AS n FROM run_failures {only or recent} GROUP BY run_id) fc "
        f"ON fc.run_id = r.id {where} ORDER BY r.id LIMIT :n"
    )
    with engine.connect() as c:
        rows = c.execute(text(sql), {"ids": list(run_ids or []), "n": limit}).fetchall()
    return [RunProgress(int(r[0]), r[1], r[2], int(r[3]), float(r[4]), None if r[5] is None else float(r[5]),
                        int(r[6] or 0), None if r[7] is None else int(r[7]), r[8], None if r[9] is None else int(r[9]),
                        None if r[10] is None else float(r[10]), None if r[11] is None else float(r[11]),
                        float(r[12]), r[13] if isinstance(r[13], dict) else {}, float(r[14]), int(r[15])) for r in rows]


def step_p99(engine: Engine, run_id: int, last: int = 1000) -> float | None:
    """The 99th percentile of the slowest rank's step time over the run's last ``last`` steps."""
    with engine.connect() as c:
        v = c.execute(text(
            "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY s) FROM (SELECT coalesce(step_s_max, step_s) AS s "
            "FROM steps WHERE run_id = :r AND coalesce(step_s_max, step_s) IS NOT NULL ORDER BY step DESC LIMIT :n) x"),
            {"r": run_id, "n": last}).scalar()
    return None if v is None else float(v)


def save_health(engine: Engine, run_id: int, *, state: str, since: float | None, finding: str | None,
                detail: dict[str, Any], seen_step: int | None, progress_at: float | None, hang_s: float,
                status: str | None) -> None:
    """Store the pass's conclusion; ``status``: the run's new ``runs.status`` (None: unchanged)."""
    with engine.begin() as c:
        c.execute(text(
            "INSERT INTO run_health (run_id, state, since, finding, detail, last_step, progress_at, hang_s, updated_at) "
            "VALUES (:r, :s, to_timestamp(CAST(:since AS float8)), :f, CAST(:d AS jsonb), :ls, "
            "to_timestamp(CAST(:pa AS float8)), :h, now()) ON CONFLICT (run_id) DO UPDATE SET state = excluded.state, "
            "since = excluded.since, finding = excluded.finding, detail = excluded.detail, last_step = excluded.last_step, "
            "progress_at = excluded.progress_at, hang_s = excluded.hang_s, updated_at = excluded.updated_at"),
            {"r": run_id, "s": state, "since": since, "f": finding, "d": json.dumps(detail, default=str),
             "ls": seen_step, "pa": progress_at, "h": hang_s})
        if status is not None:
            # only a run that has not ended by hand changes status (a finish always wins)
            c.execute(text("UPDATE runs SET status = :s WHERE id = :r AND status <> :s AND "
                           "(status IN ('running', 'stalled', 'hung') OR :s = 'failed' AND status <> 'finished')"),
                      {"r": run_id, "s": status})


def set_status(engine: Engine, run_id: int, status: str) -> None:
    with engine.begin() as c:
        c.execute(text("UPDATE runs SET status = :s WHERE id = :r"), {"r": run_id, "s": status})


def load_health(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The stored health row (state, since, finding, detail, hang_s, progress_at), None before any pass."""
    with engine.connect() as c:
        row = c.execute(text("SELECT state, extract(epoch FROM since), finding, detail, hang_s, "
                             "extract(epoch FROM progress_at), extract(epoch FROM updated_at) FROM run_health "
                             "WHERE run_id = :r"), {"r": run_id}).fetchone()
    if row is None:
        return None
    return {"state": row[0], "since": row[1], "finding": row[2], "detail": row[3] if isinstance(row[3], dict) else {},
            "hang_s": float(row[4] or 0), "progress_at": row[5], "updated_at": row[6]}


def health_rows(engine: Engine, run_ids: Sequence[int]) -> dict[int, tuple[str, float | None, str | None]]:
    """{run: (state, since, finding)} of the runs with a health row."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT run_id, state, extract(epoch FROM since), finding FROM run_health "
                              "WHERE run_id = ANY(:ids)"), {"ids": [int(i) for i in run_ids]}).fetchall()
    return {int(r[0]): (r[1], None if r[2] is None else float(r[2]), r[3]) for r in rows}


def attempts(engine: Engine, run_id: int, limit: int = 256) -> list[dict[str, Any]]:
    """The attempts of the run's job in order: runs of the same owner with the same job id (or, without
    one, the same name), each with its time span, status, steps and last step."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT o.id, o.attempt, extract(epoch FROM o.started_at), extract(epoch FROM o.finished_at), "
            "extract(epoch FROM o.last_seen_at), o.status, o.steps, o.last_step, o.job_id "
            "FROM runs r JOIN runs o ON o.owner_key = r.owner_key AND (CASE WHEN r.job_id IS NOT NULL "
            "THEN o.job_id = r.job_id ELSE o.job_id IS NULL AND o.name = r.name END) "
            "WHERE r.id = :r ORDER BY o.attempt, o.id LIMIT :n"), {"r": run_id, "n": limit}).fetchall()
        # the attempts' landed and first compacted steps by run id, not by subqueries correlated with
        # `runs` (a reference table on Citus, which refuses those)
        ids = [int(r[0]) for r in rows]
        landed: dict[Any, Any] = dict(c.execute(text("SELECT run_id, max(step_max) FROM ingest_fragments WHERE run_id = ANY(:ids) "
                                     "GROUP BY run_id"), {"ids": ids}).fetchall())
        first: dict[Any, Any] = dict(c.execute(text("SELECT run_id, min(step) FROM steps WHERE run_id = ANY(:ids) GROUP BY run_id"),
                               {"ids": ids}).fetchall())

    def last(r: Any) -> int | None:
        vals = [int(v) for v in (r[7], landed.get(r[0])) if v is not None]
        return max(vals) if vals else None

    return [{"run_id": int(r[0]), "attempt": int(r[1]), "started_at": r[2], "ended_at": r[3] if r[3] is not None else r[4],
             "finished": r[3] is not None, "status": r[5], "steps": int(r[6] or 0),
             "last_step": last(r), "job_id": r[8],
             "first_step": None if first.get(r[0]) is None else int(first[r[0]])} for r in rows]


def steps_at_or_below(engine: Engine, run_id: int, step: int) -> tuple[int, float]:
    """(steps of the run with index ≤ ``step``, their summed median step time)."""
    with engine.connect() as c:
        row = c.execute(text("SELECT count(*), coalesce(sum(step_s), 0) FROM steps WHERE run_id = :r AND step <= :s"),
                        {"r": run_id, "s": step}).one()
    return int(row[0]), float(row[1])


_FLEET_GOODPUT = (
    "WITH r AS (SELECT id, started_at, extract(epoch FROM coalesce(finished_at, last_seen_at, started_at) - started_at) "
    "AS wall FROM runs WHERE started_at > now() - make_interval(days => :d)), "
    "p AS (SELECT run_id, sum(greatest(coalesce(step_s, 0) - coalesce(data_s, 0), 0)) AS prod FROM steps "
    "WHERE run_id IN (SELECT id FROM r) GROUP BY run_id) "
    "SELECT date_trunc('day', r.started_at AT TIME ZONE 'UTC') AS day, count(*), coalesce(sum(p.prod), 0), "
    "sum(greatest(r.wall, coalesce(p.prod, 0))) FROM r LEFT JOIN p ON p.run_id = r.id GROUP BY 1 ORDER BY 1"
)


def fleet_goodput_rows(engine: Engine, days: int) -> list[Any]:
    """(day, runs, productive seconds, wall seconds) per UTC day of the runs started in the last
    ``days`` days (reports.health.fleet_goodput)."""
    with engine.connect() as c:
        return list(c.execute(text(_FLEET_GOODPUT), {"d": int(days)}).fetchall())
