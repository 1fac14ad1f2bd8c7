"""``run_events`` (checkpoints, evaluations, restarts, agent drop counts … as JSONB), ``run_groups``
(process groups, once per group) and ``run_event_counts`` (what a run holds and what was dropped), the
write side at ingest (:func:`land_events`) and every read of them.

Bounds (``server/limits.py``, docs/security.md "Bounds on what a run stores"): a run keeps at most
MAX_EVENTS_PER_RUN events, MAX_EVENTS_PER_KIND of one kind and MAX_GROUPS_PER_RUN groups; beyond them
events are dropped and counted in ``run_event_counts``. Admission runs under the run's
transaction-level advisory lock, so the caps hold across concurrent batches and server instances.
Every read has a LIMIT and loads a bounded payload whatever older servers stored (they kept events
unbounded): readers project the fields they use, cut strings, and skip values out of range.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, text

from ..db import raw_connection
from ..groups import Group
from ..limits import (
    MAX_EVENTS_PER_KIND,
    MAX_EVENTS_PER_RUN,
    MAX_GROUPS_PER_RUN,
    MAX_HIST_BINS,
    MAX_HIST_COUNT,
    MAX_MICROBATCHES,
    MAX_PAGE_ROWS,
    MAX_PIPELINE_STAGES,
)
from . import devices as devices_store
from . import health as health_store
from . import scalars as scalars_store

__all__ = ["run_events", "job_events", "flops_method", "pipeline_events", "seq_len_bins", "land_events", "Landed", "group_rows",
           "group_ranks", "legacy_groups", "event_limits", "GroupRow", "GROUPS_KIND", "TOTAL_KIND", "EVENT_DATA_BYTES"]

_LOCK_KEY = 727280  # with the run id: pg_advisory_xact_lock(key, run_id) around admitting a run's events
GROUPS_KIND = "comm_group"  # run_event_counts row of the run's groups (stored = run_groups rows)
TOTAL_KIND = ""  # run_event_counts row of the run's run_events rows, all kinds (an event kind is never empty)
EVENT_DATA_BYTES = 16_384
"""Bytes of one event's data the event list returns (an older server stored larger ones: shown as
``{"_truncated": true, "bytes": n}``)."""


# --------------------------------------------------------------------------- write (ingest)


@dataclass
class Landed:
    """What :func:`land_events` kept: ``events`` = events stored now or already stored (a re-sent
    batch) plus group descriptions whose group is in ``run_groups``; ``dropped`` {kind: n} beyond a cap."""

    events: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def land_events(cur: Any, run_id: int, events: Sequence[dict[str, Any]], groups: Sequence[tuple[Group, int]]) -> Landed:
    """Admit a batch's events and group descriptions within its transaction (call it last: it takes the
    run's event lock until commit). First copy wins: a (rank, seq) already stored is not stored again and
    not counted; events and groups beyond the run's caps are dropped and counted in batch order."""
    out = Landed()
    if not events and not groups:
        return out
    cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_KEY, int(run_id)))
    if any(e["kind"] == scalars_store.SCALARS_KIND for e in events):  # run.log: to run_scalars (store/scalars.py)
        n_scalars, out.dropped = scalars_store.land_scalars(
            cur, run_id, [e for e in events if e["kind"] == scalars_store.SCALARS_KIND])
        out.events += n_scalars
        events = [e for e in events if e["kind"] != scalars_store.SCALARS_KIND]
    if any(e["kind"] == devices_store.DEVICE_KIND for e in events):  # device telemetry: to run_devices
        n_dev, dropped_dev = devices_store.land_devices(
            cur, run_id, [e for e in events if e["kind"] == devices_store.DEVICE_KIND])
        out.events += n_dev
        out.dropped.update(dropped_dev)
        events = [e for e in events if e["kind"] != devices_store.DEVICE_KIND]
    # run health (store/health.py): positions and failures to their own bounded tables, pauses applied there too
    events, health_kept = health_store.land(cur, run_id, events)
    out.events += health_kept
    new_events, present = _new_events(cur, run_id, events)
    kinds = sorted({e["kind"] for e in new_events} | ({GROUPS_KIND} if groups else set()) | {TOTAL_KIND})
    have = {k: int(n) for k, n in cur.execute(
        "SELECT kind, stored FROM run_event_counts WHERE run_id = %s AND kind = ANY(%s)", (run_id, kinds)).fetchall()}
    stored: dict[str, int] = {}
    dropped: dict[str, int] = {}
    folded: dict[str, int] = {}
    keep: list[dict[str, Any]] = []
    total = have.get(TOTAL_KIND, 0)
    for e in new_events:
        k = e["kind"]
        if total >= MAX_EVENTS_PER_RUN or have.get(k, 0) + stored.get(k, 0) >= MAX_EVENTS_PER_KIND:
            dropped[k] = dropped.get(k, 0) + 1
            continue
        keep.append(e)
        total += 1
        stored[k] = stored.get(k, 0) + 1
        if e.get("folded"):
            folded[k] = folded.get(k, 0) + 1
    if keep:
        cur.execute(
            "INSERT INTO run_events (run_id, rank, seq, kind, ts, step, data) "
            "SELECT %s, r, s, k, t, st, d::jsonb FROM unnest(%s::int[], %s::int[], %s::text[], %s::float8[], "
            "%s::int[], %s::text[]) AS x(r, s, k, t, st, d) ON CONFLICT (run_id, rank, seq) DO NOTHING",
            (run_id, [e["rank"] for e in keep], [e["seq"] for e in keep], [e["kind"] for e in keep],
             [None if e["ts"] is None else float(e["ts"]) for e in keep], [e["step"] for e in keep],
             [json.dumps(e["data"]) for e in keep]),
        )
        stored[TOTAL_KIND] = len(keep)
    out.events += len(keep) + present
    if groups:
        n_groups, n_kept, n_dropped = _land_groups(cur, run_id, groups, have.get(GROUPS_KIND, 0))
        out.events += n_kept
        if n_groups:
            stored[GROUPS_KIND] = n_groups
        if n_dropped:
            dropped[GROUPS_KIND] = n_dropped
    rows = [(k, stored.get(k, 0), dropped.get(k, 0), folded.get(k, 0)) for k in sorted({*stored, *dropped})]
    if rows:
        cur.execute(
            "INSERT INTO run_event_counts (run_id, kind, stored, dropped, folded) "
            "SELECT %s, * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::bigint[]) "
            "ON CONFLICT (run_id, kind) DO UPDATE SET stored = run_event_counts.stored + excluded.stored, "
            "dropped = run_event_counts.dropped + excluded.dropped, folded = run_event_counts.folded + excluded.folded",
            (run_id, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]),
        )
    out.dropped.update(dropped)
    return out


