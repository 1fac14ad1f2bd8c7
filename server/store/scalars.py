"""Training scalars (``run.log``): ``run_scalar_names`` and ``run_scalars`` — written at ingest from the
``scalars`` events (:func:`land_scalars`, called by ``events.land_events`` under the run's event lock)
and read per run (:func:`run_scalars`, :func:`scalar_names`) and across runs (:func:`scalar_figures`).

Bounds (``server/limits.py``): at most MAX_SCALAR_NAMES_PER_RUN names per run, at most
MAX_SCALAR_POINTS_PER_RUN points (name, step, rank) per run; beyond them points are dropped and counted
in ``run_event_counts`` kind ``scalars`` (``stored`` = points kept). One value per (name, step, rank):
the first one (a re-sent batch stores nothing twice). Each name's summary — the value at the highest
step (lowest rank there) and the minimum — is kept in ``run_scalar_names`` as points land, so run
filters and sorts by ``scalar.NAME.last`` / ``.min`` join one row per run. Reads return at most MAX_SCALAR_READ_POINTS
points per name (min/max downsampling: spikes survive).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from ..downsample import minmax_series
from ..limits import MAX_SCALAR_NAMES_PER_RUN, MAX_SCALAR_POINTS_PER_RUN, MAX_SCALAR_READ_POINTS

__all__ = ["land_scalars", "run_scalars", "scalar_names", "scalar_figures", "SCALARS_KIND", "DEFAULT_MAX_POINTS"]

SCALARS_KIND = "scalars"
DEFAULT_MAX_POINTS = 2_000


def land_scalars(cur: Any, run_id: int, events: Sequence[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """Store the points of these ``scalars`` events (call under the run's event lock, within the batch's
    transaction). Returns (events with a point kept or already stored, {"scalars": points dropped})."""
    points: dict[tuple[str, int, int], tuple[float, int]] = {}
    for i, e in enumerate(events):
        step, rank = int(e["step"]), int(e["rank"])
        for name, v in e["data"].items():
            points.setdefault((name, step, rank), (float(v), i))
    if not points:
        return 0, {}
    known = {str(n) for (n,) in cur.execute(
        "SELECT name FROM run_scalar_names WHERE run_id = %s LIMIT %s", (run_id, MAX_SCALAR_NAMES_PER_RUN)).fetchall()}
    new_names: list[str] = []
    for name, _s, _r in points:
        if name not in known and len(known) < MAX_SCALAR_NAMES_PER_RUN:
            known.add(name)
            new_names.append(name)
    if new_names:
        cur.execute("INSERT INTO run_scalar_names (run_id, name) SELECT %s, unnest(%s::text[]) ON CONFLICT DO NOTHING",
                    (run_id, new_names))
    row = cur.execute("SELECT stored FROM run_event_counts WHERE run_id = %s AND kind = %s",
                      (run_id, SCALARS_KIND)).fetchone()
    room = max(MAX_SCALAR_POINTS_PER_RUN - (int(row[0]) if row else 0), 0)
    keep: list[tuple[str, int, int, float]] = []
    kept_events: set[int] = set()
    dropped = 0
    for (name, step, rank), (v, i) in points.items():
        if name in known and len(keep) < room:
            keep.append((name, step, rank, v))
            kept_events.add(i)
        else:
            dropped += 1
    stored = 0
    if keep:
        cur.execute(
            "INSERT INTO run_scalars (run_id, name, step, rank, value) "
            "SELECT %s, * FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::float8[]) "
            "ON CONFLICT DO NOTHING RETURNING name, step, rank, value",
            (run_id, [k[0] for k in keep], [k[1] for k in keep], [k[2] for k in keep], [k[3] for k in keep]))
        inserted = cur.fetchall()
        stored = len(inserted)
        _update_summary(cur, run_id, inserted)
    if stored or dropped:
        cur.execute(
            "INSERT INTO run_event_counts (run_id, kind, stored, dropped) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (run_id, kind) DO UPDATE SET stored = run_event_counts.stored + excluded.stored, "
            "dropped = run_event_counts.dropped + excluded.dropped",
            (run_id, SCALARS_KIND, stored, dropped))
    return len(kept_events), ({SCALARS_KIND: dropped} if dropped else {})


def _update_summary(cur: Any, run_id: int, points: Sequence[Any]) -> None:
    """Fold newly stored points into their names' summary: the value at the highest step (lowest rank
    there) and the minimum. Under the run's event lock, like every write of the run's scalars."""
    best: dict[str, tuple[int, int, float, float]] = {}  # name -> (step, rank, value at it, min)
    for name, step, rank, value in points:
        b = best.get(name)
        step, rank, value = int(step), int(rank), float(value)
        if b is None:
            best[name] = (step, rank, value, value)
        else:
            last = (step, rank, value) if (step, -rank) > (b[0], -b[1]) else b[:3]
            best[name] = (*last, min(b[3], value))
    if not best:
        return
    names = list(best)
    cur.execute(
        "UPDATE run_scalar_names t SET "
        "last_value = CASE WHEN t.last_step IS NULL OR u.step > t.last_step OR (u.step = t.last_step AND u.rank < t.last_rank) "
        "THEN u.value ELSE t.last_value END, "
        "last_rank = CASE WHEN t.last_step IS NULL OR u.step > t.last_step OR (u.step = t.last_step AND u.rank < t.last_rank) "
        "THEN u.rank ELSE t.last_rank END, "
        "last_step = CASE WHEN t.last_step IS NULL OR u.step >= t.last_step THEN u.step ELSE t.last_step END, "
        "min_value = least(t.min_value, u.lo) "
        "FROM unnest(%s::text[], %s::bigint[], %s::int[], %s::float8[], %s::float8[]) AS u(name, step, rank, value, lo) "
        "WHERE t.run_id = %s AND t.name = u.name",
        (names, [best[n][0] for n in names], [best[n][1] for n in names], [best[n][2] for n in names],
         [best[n][3] for n in names], run_id))


def scalar_names(engine: Engine, run_id: int) -> list[str]:
    """The run's scalar names, sorted (at most MAX_SCALAR_NAMES_PER_RUN)."""
    with engine.connect() as c:
        return [str(n) for (n,) in c.execute(
            text("SELECT name FROM run_scalar_names WHERE run_id = :id ORDER BY name LIMIT :n"),
            {"id": run_id, "n": MAX_SCALAR_NAMES_PER_RUN})]


