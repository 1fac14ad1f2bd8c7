"""Fleet utilisation: GPU-hours per team, family and day (docs/api.md ``GET /fleet/utilisation``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..reads import ReadState
from ..reports.utilisation import UtilisationError, fleet_utilisation, parse_by, parse_time

router = APIRouter(tags=["fleet"])

_OPEN = ConfigDict(extra="allow")


class UtilisationFigures(BaseModel):
    """A group's (or the window's) figures; definitions in docs/metrics.md "Fleet utilisation"."""

    model_config = _OPEN
    runs: int
    gpu_hours: float = Field(description="world size × wall hours of each run inside the window")
    busy_gpu_hours: float = Field(description="world size × the steps' time (median rank) inside the window")
    idle_gpu_hours: float = Field(description="allocated but no step running: gpu_hours − busy_gpu_hours")
    idle_share: float | None = None
    failed_gpu_hours: float = Field(description="GPU-hours of runs whose status is failed")
    redone_gpu_hours: float = Field(description="world size × the time of steps run again after a restart")
    mfu_gpu_hours: float = Field(description="model FLOPs done / peak FLOP/s per GPU, in GPU-hours")
    mfu_known_gpu_hours: float
    mfu: float | None = Field(None, description="mfu_gpu_hours / mfu_known_gpu_hours")
    mfu_unknown_gpu_hours: float
    mfu_unknown_share: float | None = None


class Utilisation(BaseModel):
    """``GET /api/v1/fleet/utilisation``: the window, its totals and one list per grouping asked for (``team``,
    ``family``: largest first; ``day``: in order, keyed ``date``)."""

    model_config = _OPEN
    since: str
    until: str
    by: list[str]
    total: UtilisationFigures


@router.get("/fleet/utilisation", response_model=Utilisation,
            summary="GPU-hours per team, model family and UTC day over a window (runs clipped to it): "
                    "allocated-but-idle GPU-hours, failed and redone work, MFU-weighted GPU-hours")
async def get_fleet_utilisation(
    st: ReadState,
    since: Annotated[str | None, Query(max_length=40, description="window start: Unix seconds or ISO 8601 "
                                                                   "(default: 7 days before until)")] = None,
    until: Annotated[str | None, Query(max_length=40, description="window end: Unix seconds or ISO 8601 "
                                                                   "(default: now)")] = None,
    by: Annotated[str, Query(max_length=64, description="groupings, comma-separated: team, family, day")]
        = "team,family,day",
) -> dict[str, Any]:
    try:
        t0, t1, groups = parse_time(since, "since"), parse_time(until, "until"), parse_by(by)
        return await run_in_threadpool(fleet_utilisation, st.engine, since=t0, until=t1, by=groups)
    except UtilisationError as e:
        raise HTTPException(status_code=422, detail=str(e)) from None