def _new_events(cur: Any, run_id: int, events: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(the events whose (rank, seq) is neither stored nor earlier in the batch, how many were stored)."""
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        first.setdefault((e["rank"], e["seq"]), e)
    if not first:
        return [], 0
    keys = list(first)
    stored = {(int(r), int(s)) for r, s in cur.execute(
        "SELECT e.rank, e.seq FROM run_events e JOIN unnest(%s::int[], %s::int[]) AS k(r, s) "
        "ON e.rank = k.r AND e.seq = k.s WHERE e.run_id = %s",
        ([r for r, _ in keys], [s for _, s in keys], run_id)).fetchall()}
    return [e for key, e in first.items() if key not in stored], sum(1 for e in events if (e["rank"], e["seq"]) in stored)


def _land_groups(cur: Any, run_id: int, groups: Sequence[tuple[Group, int]], have: int) -> tuple[int, int, int]:
    """(groups stored now, descriptions whose group is stored, descriptions dropped beyond MAX_GROUPS_PER_RUN)."""
    dims = [g.dim for g, _ in groups]
    keys = [g.key for g, _ in groups]
    present = {(str(d), bytes(k)) for d, k in cur.execute(
        "SELECT g.dim, g.key FROM run_groups g JOIN unnest(%s::text[], %s::bytea[]) AS x(d, k) "
        "ON g.dim = x.d AND g.key = x.k WHERE g.run_id = %s", (dims, keys, run_id)).fetchall()}
    room = max(MAX_GROUPS_PER_RUN - have, 0)
    new: list[Group] = []
    kept = dropped = 0
    for g, n in groups:
        if (g.dim, g.key) in present:
            kept += n
        elif len(new) < room:
            new.append(g)
            kept += n
        else:
            dropped += n
    if new:
        cur.execute(
            "INSERT INTO run_groups (run_id, dim, key, size, start, stride, listed, ranks, name) "
            "SELECT %s, * FROM unnest(%s::text[], %s::bytea[], %s::int[], %s::int[], %s::int[], %s::int[], "
            "%s::bytea[], %s::text[]) ON CONFLICT DO NOTHING",
            (run_id, [g.dim for g in new], [g.key for g in new], [g.size for g in new], [g.start for g in new],
             [g.stride for g in new], [g.listed for g in new], [g.ranks for g in new], [g.name for g in new]),
        )
    return len(new), kept, dropped


# --------------------------------------------------------------------------- reads


def run_events(engine: Engine, run_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """The run's events (rank, seq, kind, ts, step, data) in time order: at most ``limit`` (≤
    MAX_PAGE_ROWS), each data of at most EVENT_DATA_BYTES (else ``{"_truncated": true, "bytes": n}``)."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT rank, seq, kind, ts, step, CASE WHEN octet_length(data::text) <= :cap THEN data ELSE "
                 "jsonb_build_object('_truncated', true, 'bytes', octet_length(data::text)) END AS data "
                 "FROM (SELECT rank, seq, kind, ts, step, data FROM run_events WHERE run_id = :id "
                 "ORDER BY ts NULLS LAST, rank, seq LIMIT :n) e ORDER BY ts NULLS LAST, rank, seq"),
            {"id": run_id, "n": max(0, min(int(limit), MAX_PAGE_ROWS)), "cap": EVENT_DATA_BYTES},
        ).fetchall()
    return [dict(r._mapping) for r in rows]


