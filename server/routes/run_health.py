"""A run's health: where it stopped and why (docs/api.md ``GET /runs/{id}/health``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from starlette.concurrency import run_in_threadpool

from ..api_models import RunHealthOut
from ..health_pass import params_from
from ..reads import ReadState
from ..reports.health import run_health

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/runs/{run_id}/health", response_model=RunHealthOut,
            summary="Run state (running, stalled, hung, failed, finished), where it stopped and why: the ranks that "
                    "never arrived, their nodes and stacks, the first failure, the job's attempts")
async def get_run_health(run_id: RunId, st: ReadState) -> dict[str, Any]:
    out = await run_in_threadpool(run_health, st.engine, run_id, params_from(st.settings))
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out
