"""Kernel hotspots: the ``run_kernel_names`` / ``run_kernels`` / ``run_kernel_ranks`` /
``run_kernel_windows`` tables (migrations 0009, 0012) that the agent's ``trace_summary`` events are
folded into, and the reads of the report. Kernel names are stored once per run (``run_kernel_names``,
with their category) and referred to by id.

The fold (``fold_new_windows``) runs when the report is read: under the run's transaction-level
advisory lock it takes the trace windows not folded yet (a bounded chunk at a time), hands them with the
stored state of their ranks to a pure fold (``analysis.kernels.fold_windows``, passed in), writes the
changed rows back and marks the windows folded — one transaction per chunk, so a window is folded
exactly once even with several server processes reading at the same time. The report's reads are
aggregated here (``kernel_totals``: one row per kept name; ``rank_summary``, ``kernel_spread``: over the
ranks in SQL), so what the server loads does not grow with the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine

from ..db import raw_connection

__all__ = ["fold_new_windows", "kernel_totals", "rank_summary", "kernel_spread", "WindowRow", "StoredState"]

_LOCK_KEY = 727276  # with the run id: pg_advisory_xact_lock(key, run_id)

#: (rank, seq, step, data) of one ``trace_summary`` event; data holds only what the fold reads
WindowRow = tuple[int, int, int | None, dict[str, Any]]
#: (rank rows {rank: (windows, steps, kernel µs, first step, last step)},
#:  kernel rows {rank: {name: (category, µs, launches, windows, first µs, last µs)}}, every kept name)
StoredState = tuple[dict[int, tuple[int, int, float, int, int]],
                    dict[int, dict[str, tuple[str, float, int, int, float, float]]], set[str]]
#: what the fold returns: the changed rank rows and kernel rows, same shapes
Fold = Callable[[StoredState, list[WindowRow]], StoredState]

_NEW_WINDOWS = """
SELECT e.rank, e.seq, e.step,
       jsonb_build_object('active_steps', e.data->'active_steps', 'first_step', e.data->'first_step',
                          'summary', jsonb_build_object('top_kernels', e.data->'summary'->'top_kernels',
                                                        'profiler_steps', e.data->'summary'->'profiler_steps'))
FROM run_events e
WHERE e.run_id = %s AND e.kind = 'trace_summary'
  AND NOT EXISTS (SELECT 1 FROM run_kernel_windows w WHERE w.run_id = e.run_id AND w.rank = e.rank AND w.seq = e.seq)