def flops_method(engine: Engine, run_id: int) -> tuple[str | None, str | None]:
    """(source, method) of the lowest reporting rank's latest ``flops`` event (the agent's account of
    how it counted: ``method`` "flop_counter" / "uncompiled_fake", ``source`` "measured" / "formula");
    (None, None) without one. Strings only, at most 32 characters."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT left(data ->> 'source', 32), left(data ->> 'method', 32) FROM run_events "
                 "WHERE run_id = :id AND kind = 'flops' AND jsonb_typeof(data) = 'object' "
                 "ORDER BY rank, ts DESC NULLS LAST, seq DESC LIMIT 1"),
            {"id": run_id},
        ).one_or_none()
    return (row[0], row[1]) if row is not None else (None, None)


def job_events(engine: Engine, run_id: int, kinds: Sequence[str],
               limit: int = MAX_EVENTS_PER_RUN) -> list[tuple[str, float | None, int | None, dict[str, Any] | None]]:
    """(kind, ts, step, data) of the events of these kinds of the lowest reporting rank (it speaks for the
    job), in time order, at most ``limit``; data holds only ``duration_s`` (a number) — what goodput reads."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT kind, ts, step, CASE WHEN jsonb_typeof(data -> 'duration_s') = 'number' "
                "THEN jsonb_build_object('duration_s', data -> 'duration_s') ELSE '{}'::jsonb END "
                "FROM run_events WHERE run_id = :id AND kind = ANY(:k) AND rank = "
                "(SELECT min(rank) FROM run_events WHERE run_id = :id) ORDER BY ts NULLS LAST, seq LIMIT :n"
            ),
            {"id": run_id, "k": list(kinds), "n": limit},
        ).fetchall()
    return [(k, t, s, d) for k, t, s, d in rows]


def _int_field(name: str, hi: int) -> str:
    """``'name', data->'name'`` for jsonb_build_object when it is a number in 0..hi, else NULL."""
    v = f"data -> '{name}'"
    return (f"'{name}', CASE WHEN jsonb_typeof({v}) = 'number' THEN CASE WHEN ({v})::numeric BETWEEN 0 AND {hi} "
            f"THEN {v} END END")


_PIPELINE_DATA = ("jsonb_build_object(" + ", ".join([
    _int_field("stage", MAX_PIPELINE_STAGES - 1), _int_field("num_stages", MAX_PIPELINE_STAGES),
    _int_field("n_microbatches", MAX_MICROBATCHES),
    "'schedule', CASE WHEN jsonb_typeof(data -> 'schedule') = 'string' THEN to_jsonb(left(data ->> 'schedule', 128)) END",
]) + ")")


def pipeline_events(engine: Engine, run_id: int,
                    limit: int = MAX_EVENTS_PER_KIND) -> list[tuple[int, str, int | None, dict[str, Any]]]:
    """(rank, kind, step, data) of the run's ``pp_stage`` and ``pp_schedule`` events, by rank then sequence,
    at most ``limit`` of each kind; data holds only ``stage``, ``num_stages``, ``n_microbatches`` (within
    their bounds, else null) and ``schedule`` (≤ 128 characters)."""
    with engine.connect() as c:
        rows = c.execute(
            text(f"(SELECT rank, seq, kind, step, {_PIPELINE_DATA} AS d FROM run_events "
                 "WHERE run_id = :id AND kind = 'pp_stage' ORDER BY rank, seq LIMIT :n) UNION ALL "
                 f"(SELECT rank, seq, kind, step, {_PIPELINE_DATA} FROM run_events "
                 "WHERE run_id = :id AND kind = 'pp_schedule' ORDER BY rank, seq LIMIT :n) ORDER BY rank, seq"),
            {"id": run_id, "n": limit},
        ).fetchall()
    return [(int(r), k, s, {a: b for a, b in d.items() if b is not None} if isinstance(d, dict) else {})
            for r, _seq, k, s, d in rows]


