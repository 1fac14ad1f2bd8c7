"""The ``runs`` table: run rows (typed), run lists for the API and the pages, registration and finish.

A run's counters (``rank_steps``, ``collective_records``, ``steps``, ``last_step``) are maintained
by the compactor. The API also counts what landed but is not compacted yet (seconds old): those
counts are loaded separately (``pending_*``) and added in :meth:`RunRow.as_dict`, so a cache keyed on
the compacted counters (:attr:`RunRow.version`) is never fooled by data in flight.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, text

from ..codec import FRAG_COLL_FIELDS, FRAG_STEP_FIELDS, decode_block
from ..jsonsafe import UnsafeValue, check_json
from .rows import RunRow

__all__ = [
    "compaction_progress",
    "live_runs_and_firing",
    "RunRow",
    "get_run",
    "list_runs",
    "fleet_runs",
    "runs_by_ids",
    "family_runs",
    "comparable_runs",
    "families",
    "families_of",
    "family_of",
    "run_options",
    "run_version",
    "world_size",
    "upsert_run",
    "owner_key_of",
    "finish_run",
    "runs_by_status",
    "running_steps",
    "run_times",
    "ping",
]

_COLS = (
    "id, name, model_family, config, config_signature, world_size, mp_size, device_type, device_count, peak_flops, "
    "git_commit, status, meta, started_at, finished_at, last_seen_at, rank_steps, collective_records, steps, last_step, "
    "thinned, job_id, attempt, owner_key"
)


def _iso(v: dt.datetime | None) -> str | None:
    return v.isoformat() if v is not None else None


def _row(r: Any) -> RunRow:
    m = r._mapping
    return RunRow(
        id=int(m["id"]), name=m["name"], model_family=m["model_family"], config=_readable(m["config"], "config"),
        config_signature=m["config_signature"], world_size=int(m["world_size"]), mp_size=int(m["mp_size"]),
        device_type=m["device_type"], device_count=m["device_count"], peak_flops=m["peak_flops"],
        git_commit=m["git_commit"], status=m["status"], meta=_readable(m["meta"], "meta"), started_at=_iso(m["started_at"]),
        finished_at=_iso(m["finished_at"]), last_seen_at=_iso(m["last_seen_at"]), rank_steps=int(m["rank_steps"]),
        collective_records=int(m["collective_records"]), steps=int(m["steps"]), last_step=m["last_step"],
        thinned=m["thinned"] if isinstance(m.get("thinned"), dict) else None,
        job_id=m.get("job_id"), attempt=int(m.get("attempt") or 0), owner_key=str(m.get("owner_key") or ""),
    )  # fmt: skip


def _readable(v: Any, what: str) -> Any:
    """A stored config/meta as every reader can serialise it; a legacy value that today's checks would
    refuse (too deep, integers past 64 bits) shows as such instead of breaking the page or the API."""
    try:
        check_json(v, what)
    except UnsafeValue as e:
        return {"_unreadable": f"stored {what} not shown: {e.message} (written before the server checked it)"}
    return v


def _select(c: Connection, where: str, params: dict[str, Any], order: str, limit: int) -> list[RunRow]:
    sql = f"SELECT {_COLS} FROM runs {where} ORDER BY {order} LIMIT :limit"
    return [_row(r) for r in c.execute(text(sql), {**params, "limit": limit})]


def _pending_counts(c: Connection, run_ids: list[int]) -> dict[int, tuple[int, int]]:
    """(rank_steps, collectives) landed but not compacted yet, deduplicated, excluding copies already
    in a step block. A collective of a step whose block already holds that rank's collectives is
    taken as a copy (a retry); a genuinely late one is counted once the compactor (≤ 1 s) merges it."""
    out: dict[int, tuple[int, int]] = {}
    if not run_ids:
        return out
    frags = c.execute(
        text("SELECT run_id, rank_steps, collectives FROM ingest_fragments WHERE run_id = ANY(:ids)"), {"ids": run_ids}
    ).fetchall()
    by_run: dict[int, list[Any]] = {}
    for f in frags:
        by_run.setdefault(f[0], []).append(f)
    for run_id, fs in by_run.items():
        s_keys, c_keys = [], []
        for _, rs, cs in fs:
            if rs is not None:
                d = decode_block(FRAG_STEP_FIELDS, rs)
                s_keys.append(d["step"] * (1 << 24) + d["rank"])
            if cs is not None:
                d = decode_block(FRAG_COLL_FIELDS, cs)
                c_keys.append(np.stack([d["step"], d["rank"], d["seq"]], axis=1))
        sk = np.unique(np.concatenate(s_keys)) if s_keys else np.empty(0, dtype=np.int64)
        ck = np.unique(np.concatenate(c_keys), axis=0) if c_keys else np.empty((0, 3), dtype=np.int64)
        steps = np.union1d(sk >> 24, ck[:, 0])
        present: dict[int, tuple[str, int]] = {}
        if len(steps):
            for step, bits, n_coll in c.execute(
                text("SELECT step, ranks::text, coll_records FROM steps WHERE run_id = :r AND step = ANY(:s)"),
                {"r": run_id, "s": steps.tolist()},
            ):
                present[step] = (bits, n_coll)

        n_s = _absent(sk >> 24, sk & 0xFFFFFF, present, need_coll=False)
        n_c = _absent(ck[:, 0], ck[:, 1], present, need_coll=True)
        out[run_id] = (n_s, n_c)
    return out


def _absent(steps: np.ndarray, ranks: np.ndarray, present: dict[int, tuple[str, int]], *, need_coll: bool) -> int:
    """How many (step, rank) keys, sorted by step, are not in their step's block yet (vectorised per step)."""
    n = int(steps.size)
    if not n:
        return 0
    uniq, starts = np.unique(steps, return_index=True)
    ends = np.append(starts[1:], n)
    absent = n
    for step, lo, hi in zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True):
        p = present.get(step)
        if p is None or (need_coll and p[1] == 0):
            continue
        bits = np.frombuffer(p[0].encode("ascii"), dtype=np.uint8) == ord("1")
        r = ranks[lo:hi]
        inside = r < bits.size
        absent -= int(bits[r[inside]].sum())
    return absent


