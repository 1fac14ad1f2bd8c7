"""Benchmark series (``fleetscope bench``): record points, read series."""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import text

from ..deps import IngestAuth, State

router = APIRouter(tags=["benchmarks"])

SeriesId = Annotated[int, Path(ge=1, le=2**31 - 1, description="benchmark series id")]


class BenchmarkPointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="e.g. matmul_tflops, all_reduce_busbw")
    params: dict[str, Any] = Field(default_factory=dict, description="what identifies the series (size, dtype, ...)")
    unit: str = Field(min_length=1, max_length=32, description="e.g. TFLOP/s, GB/s")
    value: float
    ts: float | None = Field(default=None, ge=0, le=4e9, description="unix time of the measurement (default: now)")
    git_commit: str | None = Field(default=None, max_length=64)

    @field_validator("value", "ts")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("name", "unit", "git_commit")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @field_validator("params")
    @classmethod
    def _json_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            text_ = json.dumps(v, allow_nan=False, default=str)
        except ValueError as e:
            raise ValueError(f"params must be plain JSON (finite numbers): {e}") from None
        if "\\u0000" in text_:
            raise ValueError("params must not contain NUL characters")
        return v


class BenchmarkBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str = Field(min_length=1, max_length=128)
    points: list[BenchmarkPointIn] = Field(min_length=1, max_length=10_000)

    @field_validator("cluster")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)[:256]


@router.post("/benchmarks", dependencies=[IngestAuth], summary="Record benchmark points (series keyed by name, cluster, params)")
def post_benchmarks(batch: BenchmarkBatch, st: State) -> dict[str, Any]:
    now = dt.datetime.now(dt.timezone.utc)
    ids: list[int] = []
    with st.engine.begin() as c:
        for p in batch.points:
            sid = c.execute(
                text(
                    "INSERT INTO benchmark_series (name, cluster, params_key, params, unit) "
                    "VALUES (:n, :c, :k, CAST(:p AS jsonb), :u) ON CONFLICT (name, cluster, params_key) "
                    "DO UPDATE SET unit = excluded.unit RETURNING id"
                ),
                {"n": p.name, "c": batch.cluster, "k": _params_key(p.params), "p": json.dumps(p.params, default=str),
                 "u": p.unit},
            ).scalar_one()
            ts = dt.datetime.fromtimestamp(p.ts, dt.timezone.utc) if p.ts is not None else now
            c.execute(
                text("INSERT INTO benchmark_points (series_id, ts, value, git_commit) VALUES (:s, :t, :v, :g) "
                     "ON CONFLICT (series_id, ts) DO UPDATE SET value = excluded.value, git_commit = excluded.git_commit"),
                {"s": sid, "t": ts, "v": p.value, "g": p.git_commit},
            )
            ids.append(int(sid))
    st.alerts.poke(benchmark_series=ids)
    return {"series": sorted(set(ids)), "points": len(batch.points)}


def _series(engine: Any, where: str, params: dict[str, Any], limit_points: int) -> list[dict[str, Any]]:
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT id, name, cluster, params, unit FROM benchmark_series {where} ORDER BY name, cluster, id"), params
        ).fetchall()
        out = []
        for sid, name, cluster, p, unit in rows:
            pts = c.execute(
                text("SELECT ts, value, git_commit FROM (SELECT ts, value, git_commit FROM benchmark_points "
                     "WHERE series_id = :id ORDER BY ts DESC LIMIT :k) t ORDER BY ts"),
                {"id": sid, "k": limit_points},
            ).fetchall()
            out.append({"id": sid, "name": name, "cluster": cluster, "params": p, "unit": unit,
                        "points": [{"ts": t.isoformat(), "value": v, "git_commit": g} for t, v, g in pts]})
    return out


@router.get("/benchmarks", summary="Benchmark series with their points")
def get_benchmarks(
    st: State,
    cluster: Annotated[str | None, Query(max_length=128)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> dict[str, Any]:
    where, params = [], {}
    if cluster:
        where.append("cluster = :cluster")
        params["cluster"] = cluster
    if name:
        where.append("name = :name")
        params["name"] = name
    return {"series": _series(st.engine, ("WHERE " + " AND ".join(where)) if where else "", params, points)}


@router.get("/benchmarks/{series_id}", summary="One benchmark series")
def get_benchmark(series_id: SeriesId, st: State,
                  points: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> dict[str, Any]:
    s = _series(st.engine, "WHERE id = :id", {"id": series_id}, points)
    if not s:
        raise HTTPException(status_code=404, detail=f"benchmark series {series_id} not found")
    return s[0]
