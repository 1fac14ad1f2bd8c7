"""Pinned regression baselines: ``fleetscope baseline pin RUN`` (docs/api.md, "Baselines")."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from .. import reports
from ..api_models import BaselineList, BaselinePin, BaselinePinned
from ..deps import IngestAuth, IngestCaller, State
from ..errors import error_responses
from ..ownership import forbidden_detail, owners_for
from ..reads import ReadState

router = APIRouter(tags=["regressions"])


@router.post("/baselines", dependencies=[IngestAuth], response_model=BaselinePinned,
             responses=error_responses(404),
             summary="Pin a run as the regression baseline of its family and config signature")
def post_baseline(body: BaselinePin, st: State, who: IngestCaller) -> dict[str, Any]:
    if not owners_for(st.engine).may_write(who, body.run_id):
        raise HTTPException(status_code=403, detail=forbidden_detail(who, body.run_id))
    try:
        out = reports.pin_baseline(st.engine, body.run_id, by=who.name)
    except ValueError as e:
        raise HTTPException(status_code=422, detail=str(e)) from None
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {body.run_id} not found")
    return out


@router.get("/baselines", response_model=BaselineList, summary="The pinned baselines")
def get_baselines(st: ReadState) -> dict[str, Any]:
    return {"baselines": reports.list_baselines(st.engine)}