ORDER BY e.rank, e.seq LIMIT %s
"""


def fold_new_windows(engine: Engine, run_id: int, fold: Fold, *, chunk: int = 100, max_chunks: int = 500) -> int:
    """Fold the run's trace windows not folded yet with ``fold``; returns how many were folded (at most
    ``chunk × max_chunks`` per call: the rest waits for the next read)."""
    done = 0
    for _ in range(max_chunks):
        with raw_connection(engine) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCK_KEY, run_id))
            rows = cur.execute(_NEW_WINDOWS, (run_id, chunk)).fetchall()
            if not rows:
                return done
            windows: list[WindowRow] = [(int(r), int(s), st, d if isinstance(d, dict) else {}) for r, s, st, d in rows]
            ranks = sorted({w[0] for w in windows})
            state = _load_state(cur, run_id, ranks)
            new_ranks, new_kernels, _ = fold(state, windows)
            if new_ranks:
                cur.executemany(
                    "INSERT INTO run_kernel_ranks (run_id, rank, windows, steps, kernel_us, first_step, last_step) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id, rank) DO UPDATE SET "
                    "windows = excluded.windows, steps = excluded.steps, kernel_us = excluded.kernel_us, "
                    "first_step = excluded.first_step, last_step = excluded.last_step",
                    [(run_id, r, *v) for r, v in new_ranks.items()],
                )
            ids = _name_ids(cur, run_id, {n: v[0] for ks in new_kernels.values() for n, v in ks.items()})
            krows = [(run_id, r, ids[name], *v[1:]) for r, ks in new_kernels.items() for name, v in ks.items()]
            if krows:
                cur.executemany(
                    "INSERT INTO run_kernels (run_id, rank, name_id, time_us, launches, windows, first_us, last_us) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id, rank, name_id) DO UPDATE SET "
                    "time_us = excluded.time_us, launches = excluded.launches, "
                    "windows = excluded.windows, first_us = excluded.first_us, last_us = excluded.last_us",
                    krows,
                )
            cur.executemany("INSERT INTO run_kernel_windows (run_id, rank, seq) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                            [(run_id, w[0], w[1]) for w in windows])
            done += len(windows)
            if len(rows) < chunk:
                return done
    return done


def _name_ids(cur: Any, run_id: int, names: dict[str, str]) -> dict[str, int]:
    """{name: id} of these names (with their categories), adding the ones the run does not have yet
    (under the fold's lock: ids are the next free ones)."""
    have = {n: int(i) for i, n in cur.execute(
        "SELECT id, name FROM run_kernel_names WHERE run_id = %s AND name = ANY(%s)", (run_id, list(names))).fetchall()}
    new = [n for n in names if n not in have]
    if new:
        nxt = int(cur.execute("SELECT coalesce(max(id), 0) + 1 FROM run_kernel_names WHERE run_id = %s",
                              (run_id,)).fetchone()[0])
        rows = [(run_id, nxt + i, n, names[n]) for i, n in enumerate(new)]
        cur.executemany("INSERT INTO run_kernel_names (run_id, id, name, category) VALUES (%s, %s, %s, %s)", rows)
        have.update({n: i for _, i, n, _ in rows})
    return have


def _load_state(cur: Any, run_id: int, ranks: Sequence[int]) -> StoredState:
    rank_rows = {int(r): (int(w), int(s), float(us), int(f), int(la)) for r, w, s, us, f, la in cur.execute(
        "SELECT rank, windows, steps, kernel_us, first_step, last_step FROM run_kernel_ranks "
        "WHERE run_id = %s AND rank = ANY(%s)", (run_id, list(ranks))).fetchall()}
    kernels: dict[int, dict[str, tuple[str, float, int, int, float, float]]] = {}
    for r, name, cat, us, n, w, f_us, l_us in cur.execute(
            "SELECT k.rank, n.name, n.category, k.time_us, k.launches, k.windows, k.first_us, k.last_us "
            "FROM run_kernels k JOIN run_kernel_names n ON n.run_id = k.run_id AND n.id = k.name_id "
            "WHERE k.run_id = %s AND k.rank = ANY(%s)", (run_id, list(ranks))).fetchall():
        kernels.setdefault(int(r), {})[name] = (cat, float(us), int(n), int(w), float(f_us), float(l_us))
    names = {n for (n,) in cur.execute("SELECT name FROM run_kernel_names WHERE run_id = %s", (run_id,)).fetchall()}
    return rank_rows, kernels, names


def kernel_totals(engine: Engine, run_id: int) -> list[tuple[str, str, float, int]]:
    """(name, category, µs, launches) of every kept kernel name, summed over ranks."""
    with raw_connection(engine) as conn, conn.cursor() as cur:
        return [(n, c, float(us), int(k)) for n, c, us, k in cur.execute(
            "SELECT n.name, n.category, sum(k.time_us), sum(k.launches) FROM run_kernels k JOIN run_kernel_names n "
            "ON n.run_id = k.run_id AND n.id = k.name_id WHERE k.run_id = %s GROUP BY n.name, n.category",
            (run_id,)).fetchall()]


def rank_summary(engine: Engine, run_id: int) -> tuple[int, int, int, int | None, int | None, int]:
    """(ranks with folded windows, windows, profiled rank-steps, first window step, last window step, ranks
    with ≥ 2 windows), aggregated in the database whatever the ranks."""
    with raw_connection(engine) as conn, conn.cursor() as cur:
        row = cur.execute(
            "SELECT count(*), coalesce(sum(windows), 0), coalesce(sum(steps), 0), min(first_step), max(last_step), "
            "count(*) FILTER (WHERE windows >= 2) FROM run_kernel_ranks WHERE run_id = %s", (run_id,)).fetchone()
    n, w, s, f, la, m = row if row is not None else (0, 0, 0, None, None, 0)
    return int(n), int(w), int(s), None if f is None else int(f), None if la is None else int(la), int(m)


_SPREAD = """
WITH rk AS (SELECT rank, steps, windows >= 2 AS multi FROM run_kernel_ranks WHERE run_id = %(r)s),
nm AS (SELECT n.id, n.name FROM unnest(%(names)s::text[]) AS u(name)
       JOIN run_kernel_names n ON n.run_id = %(r)s AND n.name = u.name),
v AS (SELECT nm.name, rk.rank, rk.multi,
             CASE WHEN rk.steps > 0 THEN coalesce(k.time_us, 0) / rk.steps ELSE 0 END AS per_step,
             coalesce(k.first_us, 0) AS f, coalesce(k.last_us, 0) AS l
      FROM nm CROSS JOIN rk
      LEFT JOIN run_kernels k ON k.run_id = %(r)s AND k.rank = rk.rank AND k.name_id = nm.id)
SELECT name, min(per_step), percentile_cont(0.5) WITHIN GROUP (ORDER BY per_step), max(per_step),
       (array_agg(rank ORDER BY per_step DESC, rank))[1],
       percentile_cont(0.5) WITHIN GROUP (ORDER BY f) FILTER (WHERE multi),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY l) FILTER (WHERE multi)
FROM v GROUP BY name
"""


def kernel_spread(engine: Engine, run_id: int,
                  names: Sequence[str]) -> dict[str, tuple[float, float, float, int, float | None, float | None]]:
    """{name: (min, median, max of the rank's µs per profiled step over the ranks with windows — 0 where the
    kernel did not appear —, the lowest rank with the max, median µs per step in the first and in the last
    window over the ranks with ≥ 2 windows (None: none))} of these kernels: one row per name, computed in
    the database (never one row per rank and kernel in the server)."""
    if not names:
        return {}
    with raw_connection(engine) as conn, conn.cursor() as cur:
        rows = cur.execute(_SPREAD, {"r": run_id, "names": list(names)}).fetchall()
    return {str(n): (float(lo), float(med), float(hi), int(r), None if f is None else float(f),
                     None if la is None else float(la)) for n, lo, med, hi, r, f, la in rows}
