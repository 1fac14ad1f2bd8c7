"""The compactor's transaction: read landed fragments, write ``steps`` rows (binary COPY + upsert),
``run_collectives`` and run counters, fold modality tokens, rewrite what is not ready, and the
per-rank straggler rollups (:class:`RollupWriter`). The compactor (``server/compactor.py``) decides
what is ready and computes every rollup; these functions only move rows."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from sqlalchemy import Engine

from ..db import raw_connection

__all__ = [
    "transaction",
    "try_lock",
    "read_fragments",
    "run_info",
    "existing_blocks",
    "delete_fragments",
    "insert_fragments",
    "take_modalities",
    "modality_ranks",
    "upsert_modalities",
    "upsert_rank_modalities",
    "STEP_COLUMNS",
    "write_steps",
    "upsert_run_collectives",
    "upsert_step_comm",
    "bump_run_counters",
    "backlog_rows",
    "PARTITIONS",
    "pending_partitions",
    "RollupWriter",
]

_LOCK_KEY = 727275

#: the columns of one ``steps`` row, in the order :func:`write_steps` takes them
STEP_COLUMNS = (
    "run_id", "step", "n_ranks", "ts", "step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "comm_total_s",
    "forward_s", "backward_s", "optimizer_s", "step_s_max", "work_s", "work_s_max", "slowest_rank", "tokens",
    "padded_tokens", "samples", "flops", "mem_peak_bytes", "mem_reserved_bytes", "alloc_retries", "neg_residual",
    "coll_records", "ranks", "block", "coll_block", "hw_flops",
)  # fmt: skip
_STEP_COPY_TYPES = ["int4", "int4", "int4", *(["float8"] * 13), "int4", *(["float8"] * 7), "int4", "int4",
                    "text", "bytea", "bytea", "float8"]  # fmt: skip


@contextmanager
def transaction(engine: Engine) -> Iterator[Any]:
    """A psycopg cursor in one transaction, committed when the block succeeds."""
    with raw_connection(engine) as conn, conn.cursor() as cur:
        yield cur


PARTITIONS = 64
"""Compaction work is partitioned by run: partition = run_id % PARTITIONS. A compactor holds the
partition's transaction-level advisory lock while it folds that partition's fragments, so any number
of compactors (threads, processes, server instances on one database) work on different runs in
parallel and never on the same run at once. A constant, not a setting: every instance must agree."""


def try_lock(cur: Any, part: int, *, wait: bool = False) -> bool:
    """The partition's transaction-level advisory lock (``wait``: block until it is free)."""
    if wait:
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_KEY, part))
        return True
    got = cur.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (_LOCK_KEY, part)).fetchone()
    return bool(got and got[0])


def pending_partitions(cur: Any, scan: int = 2000) -> list[int]:
    """Partitions with landed fragments among the ``scan`` oldest, oldest first."""
    rows = cur.execute(
        "SELECT run_id %% %s, min(id) FROM (SELECT id, run_id FROM ingest_fragments ORDER BY id LIMIT %s) f "
        "GROUP BY 1 ORDER BY 2",
        (PARTITIONS, scan),
    ).fetchall()
    parts = [int(p) for p, _ in rows]
    # landed modality tokens and phase times of runs with no fragment left (a late rank's tokens)
    for (p,) in cur.execute(
        "SELECT DISTINCT run_id %% %s FROM (SELECT run_id FROM modality_raw LIMIT %s) m "
        "UNION SELECT DISTINCT run_id %% %s FROM (SELECT run_id FROM phase_raw LIMIT %s) q",
        (PARTITIONS, scan, PARTITIONS, scan),
    ).fetchall():
        if int(p) not in parts:
            parts.append(int(p))
    return parts


def read_fragments(cur: Any, limit: int, part: int | None = None) -> list[tuple[Any, ...]]:
    """The oldest fragments (of one partition): (id, run_id, age s, received_at, records, rank-step
    block, collective block)."""
    where = "" if part is None else f"WHERE run_id %% {PARTITIONS} = %s "
    args: tuple[Any, ...] = (limit,) if part is None else (int(part), limit)
    return cur.execute(
        "SELECT id, run_id, extract(epoch FROM now() - received_at)::float8, received_at, "
        f"n_rank_steps + n_collectives, rank_steps, collectives FROM ingest_fragments {where}ORDER BY id LIMIT %s",
        args,
        binary=True,  # the blocks come as bytes, not hex text to decode
    ).fetchall()