def seq_len_bins(engine: Engine, run_id: int, limit: int = MAX_EVENTS_PER_KIND) -> dict[int, int]:
    """{log2 bin: sequences} summed over the run's ``seq_lens`` events (every rank, every window; at most
    ``limit`` events); bins beyond MAX_HIST_BINS and counts outside 0..MAX_HIST_COUNT are left out."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT b.key, sum((b.value)::numeric) "
                 "FROM (SELECT data FROM run_events WHERE run_id = :id AND kind = 'seq_lens' ORDER BY rank, seq "
                 "LIMIT :n) e, jsonb_each(CASE WHEN jsonb_typeof(e.data->'bins') = 'object' "
                 "THEN e.data->'bins' ELSE '{}'::jsonb END) b "
                 "WHERE CASE WHEN jsonb_typeof(b.value) = 'number' AND b.key ~ '^[0-9]{1,2}$' "
                 "THEN b.key::int < :bins AND (b.value)::numeric BETWEEN 0 AND :hi ELSE false END GROUP BY b.key"),
            {"id": run_id, "n": limit, "bins": MAX_HIST_BINS, "hi": MAX_HIST_COUNT},
        ).fetchall()
    out: dict[int, int] = {}
    for k, v in rows:
        if v is not None:
            out[int(k)] = out.get(int(k), 0) + int(v)
    return out


#: a stored group: (dim, key, size, start, stride, listed, has a rank list)
GroupRow = tuple[str, bytes, int, int | None, int | None, int, bool]


def group_rows(engine: Engine, run_id: int, limit: int = MAX_GROUPS_PER_RUN) -> list[GroupRow]:
    """The run's groups without their rank lists (a few dozen bytes each), by dim then key; at most ``limit``."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT dim, key, size, start, stride, listed, ranks IS NOT NULL FROM run_groups WHERE run_id = :id "
                 "ORDER BY dim, key LIMIT :n"),
            {"id": run_id, "n": limit},
        ).fetchall()
    return [(str(d), bytes(k), int(n), st, sd, int(ls), bool(h)) for d, k, n, st, sd, ls, h in rows]


def group_ranks(engine: Engine, run_id: int, dim: str, keys: Sequence[bytes], chunk: int = 64) -> Iterator[tuple[bytes, bytes]]:
    """(key, encoded ranks) of these groups of ``dim``, ``chunk`` rows per query (a rank list is at most
    ~64 KiB compressed: memory stays bounded by the chunk)."""
    for i in range(0, len(keys), chunk):
        with raw_connection(engine) as conn:
            rows = conn.execute(
                "SELECT key, ranks FROM run_groups WHERE run_id = %s AND dim = %s AND key = ANY(%s) AND ranks IS NOT NULL",
                (run_id, dim, list(keys[i:i + chunk]))).fetchall()
        yield from ((bytes(k), bytes(b)) for k, b in rows)


def legacy_groups(engine: Engine, run_id: int, limit: int = 1024, max_ranks: int = 256) -> list[tuple[str, list[int]]]:
    """(dim, the first ``max_ranks`` listed ranks) of ``comm_group`` events an older server stored in
    ``run_events`` (before run_groups), the first ``limit`` by rank then sequence."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT left(data ->> 'dim', 64), CASE WHEN jsonb_typeof(data -> 'ranks') = 'array' "
                 "THEN jsonb_path_query_array(data -> 'ranks', CAST(:path AS jsonpath)) END "
                 "FROM run_events WHERE run_id = :id AND kind = 'comm_group' ORDER BY rank, seq LIMIT :n"),
            {"id": run_id, "n": limit, "path": f"$[0 to {max_ranks - 1}]"},
        ).fetchall()
    return [(d, [r for r in rs if type(r) is int]) for d, rs in rows if isinstance(d, str) and isinstance(rs, list)]


def event_limits(engine: Engine, run_id: int, limit: int = 100) -> dict[str, dict[str, int]]:
    """``{"events_dropped": {kind: n}, "events_folded": {kind: n}}`` of the run (kinds with the most first,
    at most ``limit`` each; ``comm_group``: group descriptions dropped beyond MAX_GROUPS_PER_RUN)."""
    with engine.connect() as c:
        rows = c.execute(
            text("(SELECT 'd', kind, dropped FROM run_event_counts WHERE run_id = :id AND dropped > 0 "
                 "ORDER BY dropped DESC, kind LIMIT :n) UNION ALL "
                 "(SELECT 'f', kind, folded FROM run_event_counts WHERE run_id = :id AND folded > 0 "
                 "ORDER BY folded DESC, kind LIMIT :n)"),
            {"id": run_id, "n": limit},
        ).fetchall()
    out: dict[str, dict[str, int]] = {"events_dropped": {}, "events_folded": {}}
    for what, kind, n in rows:
        out["events_dropped" if what == "d" else "events_folded"][str(kind)] = int(n)
    return out
