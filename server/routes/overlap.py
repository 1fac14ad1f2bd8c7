"""Gradient communication against backward: one rank-step's collectives on its timeline (docs/api.md)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..api_models import Overlap
from ..limits import MAX_PAGE_ROWS
from ..reads import ReadState

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/runs/{run_id}/overlap", response_model=Overlap,
            summary="One rank-step's collectives placed against backward: exposed parts, tail after backward, overlap")
def get_overlap(
    run_id: RunId, st: ReadState,
    step: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="step (default: a recent representative one)")] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="rank (default: the step's median step time)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS, description="collectives listed (the longest); the rest are "
                                "summed in collectives_folded")] = MAX_PAGE_ROWS,
) -> dict[str, Any]:
    out = reports.run_overlap(st.engine, run_id, step=step, rank=rank, limit=limit)
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    if out["rank"] is None and (step is not None or rank is not None):
        raise HTTPException(status_code=404, detail=out["note"])
    return out
