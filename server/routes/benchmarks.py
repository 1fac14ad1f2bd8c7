"""Benchmark series (``fleetscope bench``): record points, read series."""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import reports
from ..api_models import BenchmarkList, BenchmarkSeries, BenchmarksRecorded
from ..deps import IngestAuth, IngestCaller, State
from ..jsonsafe import valid_json, valid_text
from ..reads import ReadState
from ..store import benchmarks as store

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
    def _text(cls, v: str | None) -> str | None:
        return valid_text(v)

    @field_validator("params")
    @classmethod
    def _json_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        return valid_json(v, max_depth=8)


class BenchmarkBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str = Field(min_length=1, max_length=128)
    points: list[BenchmarkPointIn] = Field(min_length=1, max_length=10_000)

    @field_validator("cluster")
    @classmethod
    def _text(cls, v: str) -> str:
        valid_text(v)
        return v


@router.post("/benchmarks", dependencies=[IngestAuth], response_model=BenchmarksRecorded, summary="Record benchmark points (series keyed by name, cluster, params)")
def post_benchmarks(batch: BenchmarkBatch, st: State, who: IngestCaller) -> dict[str, Any]:
    now = dt.datetime.now(dt.timezone.utc)
    # the caller's own series (its team's, or its token's): no token writes into another's
    ids = store.record_points(st.engine, batch.cluster, owner_key=who.owner_key, pts=[
        store.PointWrite(p.name, p.params, p.unit, p.value,
                         dt.datetime.fromtimestamp(p.ts, dt.timezone.utc) if p.ts is not None else now, p.git_commit)
        for p in batch.points])
    st.alerts.poke(benchmark_series=ids)
    return {"series": sorted(set(ids)), "points": len(batch.points)}


@router.get("/benchmarks", response_model=BenchmarkList, summary="Benchmark series with their points")
def get_benchmarks(
    st: ReadState,
    cluster: Annotated[str | None, Query(max_length=128)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> dict[str, Any]:
    return {"series": reports.benchmark_series(st.engine, cluster=cluster, name=name, points=points)}


@router.get("/benchmarks/{series_id}", response_model=BenchmarkSeries, summary="One benchmark series")
def get_benchmark(series_id: SeriesId, st: ReadState,
                  points: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> dict[str, Any]:
    s = reports.benchmark_series(st.engine, series_id=series_id, points=points)
    if not s:
        raise HTTPException(status_code=404, detail=f"benchmark series {series_id} not found")
    return s[0]
