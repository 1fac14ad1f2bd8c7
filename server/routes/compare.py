"""Runs side by side in normalised units: ``GET /api/v1/compare?runs=ID,ID`` (docs/api.md, "Compare")."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from .. import reports
from ..api_models import CompareRuns
from ..errors import error_responses
from ..reads import ReadState

router = APIRouter(tags=["runs"])

#: runs one comparison may hold
MAX_COMPARE = 16


def parse_run_ids(value: str) -> list[int]:
    """``"12,15"`` → [12, 15] (order kept, duplicates dropped); ValueError naming what is wrong."""
    out: list[int] = []
    for part in value.split(","):
        p = part.strip()
        if not p:
            continue
        if not p.isdigit() or not 0 < int(p) < 2**31:
            raise ValueError(f"runs: {p!r} is not a run id (comma-separated positive integers)")
        if int(p) not in out:
            out.append(int(p))
    if not out:
        raise ValueError("runs: give at least one run id, e.g. runs=12,15")
    if len(out) > MAX_COMPARE:
        raise ValueError(f"runs: at most {MAX_COMPARE} runs per comparison, got {len(out)}")
    return out


@router.get("/compare", response_model=CompareRuns, responses=error_responses(422),
            summary="Runs side by side: per GPU, per (active) parameter, per sample and per modality")
def get_compare(st: ReadState, runs: Annotated[str, Query(max_length=400, description="run ids, e.g. 12,15")]) -> dict[str, Any]:
    try:
        ids = parse_run_ids(runs)
    except ValueError as e:
        raise HTTPException(status_code=422, detail=str(e)) from None
    return reports.compare_runs(st.engine, ids)