def run_info(cur: Any, run_ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    """{run id: (world size, status)}."""
    return {r: (ws, st) for r, ws, st in cur.execute(
        "SELECT id, world_size, status FROM runs WHERE id = ANY(%s)", (list(run_ids),)).fetchall()}


def existing_blocks(cur: Any, run_ids: Sequence[int], steps: Sequence[int]) -> list[tuple[int, int, bytes, bytes | None]]:
    """(run_id, step, block, coll_block) of the (run, step) pairs that already have a ``steps`` row."""
    return cur.execute(
        "SELECT s.run_id, s.step, s.block, s.coll_block FROM steps s JOIN unnest(%s::int[], %s::int[]) "
        "AS k(run_id, step) ON s.run_id = k.run_id AND s.step = k.step",
        (list(run_ids), list(steps)),
        binary=True,
    ).fetchall()


def delete_fragments(cur: Any, ids: Sequence[int]) -> None:
    cur.execute("DELETE FROM ingest_fragments WHERE id = ANY(%s)", (list(ids),))


def insert_fragments(cur: Any, rows: Sequence[tuple[Any, ...]]) -> None:
    """Rewrite (run_id, received_at, n_rank_steps, n_collectives, step_min, step_max, blocks…) rows."""
    if rows:
        cur.executemany(
            "INSERT INTO ingest_fragments (run_id, received_at, n_rank_steps, n_collectives, step_min, step_max, "
            "rank_steps, collectives) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            rows,
        )


#: per-step additive rollups of a landing queue: raw table, its name and value columns, rollup table
_FOLDED = {
    "modality": ("modality_raw", "modality", "tokens", "run_modalities", "int[]"),
    "phase": ("phase_raw", "phase", "seconds", "run_phases", "float8[]"),
}


def take_modalities(cur: Any, *, force: bool, grace_s: float, run_ids: Sequence[int],
                    steps: Sequence[int], kind: str = "modality", part: int | None = None) -> list[tuple[int, int, int, str, Any]]:
    """Delete and return (run_id, step, rank, name, value) landed rows that are ready: all with
    ``force``, those older than the grace period, and those of the given (run, step) pairs — of the
    runs of partition ``part`` (None: all). ``kind``: "modality" (tokens per modality) or "phase"."""
    raw, name, value, _, _ = _FOLDED[kind]
    in_part = "" if part is None else f"t.run_id %% {PARTITIONS} = {int(part)} AND "
    return cur.execute(
        f"DELETE FROM {raw} t WHERE {in_part}(%s OR t.received_at < now() - make_interval(secs => %s) "
        "OR (t.run_id, t.step) IN (SELECT * FROM unnest(%s::int[], %s::int[]))) "
        f"RETURNING t.run_id, t.step, t.rank, t.{name}, t.{value}",
        (force, float(grace_s), list(run_ids), list(steps)),
    ).fetchall()


def modality_ranks(cur: Any, keys: Sequence[tuple[int, int, str]], kind: str = "modality") -> dict[tuple[int, int, str], str]:
    """{(run, step, name): bit string of the ranks already summed} for the stored keys."""
    _, name, _, table, _ = _FOLDED[kind]
    return {(r, s, m): bits for r, s, m, bits in cur.execute(
        f"SELECT run_id, step, {name}, ranks::text FROM {table} WHERE (run_id, step, {name}) IN "
        "(SELECT * FROM unnest(%s::int[], %s::int[], %s::text[]))",
        ([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]),
    ).fetchall()}


def upsert_modalities(cur: Any, rows: Sequence[tuple[int, int, str, Any, str]], kind: str = "modality") -> None:
    """Add (run_id, step, name, value, ranks bit string) to ``run_modalities`` / ``run_phases``."""
    _, name, value, table, _ = _FOLDED[kind]
    cur.executemany(
        f"INSERT INTO {table} (run_id, step, {name}, {value}, ranks) VALUES (%s, %s, %s, %s, %s::varbit) "
        f"ON CONFLICT (run_id, step, {name}) DO UPDATE SET {value} = {table}.{value} + excluded.{value}, "
        "ranks = excluded.ranks",
        rows,
    )


def upsert_rank_modalities(cur: Any, rows: Sequence[tuple[int, int, str, int, int]]) -> None:
    """Add (run_id, rank, modality, tokens, steps) to ``run_rank_modalities``."""
    cur.executemany(
        "INSERT INTO run_rank_modalities (run_id, rank, modality, tokens, steps) VALUES (%s, %s, %s, %s, %s) "
        "ON CONFLICT (run_id, rank, modality) DO UPDATE SET tokens = run_rank_modalities.tokens + excluded.tokens, "
        "steps = run_rank_modalities.steps + excluded.steps",
        rows,
    )


def _step_copy_row(row: tuple[Any, ...]) -> bytes:
    """One ``steps`` row in PostgreSQL's binary COPY format (``_STEP_COPY_TYPES``; ``ranks`` as
    ``varbit``: its bit count, then the bits packed most significant first)."""
    out = [_N_STEP_COLS]
    for v, t in zip(row, _STEP_COPY_TYPES, strict=True):
        if v is None:
            out.append(_NULL)
        elif t == "int4":
            out.append(_INT4.pack(4, v))
        elif t == "float8":
            out.append(_FLOAT8.pack(8, v))
        elif t == "bytea":
            out.append(_LEN.pack(len(v)) + v)
        else:  # the ranks bit string
            packed = np.packbits(np.frombuffer(v.encode(), dtype=np.uint8) - 48).tobytes()
            out.append(_LEN.pack(4 + len(packed)) + _LEN.pack(len(v)) + packed)
    return b"".join(out)


_LEN, _INT4, _FLOAT8 = struct.Struct(">i"), struct.Struct(">ii"), struct.Struct(">id")
_NULL = _LEN.pack(-1)
_N_STEP_COLS = struct.pack(">h", len(STEP_COLUMNS))


def write_steps(cur: Any, rows: Iterable[tuple[Any, ...]], *, fresh: bool = False) -> None:
    """Upsert ``steps`` rows (``STEP_COLUMNS`` order; ``ranks`` as a bit string) via a binary COPY.
    ``fresh``: none of the rows' steps has a row yet (the compactor read that under the run's
    partition lock), so they are copied straight into ``steps`` — no staging table, no upsert. Were
    one there after all, the COPY fails, the pass rolls back, and the next pass finds the row and
    upserts."""
    cols = ", ".join(STEP_COLUMNS)
    if fresh:
        with cur.copy(f"COPY steps ({cols}) FROM STDIN (FORMAT BINARY)") as cp:
            cp.write(_PG_COPY_HEADER)
            for row in rows:
                cp.write(_step_copy_row(row))
            cp.write(b"\xff\xff")
        return
    cur.execute(
        f"CREATE TEMP TABLE _new_steps ON COMMIT DROP AS SELECT {cols.replace(', ranks,', ', ranks::text AS ranks,')} "
        "FROM steps LIMIT 0"
    )
    with cur.copy(f"COPY _new_steps ({cols}) FROM STDIN (FORMAT BINARY)") as cp:
        cp.set_types(_STEP_COPY_TYPES)
        for row in rows:
            cp.write_row(row)
    upd = ", ".join(f"{c} = excluded.{c}" for c in STEP_COLUMNS[2:])
    sel = cols.replace(", ranks,", ", ranks::varbit,")
    cur.execute(f"INSERT INTO steps ({cols}) SELECT {sel} FROM _new_steps ON CONFLICT (run_id, step) DO UPDATE SET {upd}")
    cur.execute("DROP TABLE _new_steps")


def upsert_step_comm(cur: Any, rows: Sequence[tuple[int, int, int, float, float, float, float]]) -> None:
    """Set (run_id, step, dim, calls, bytes, total_s, exposed_s) in ``step_comm`` (computed over all
    of the step's rows, so a recompacted step replaces its values)."""
    if not rows:
        return
    cols = [list(c) for c in zip(*rows, strict=True)]  # one statement over arrays, not one per row
    cur.execute(
        "INSERT INTO step_comm (run_id, step, dim, calls, bytes, total_s, exposed_s) "
        "SELECT * FROM unnest(%s::int[], %s::int[], %s::int[], %s::float8[], %s::float8[], %s::float8[], %s::float8[]) "
        "ON CONFLICT (run_id, step, dim) DO UPDATE SET calls = excluded.calls, bytes = excluded.bytes, "
        "total_s = excluded.total_s, exposed_s = excluded.exposed_s",
        cols,
    )


def upsert_run_collectives(cur: Any, rows: Sequence[tuple[int, int, int, int, int, int, int, float, float, float]]) -> None:
    """Add (run_id, op, group_size, size_bucket, dim, records, calls, bytes, total_s, exposed_s) to ``run_collectives``."""
    cur.executemany(
        "INSERT INTO run_collectives (run_id, op, group_size, size_bucket, dim, records, calls, bytes, total_s, exposed_s) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id, op, group_size, size_bucket, dim) DO UPDATE SET "
        "records = run_collectives.records + excluded.records, calls = run_collectives.calls + excluded.calls, "
        "bytes = run_collectives.bytes + excluded.bytes, total_s = run_collectives.total_s + excluded.total_s, "
        "exposed_s = run_collectives.exposed_s + excluded.exposed_s",
        rows,
    )


def bump_run_counters(cur: Any, rows: Sequence[tuple[int, int, int, int, int]]) -> None:
    """Add (new rank-steps, new collectives, new steps, last step, run id) to the runs' counters."""
    cur.executemany(
        "UPDATE runs SET rank_steps = rank_steps + %s, collective_records = collective_records + %s, "
        "steps = steps + %s, last_step = greatest(last_step, %s), last_seen_at = now() WHERE id = %s",
        rows,
    )


def backlog_rows(cur: Any) -> int:
    """Landed rank-steps not compacted yet."""
    return int(cur.execute("SELECT coalesce(sum(n_rank_steps), 0) FROM ingest_fragments").fetchone()[0])


# ------------------------------------------------------------------------------ straggler rollups

_PG_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_INT_SUMS = {"steps", "above", "slowest_steps", "late_n", "last_arrivals"}


def _copy_payload(cols: list[tuple[str, str, np.ndarray]]) -> bytes:
    """A binary COPY payload of fixed-width columns: (name, 'i4' | 'i8' | 'f8' | 'V<k>' bytea, values)."""
    n = len(cols[0][2])
    fields: list[tuple[str, str]] = [("_n", ">i2")]
    for name, kind, _ in cols:
        fields += [(f"_l_{name}", ">i4"), (name, kind if kind.startswith("V") else ">" + kind)]
    arr = np.empty(n, dtype=np.dtype(fields))
    arr["_n"] = len(cols)
    for name, kind, values in cols:
        arr[f"_l_{name}"] = int(kind[1:]) if kind.startswith("V") else np.dtype(">" + kind).itemsize
        arr[name] = values
    return _PG_COPY_HEADER + arr.tobytes() + b"\xff\xff"


def _sum_cols(sums: dict[str, np.ndarray]) -> list[tuple[str, str, np.ndarray]]:
    return [(c, "i4", np.rint(v).astype(np.int64)) if c in _INT_SUMS else (c, "f8", v) for c, v in sums.items()]


class RollupWriter:
    """Reads and writes ``rank_rollups`` / ``rank_windows`` on the compaction cursor (the sink of
    ``analysis.rollups.fold_rank_rollups``): histograms are merged by the caller, sums are added by
    the upserts."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested transaction: what fails inside is rolled back, the compaction goes on."""
        with self.cur.connection.transaction():
            yield

    def rank_hists(self, run_id: int, ranks: Sequence[int]) -> list[tuple[int, bytes]]:
        """(rank, histogram bytes, int32 little-endian) already stored for these ranks."""
        return [(int(r), bytes(b)) for r, b in self.cur.execute(
            "SELECT rank, hist FROM rank_rollups WHERE run_id = %s AND rank = ANY(%s) AND hist IS NOT NULL",
            (int(run_id), list(ranks)),
        ).fetchall()]

    def add_rank_rollups(self, keys: np.ndarray, hist: np.ndarray, slowdown: np.ndarray,
                         sums: dict[str, np.ndarray]) -> None:
        """Upsert rows keyed (run_id, rank) = ``keys``: replace ``hist``/``slowdown``, add ``sums``."""
        nb = hist.shape[1]
        hv = np.ascontiguousarray(hist.astype("<i4")).view(np.dtype((np.void, nb * 4))).reshape(-1)
        cols = [("run_id", "i4", keys[:, 0]), ("rank", "i4", keys[:, 1]), ("hist", f"V{nb * 4}", hv),
                ("slowdown", "f8", slowdown), *_sum_cols(sums)]
        upd = ", ".join(f"{c} = rank_rollups.{c} + excluded.{c}" for c in sums)
        self._upsert("rank_rollups", "_rr", cols, "run_id, rank",
                     f"hist = excluded.hist, slowdown = excluded.slowdown, {upd}")

    def add_rank_windows(self, keys: np.ndarray, sums: dict[str, np.ndarray]) -> None:
        """Upsert rows keyed (run_id, win, rank) = ``keys``, adding ``sums``."""
        cols = [("run_id", "i4", keys[:, 0]), ("win", "i4", keys[:, 1]), ("rank", "i4", keys[:, 2]), *_sum_cols(sums)]
        self._upsert("rank_windows", "_rw", cols, "run_id, win, rank",
                     ", ".join(f"{c} = rank_windows.{c} + excluded.{c}" for c in sums))

    def _upsert(self, table: str, tmp: str, cols: list[tuple[str, str, np.ndarray]], key: str, update: str) -> None:
        names = ", ".join(c for c, _, _ in cols)
        cur = self.cur
        cur.execute(f"CREATE TEMP TABLE {tmp} ON COMMIT DROP AS SELECT {names} FROM {table} LIMIT 0")
        with cur.copy(f"COPY {tmp} ({names}) FROM STDIN (FORMAT BINARY)") as cp:
            cp.write(_copy_payload(cols))
        cur.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {tmp} ON CONFLICT ({key}) DO UPDATE SET {update}")
        cur.execute(f"DROP TABLE {tmp}")
