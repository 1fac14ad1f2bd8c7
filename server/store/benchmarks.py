"""Benchmark series (``fleetscope bench``): ``benchmark_series`` keyed by (name, cluster, params) and
their ``benchmark_points`` over time."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
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


def record_points(engine: Engine, cluster: str, pts: Sequence[PointWrite]) -> list[int]:
    """Upsert each point's series and the point itself (one per series and time) in one transaction;
    returns the series id of each point."""
    ids: list[int] = []
    with engine.begin() as c:
        for p in pts:
            sid = c.execute(
                text(
                    "INSERT INTO benchmark_series (name, cluster, params_key, params, unit) "
                    "VALUES (:n, :c, :k, CAST(:p AS jsonb), :u) ON CONFLICT (name, cluster, params_key) "
                    "DO UPDATE SET unit = excluded.unit RETURNING id"
                ),
                {"n": p.name, "c": cluster, "k": _params_key(p.params), "p": json.dumps(p.params, default=str), "u": p.unit},
            ).scalar_one()
            c.execute(
                text("INSERT INTO benchmark_points (series_id, ts, value, git_commit) VALUES (:s, :t, :v, :g) "
                     "ON CONFLICT (series_id, ts) DO UPDATE SET value = excluded.value, git_commit = excluded.git_commit"),
                {"s": sid, "t": p.ts, "v": p.value, "g": p.git_commit},
            )
            ids.append(int(sid))
    return ids


def series(engine: Engine, *, cluster: str | None = None, name: str | None = None, series_ids: Sequence[int] | None = None,
           limit_points: int | None = None) -> list[tuple[SeriesRow, list[tuple[dt.datetime, float, str | None]]]]:
    """Series (by name, cluster, id) with their points in time order (the latest ``limit_points``)."""
    where: list[str] = []
    params: dict[str, Any] = {}
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


def series_with_points(engine: Engine) -> list[dict[str, Any]]:
    """Every series (id, name, cluster, params_key, params, unit) with ``ts``/``value``/``git_commit``
    lists in time order (two queries, whatever the number of series)."""
    with engine.connect() as c:
        out = [dict(r._mapping) for r in c.execute(
            text("SELECT id, name, cluster, params_key, params, unit FROM benchmark_series ORDER BY name, cluster, params_key"))]
        pts = c.execute(text("SELECT series_id, ts, value, git_commit FROM benchmark_points ORDER BY series_id, ts")).fetchall()
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