def run_scalars(engine: Engine, run_id: int, names: Sequence[str] | None = None,
                max_points: int = DEFAULT_MAX_POINTS) -> dict[str, dict[str, Any]]:
    """{name: {"step": [...], "value": [...], "points": n stored steps, "reduced": bool}} of these names
    (None: every name), in step order; per step the lowest reporting rank's value (rank 0 when it
    logs); at most ``max_points`` (≤ MAX_SCALAR_READ_POINTS) per name, min/max-downsampled."""
    cap = max(2, min(int(max_points), MAX_SCALAR_READ_POINTS))
    with engine.connect() as c:
        if names is None:
            wanted = [str(n) for (n,) in c.execute(
                text("SELECT name FROM run_scalar_names WHERE run_id = :id ORDER BY name LIMIT :n"),
                {"id": run_id, "n": MAX_SCALAR_NAMES_PER_RUN})]
        else:
            wanted = list(dict.fromkeys(names))[:MAX_SCALAR_NAMES_PER_RUN]
        rows = c.execute(
            text("SELECT DISTINCT ON (name, step) name, step, value FROM run_scalars "
                 "WHERE run_id = :id AND name = ANY(:names) ORDER BY name, step, rank"),
            {"id": run_id, "names": wanted},
        ).fetchall() if wanted else []
    by: dict[str, tuple[list[int], list[float]]] = {}
    for name, step, value in rows:
        s, v = by.setdefault(name, ([], []))
        s.append(int(step))
        v.append(float(value))
    out: dict[str, dict[str, Any]] = {}
    for name in wanted:
        if name not in by:
            continue
        s, v = by[name]
        if len(s) > cap:
            red = minmax_series(np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64), cap)
            out[name] = {"step": [int(x) for x in red.x], "value": [float(y) for y in red.y], "points": len(s),
                         "reduced": True}
        else:
            out[name] = {"step": s, "value": v, "points": len(s), "reduced": False}
    return out


def scalar_figures(engine: Engine, run_ids: Sequence[int], names: Sequence[str]) -> dict[int, dict[str, dict[str, float]]]:
    """{run id: {name: {"last": value at the last step, "min": smallest}}} of these runs' scalars (the
    summary kept at ingest: per run and name, the lowest rank's value at the highest step, the minimum
    over every rank)."""
    if not run_ids or not names:
        return {}
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT run_id, name, min_value, last_value FROM run_scalar_names "
                 "WHERE run_id = ANY(:ids) AND name = ANY(:names) AND last_step IS NOT NULL"),
            {"ids": [int(i) for i in run_ids], "names": list(names)[:MAX_SCALAR_NAMES_PER_RUN]},
        ).fetchall()
    out: dict[int, dict[str, dict[str, float]]] = {}
    for rid, name, lo, last in rows:
        out.setdefault(int(rid), {})[str(name)] = {"min": float(lo), "last": float(last)}
    return out