def _with_pending(c: Connection, runs: list[RunRow], only_running: bool) -> list[RunRow]:
    ids = [r.id for r in runs if r.status in ("running", "stalled", "hung") or not only_running]
    pending = _pending_counts(c, ids)
    return [replace(r, pending_rank_steps=pending[r.id][0], pending_collectives=pending[r.id][1])
            if r.id in pending else r for r in runs]


def _snapshot(engine: Engine) -> Connection:
    """A connection whose statements see one snapshot (REPEATABLE READ): a run's counters and its
    not-yet-compacted fragments are read apart, and a compaction committing between the two reads
    would otherwise show the run with neither (0 rank-steps for a moment) or with both. On Citus the
    default isolation is kept (its snapshots are per node)."""
    from .citus import is_citus

    c = engine.connect()
    return c if is_citus(engine) else c.execution_options(isolation_level="REPEATABLE READ")


def get_run(engine: Engine, run_id: int, *, pending: bool = True) -> RunRow | None:
    """One run, with its not-yet-compacted counts unless ``pending=False``; None when there is no such run."""
    with _snapshot(engine) as c:
        rows = _select(c, "WHERE id = :id", {"id": run_id}, "id", 1)
        if not rows:
            return None
        return _with_pending(c, rows, only_running=False)[0] if pending else rows[0]


def list_runs(engine: Engine, *, name: str | None = None, family: str | None = None, status: str | None = None,
              limit: int = 100) -> list[RunRow]:
    """Runs, newest first, optionally by exact name, family or status (running runs with pending counts)."""
    where, params = [], {}
    for col, key, v in (("name", "name", name), ("model_family", "family", family), ("status", "status", status)):
        if v:
            where.append(f"{col} = :{key}")
            params[key] = v
    with _snapshot(engine) as c:
        rows = _select(c, ("WHERE " + " AND ".join(where)) if where else "", params, "started_at DESC, id DESC",
                       max(1, min(limit, 10_000)))
        return _with_pending(c, rows, only_running=True)


