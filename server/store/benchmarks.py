"""Benchmark series (``fleetscope bench``): ``benchmark_series`` keyed by (name, cluster, params) and
their ``benchmark_points`` over time."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["PointWrite", "SeriesRow", "record_points", "series", "series_with_points", "points"]


@dataclass(frozen=True)
class PointWrite:
    name: str
    params: dict[str, Any]
    unit: str
    value: float
    ts: dt.datetime
    git_commit: str | None


@dataclass(frozen=True)
class SeriesRow:
    id: int
    name: str
    cluster: str
    params: dict[str, Any] | None
    unit: str


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)[:256]


_CHUNK = 1000  # rows per multi-row INSERT (5 parameters a series row: under Postgres' 65,535)


def record_points(engine: Engine, cluster: str, pts: Sequence[PointWrite], *, owner_key: str = "") -> list[int]:
    """Upsert each point's series and the point itself (one per series and time) in one transaction;
    returns the series id of each point. A series keeps the params it was created with and the unit of
    its last point here; a point sent twice in the batch keeps the last value. Multi-row statements,
    not two per point: on Citus both tables are reference tables, each statement a round trip to every
    node (10,000 points one by one took minutes there). A series belongs to the namespace that records
    it (``owner_key``, migration 0018): another namespace's points for the same name and cluster go to a
    series of its own."""
    keys = [(p.name, _params_key(p.params)) for p in pts]
    first: dict[tuple[str, str], PointWrite] = {}
    unit: dict[tuple[str, str], str] = {}
    for k, p in zip(keys, pts, strict=True):
        first.setdefault(k, p)
        unit[k] = p.unit
    sid: dict[tuple[str, str], int] = {}
    with engine.begin() as c:
        skeys = list(first)
        for i in range(0, len(skeys), _CHUNK):
            part = skeys[i:i + _CHUNK]
            params: dict[str, Any] = {"c": cluster, "o": owner_key}
            values = []
            for j, k in enumerate(part):
                values.append(f"(:o, :n{j}, :c, :k{j}, CAST(:p{j} AS jsonb), :u{j})")
                params.update({f"n{j}": k[0], f"k{j}": k[1], f"p{j}": json.dumps(first[k].params, default=str),
                               f"u{j}": unit[k]})
            for row in c.execute(text(
                    "INSERT INTO benchmark_series (owner_key, name, cluster, params_key, params, unit) VALUES "
                    + ", ".join(values) + " ON CONFLICT (owner_key, name, cluster, params_key) "
                    "DO UPDATE SET unit = excluded.unit RETURNING id, name, params_key"), params):
                sid[(row.name, row.params_key)] = int(row.id)
        last: dict[tuple[int, dt.datetime], PointWrite] = {}
        for k, p in zip(keys, pts, strict=True):
            last[(sid[k], p.ts)] = p
        pkeys = list(last)
        for i in range(0, len(pkeys), _CHUNK):
            part2 = pkeys[i:i + _CHUNK]
            params = {}
            values = []
            for j, (s_id, ts) in enumerate(part2):
                values.append(f"(:s{j}, :t{j}, :v{j}, :g{j})")
                p = last[(s_id, ts)]
                params.update({f"s{j}": s_id, f"t{j}": ts, f"v{j}": p.value, f"g{j}": p.git_commit})
            c.execute(text("INSERT INTO benchmark_points (series_id, ts, value, git_commit) VALUES " + ", ".join(values)
                           + " ON CONFLICT (series_id, ts) DO UPDATE SET value = excluded.value, "
                           "git_commit = excluded.git_commit"), params)
    return [sid[k] for k in keys]


def series(engine: Engine, *, cluster: str | None = None, name: str | None = None, series_ids: Sequence[int] | None = None,
           limit_points: int | None = None, owners: Collection[str] | None = None,
           ) -> list[tuple[SeriesRow, list[tuple[dt.datetime, float, str | None]]]]:
    """Series (by name, cluster, id; of the ``owners`` namespaces when given) with their points in time
    order (the latest ``limit_points``)."""
    where: list[str] = []
    params: dict[str, Any] = {}
    if owners is not None:
        where.append("owner_key = ANY(:owners)")
        params["owners"] = sorted(owners)
    if cluster:
        where.append("cluster = :cluster")
        params["cluster"] = cluster
    if name:
        where.append("name = :name")
        params["name"] = name
    if series_ids is not None:
        where.append("id = ANY(:ids)")
        params["ids"] = [int(i) for i in series_ids]
    out = []
    with engine.connect() as c:
        rows = c.execute(text("SELECT id, name, cluster, params, unit FROM benchmark_series "
                              + (("WHERE " + " AND ".join(where)) if where else "") + " ORDER BY name, cluster, id"),
                         params).fetchall()
        for sid, nm, cl, p, unit in rows:
            if limit_points is None:
                pts = c.execute(text("SELECT ts, value, git_commit FROM benchmark_points WHERE series_id = :id ORDER BY ts"),
                                {"id": sid}).fetchall()
            else:
                pts = c.execute(
                    text("SELECT ts, value, git_commit FROM (SELECT ts, value, git_commit FROM benchmark_points "
                         "WHERE series_id = :id ORDER BY ts DESC LIMIT :k) t ORDER BY ts"),
                    {"id": sid, "k": limit_points},
                ).fetchall()
            out.append((SeriesRow(int(sid), nm, cl, p, unit), [(t, float(v), g) for t, v, g in pts]))
    return out


def series_with_points(engine: Engine, owners: Collection[str] | None = None) -> list[dict[str, Any]]:
    """Every series (id, name, cluster, params_key, params, unit; of the ``owners`` namespaces when given)
    with ``ts``/``value``/``git_commit`` lists in time order (two queries, whatever the number of series)."""
    own = "" if owners is None else " WHERE owner_key = ANY(:owners)"
    params = {} if owners is None else {"owners": sorted(owners)}
    with engine.connect() as c:
        out = [dict(r._mapping) for r in c.execute(
            text("SELECT id, name, cluster, params_key, params, unit FROM benchmark_series" + own
                 + " ORDER BY name, cluster, params_key"), params)]
        pts = c.execute(text("SELECT series_id, ts, value, git_commit FROM benchmark_points WHERE series_id = ANY(:ids) "
                             "ORDER BY series_id, ts"), {"ids": [s["id"] for s in out]}).fetchall()
    by: dict[int, list[tuple[Any, float, Any]]] = {}
    for sid, ts, v, commit in pts:
        by.setdefault(sid, []).append((ts, v, commit))
    for s in out:
        p = by.get(s["id"], [])
        s["ts"] = [t for t, _, _ in p]
        s["value"] = [v for _, v, _ in p]
        s["git_commit"] = [g for _, _, g in p]
    return out


def points(engine: Engine, series_id: int) -> list[tuple[dt.datetime, float, str | None]]:
    """(ts, value, git_commit) of one series in time order."""
    with engine.connect() as c:
        return [(t, float(v), g) for t, v, g in c.execute(
            text("SELECT ts, value, git_commit FROM benchmark_points WHERE series_id = :id ORDER BY ts"), {"id": series_id})]
