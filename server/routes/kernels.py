"""Kernel hotspots of a run: the agent's sampled trace windows aggregated across ranks and over the run."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..api_models import Kernels
from ..reads import ReadState

router = APIRouter(tags=["traces"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/runs/{run_id}/kernels", response_model=Kernels,
            summary="Top GPU kernels by time across ranks and over the run (sampled trace windows)")
def get_kernels(run_id: RunId, st: ReadState,
                top: Annotated[int, Query(ge=1, le=200, description="kernels listed, most time first")] = 20) -> dict[str, Any]:
    if reports.get_run(st.engine, run_id) is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return reports.run_kernels(st.engine, run_id, top=top)