def fleet_runs(engine: Engine, *, family: str | None = None, status: str | None = None, q: str | None = None,
               limit: int = 2000) -> list[RunRow]:
    """Runs for the fleet table: hung and stalled ones first, then running ones, then the newest; ``q``
    matches the name (ILIKE)."""
    where, params = [], {}
    if family:
        where.append("model_family = :family")
        params["family"] = family
    if status:
        where.append("status = :status")
        params["status"] = status
    if q:
        where.append("name ILIKE :q")
        params["q"] = f"%{q}%"
    with engine.connect() as c:
        return _select(c, ("WHERE " + " AND ".join(where)) if where else "", params,
                       "(status IN ('hung', 'stalled')) DESC, (status = 'running') DESC, started_at DESC, id DESC", limit)


def runs_by_ids(engine: Engine, run_ids: Sequence[int]) -> dict[int, RunRow]:
    """The runs with these ids that exist, by id."""
    with engine.connect() as c:
        rows = _select(c, "WHERE id = ANY(:ids)", {"ids": [int(i) for i in run_ids]}, "id", max(len(run_ids), 1))
    return {r.id: r for r in rows}


def family_runs(engine: Engine, family: str, *, limit: int = 100_000) -> list[RunRow]:
    """The runs of one model family, newest first."""
    with engine.connect() as c:
        return _select(c, "WHERE model_family = :f", {"f": family}, "started_at DESC, id DESC", limit)


def comparable_runs(engine: Engine, family: str | None, world_size: int, device_type: str | None, *,
                    limit: int = 1000) -> list[RunRow]:
    """Runs of the same family, world size and device type (nulls match nulls), newest first."""
    with engine.connect() as c:
        return _select(
            c, "WHERE model_family IS NOT DISTINCT FROM :f AND world_size = :w AND device_type IS NOT DISTINCT FROM :d",
            {"f": family, "w": world_size, "d": device_type}, "started_at DESC, id DESC", limit)


def families(engine: Engine) -> list[str]:
    """Model families with at least one run, sorted."""
    with engine.connect() as c:
        return [r[0] for r in c.execute(text("SELECT DISTINCT model_family FROM runs WHERE model_family IS NOT NULL ORDER BY 1"))]


def families_of(engine: Engine, run_ids: Sequence[int]) -> list[str]:
    """The model families of these runs."""
    with engine.connect() as c:
        return [r[0] for r in c.execute(
            text("SELECT DISTINCT model_family FROM runs WHERE id = ANY(:ids) AND model_family IS NOT NULL"),
            {"ids": list(run_ids)})]


def family_of(engine: Engine, run_id: int) -> tuple[bool, str | None]:
    """(the run exists, its model family)."""
    with engine.connect() as c:
        row = c.execute(text("SELECT model_family FROM runs WHERE id = :id"), {"id": run_id}).fetchone()
    return (row is not None, row[0] if row is not None else None)


def run_options(engine: Engine, limit: int = 1000) -> list[dict[str, Any]]:
    """(id, name, model_family, world_size, owner_key) of recent runs, for pickers."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT id, name, model_family, world_size, owner_key FROM runs ORDER BY started_at DESC, id DESC "
                 "LIMIT :n"),
            {"n": limit},
        ).fetchall()
    return [dict(r._mapping) for r in rows]


def run_version(engine: Engine, run_id: int) -> tuple[Any, ...] | None:
    """:attr:`RunRow.version` of one run by its primary key (the cheapest freshness check)."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT rank_steps, collective_records, steps, last_step, status FROM runs WHERE id = :id"), {"id": run_id}
        ).fetchone()
    return tuple(row) if row is not None else None


def world_size(engine: Engine, run_id: int) -> int | None:
    """The run's declared world size (ingest validates ranks against it); None for an unknown run."""
    with engine.connect() as c:
        row = c.exec_driver_sql("SELECT world_size FROM runs WHERE id = %(id)s", {"id": run_id}).fetchone()
    return None if row is None else int(row[0])


def running_steps(engine: Engine, run_ids: Sequence[int]) -> dict[int, tuple[str, int]]:
    """{run id: (status, compacted steps)} of these runs (the alert worker's throttle)."""
    with engine.connect() as c:
        return {r[0]: (r[1], int(r[2] or 0)) for r in c.execute(
            text("SELECT id, status, steps FROM runs WHERE id = ANY(:ids)"), {"ids": list(run_ids)})}


def run_times(engine: Engine, run_id: int) -> tuple[float, float | None] | None:
    """(started_at, finished_at) of the run as unix times; None for an unknown run."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT extract(epoch FROM started_at), extract(epoch FROM finished_at) FROM runs WHERE id = :id"),
            {"id": run_id},
        ).fetchone()
    if row is None:
        return None
    return float(row[0]), (float(row[1]) if row[1] is not None else None)


def runs_by_status(engine: Engine) -> list[tuple[str, int, int]]:
    """(status, runs, Σ world size) per status (Prometheus gauges)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT status, count(*), coalesce(sum(world_size), 0) FROM runs GROUP BY status")).fetchall()
    return [(r[0], int(r[1]), int(r[2])) for r in rows]


def ping(engine: Engine) -> None:
    """One round trip to the database (raises when it is unreachable)."""
    with engine.connect() as c:
        c.execute(text("SELECT 1"))


# ---------------------------------------------------------------------------------------------- writes

_INSERT = """
INSERT INTO runs (name, model_family, config, config_signature, world_size, mp_size, device_type,
                  device_count, peak_flops, git_commit, meta, started_at, status, last_seen_at, owner_token_id,
                  owner_key, job_id, attempt)
VALUES (:name, :family, CAST(:config AS jsonb), :sig, :ws, :mp, :dt, :dc, :peak, :git,
        CAST(:meta AS jsonb), to_timestamp(:started), 'running', now(), :owner, :owner_key,
        :job_id, :attempt)
ON CONFLICT (owner_key, name, attempt) DO NOTHING
RETURNING id, name, world_size
"""
#: started now (no start time given); Citus refuses now() inside COALESCE / CASE of a write
_INSERT_NOW = _INSERT.replace("to_timestamp(:started)", "now()")

#: another rank of the same job (the same owner: the same token, a token of the same team, or — in
#: the ownerless namespace '' — a server without auth) joins the run: missing fields are filled in,
#: the world size may grow, meta merges; an ended run is running again only for a process that
#: started after it ended (the same name run again)
_JOIN = """
UPDATE runs SET
    model_family = coalesce(runs.model_family, :family),
    config = CASE WHEN runs.config = '{}'::jsonb THEN CAST(:config AS jsonb) ELSE runs.config END,
    config_signature = CASE WHEN runs.config = '{}'::jsonb THEN :sig ELSE runs.config_signature END,
    world_size = greatest(runs.world_size, :ws),
    device_type = coalesce(runs.device_type, :dt),
    device_count = coalesce(runs.device_count, :dc),
    peak_flops = coalesce(runs.peak_flops, :peak),
    git_commit = coalesce(runs.git_commit, :git),
    meta = CAST(:meta AS jsonb) || runs.meta,
    job_id = coalesce(runs.job_id, :job_id),
    status = CASE WHEN __ENDED__ THEN runs.status ELSE 'running' END,
    finished_at = CASE WHEN __ENDED__ THEN runs.finished_at END,
    last_seen_at = now()
WHERE owner_key = :owner_key AND name = :name AND attempt = :attempt
RETURNING id, name, world_size
"""
#: the run has ended, and this registration is no process started after it ended (no start time, or
#: one at or before the end: a late rank of that run, ``import-trace`` finding its run): it joins the
#: run as it is, ended. Reopening it made the health pass page a finished run "stalled".
#: (to_timestamp(float8) is IMMUTABLE: Citus takes it in a CASE of an UPDATE)
_ENDED = ("(runs.finished_at IS NOT NULL AND (CAST(:started AS float8) IS NULL "
          "OR to_timestamp(CAST(:started AS float8)) <= runs.finished_at))")
_JOIN = _JOIN.replace("__ENDED__", _ENDED)
#: the same, for the run of this job and attempt whatever its name (one job, one run)
_JOIN_ID = _JOIN.replace("WHERE owner_key = :owner_key AND name = :name AND attempt = :attempt", "WHERE id = :id")

_JOB_LOCK_KEY = 727281  # with a hash of (owner, job id, attempt): pg_advisory_xact_lock(key, hash) around its registration
_JOB_LOCK = "SELECT pg_advisory_xact_lock(:k, hashtext(:owner_key || chr(31) || :job_id || chr(31) || CAST(:attempt AS text)))"
#: the run of this (owner, job id, attempt) a registration joins: one the registering process did not
#: start after it ended (a later run of that job id, e.g. another ``init`` in one process, is a run of its own)
_JOB_RUN = """
SELECT id FROM runs
WHERE owner_key = :owner_key AND job_id = :job_id AND attempt = :attempt
  AND (finished_at IS NULL OR CAST(:started AS float8) IS NULL OR finished_at >= to_timestamp(CAST(:started AS float8)))
ORDER BY id DESC LIMIT 1
"""


def upsert_run(engine: Engine, *, name: str, family: str | None, config_json: str, signature: str, world_size: int,
               mp_size: int, device_type: str | None, device_count: int | None, peak_flops: float | None,
               git_commit: str | None, meta_json: str, started_at: float | None, owner_token_id: int | None = None,
               owner_key: str = "", job_id: str | None = None, attempt: int = 0) -> dict[str, Any]:
    """Create the run, or join the one of that name and ``attempt`` in the namespace ``owner_key`` (``runs.owner_key``:
    'team:<team>', 'token:<id>', or '' for no owner). A name is unique per namespace only: an owner
    registering a name that another owner holds gets a run of its own and never touches the other's.

    One job, one run: a registration with a ``job_id`` joins the run of the same (owner, job id, attempt)
    whatever name it was registered under (every node of a job, with no coordination between them),
    unless that run ended before the registering process started (``started_at``); registrations of one
    job are serialised by a transaction-level advisory lock, so concurrent ones from many nodes create
    one run. Another attempt of the job is a run of its own, as before."""
    params = {"name": name, "family": family, "config": config_json, "sig": signature, "ws": world_size,
              "mp": mp_size, "dt": device_type, "dc": device_count, "peak": peak_flops, "git": git_commit,
              "meta": meta_json, "started": started_at, "owner": owner_token_id, "owner_key": owner_key,
              "job_id": job_id, "attempt": attempt}

    def joined(row: Any, created: bool) -> dict[str, Any]:
        return {"id": row.id, "name": row.name, "world_size": row.world_size, "created": created,
                "attempt": attempt, "job_id": job_id}

    with engine.begin() as c:
        if job_id is not None:
            c.execute(text(_JOB_LOCK), {**params, "k": _JOB_LOCK_KEY})
        for _ in range(3):  # the run may be deleted between the statements: then create it again
            if job_id is not None:
                rid = c.execute(text(_JOB_RUN), params).scalar()
                if rid is not None:
                    row = c.execute(text(_JOIN_ID), {**params, "id": rid}).one_or_none()
                    if row is not None:
                        return joined(row, False)
            row = c.execute(text(_INSERT if started_at is not None else _INSERT_NOW), params).one_or_none()
            if row is not None:
                return joined(row, True)
            row = c.execute(text(_JOIN), params).one_or_none()
            if row is not None:
                return joined(row, False)
    raise RuntimeError(f"run {name!r} was deleted while it was being registered; register it again")


def owner_key_of(engine: Engine, run_id: int) -> tuple[bool, str]:
    """(the run exists, its ``owner_key``: 'team:<team>', 'token:<id>', or '' for a run without owner)."""
    with engine.connect() as c:
        row = c.execute(text("SELECT owner_key FROM runs WHERE id = :id"), {"id": run_id}).fetchone()
    return (row is not None, "" if row is None else str(row[0]))


#: every table that holds rows of a run, children first (runs last)
_RUN_TABLES = ("ingest_fragments", "modality_raw", "steps", "run_collectives", "run_modalities", "run_events",
               "run_groups", "run_event_counts", "run_scalars", "run_scalar_names", "run_devices", "run_projections", "run_positions", "run_failures", "run_pauses", "run_health", "run_dims", "step_comm", "phase_raw", "run_phases",
               "trace_summaries", "rank_rollups", "rank_windows", "run_stats", "alerts", "ranks")


def delete_run(engine: Engine, run_id: int) -> dict[str, int] | None:
    """Remove a run and everything that hangs off it in one transaction; rows deleted per table, or None
    when there is no such run."""
    out: dict[str, int] = {}
    with engine.begin() as c:
        if c.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run_id}).fetchone() is None:
            return None
        for t in _RUN_TABLES:
            out[t] = int(c.execute(text(f"DELETE FROM {t} WHERE run_id = :id"), {"id": run_id}).rowcount or 0)
        out["runs"] = int(c.execute(text("DELETE FROM runs WHERE id = :id"), {"id": run_id}).rowcount or 0)
    return out


def finish_run(engine: Engine, run_id: int, status: str, finished_at: float | None) -> bool:
    """Set the run's final status and end time (``finished_at`` unix time, else now); False if no such run."""
    with engine.begin() as c:
        r = c.execute(
            # no COALESCE(…, now()): Citus refuses non-IMMUTABLE functions in COALESCE / CASE of a write
            text("UPDATE runs SET status = :s, finished_at = "
                 + ("to_timestamp(CAST(:at AS float8))" if finished_at is not None else "now()") + " WHERE id = :id"),
            {"s": status, "id": run_id, "at": finished_at},
        )
    return r.rowcount > 0


def compaction_progress(engine: Engine, since: Any) -> tuple[int, list[int], Any]:
    """(landed rank-steps not compacted yet, runs compacted since ``since`` (a database timestamp or
    None), the database's now) — how a server whose compaction runs in worker processes follows it."""
    with engine.connect() as c:
        now = c.execute(text("SELECT now()")).scalar()
        backlog = int(c.execute(text("SELECT coalesce(sum(n_rank_steps), 0) FROM ingest_fragments")).scalar() or 0)
        runs = [] if since is None else [int(r) for (r,) in c.execute(
            # 60 s of overlap: a compaction transaction stamps its start time and may commit later
            text("SELECT id FROM runs WHERE last_seen_at > :t - interval '60 seconds'"), {"t": since}).fetchall()]
    return backlog, runs, now


_LIVE_RUNS = """
SELECT id FROM runs WHERE status = ANY(:states)
ORDER BY last_seen_at DESC NULLS LAST, id DESC LIMIT :n
"""
_FIRING = """
SELECT run_id, kind, count(*) FROM alerts WHERE state = 'firing' AND run_id = ANY(:ids) GROUP BY run_id, kind
"""


def live_runs_and_firing(engine: Engine, states: Sequence[str], cap: int) -> tuple[list[int], list[tuple[int, str, int]]]:
    """The ids of at most ``cap`` runs in ``states``, most recently active first, and their firing
    alerts as (run id, kind, count) — the per-run Prometheus gauges (server/prom.py)."""
    with engine.connect() as c:
        ids = [int(r[0]) for r in c.execute(text(_LIVE_RUNS), {"states": list(states), "n": int(cap)})]
        firing = c.execute(text(_FIRING), {"ids": ids}).fetchall() if ids else []
    return ids, [(int(r[0]), str(r[1]), int(r[2])) for r in firing]
