"""Alerts (filled by the regression detector; the lifecycle lives in the analysis layer)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy import text

from ..deps import State
from ..schemas import AlertsResponse

router = APIRouter(tags=["alerts"])


@router.get("/alerts", response_model=AlertsResponse, summary="Alerts, newest first")
def get_alerts(
    st: State,
    state: Annotated[str | None, Query(pattern="^(firing|resolved|acknowledged)$")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> Any:
    sql = (
        "SELECT id, kind, metric, state, run_id, before, after, change, significance, first_bad, details, url, "
        "created_at, updated_at FROM alerts"
    )
    params: dict[str, Any] = {"limit": limit}
    if state:
        sql += " WHERE state = :state"
        params["state"] = state
    sql += " ORDER BY created_at DESC LIMIT :limit"
    with st.engine.connect() as c:
        rows = [dict(r._mapping) for r in c.execute(text(sql), params)]
    for r in rows:
        for k in ("created_at", "updated_at"):
            r[k] = r[k].isoformat() if r[k] else None
    return {"alerts": rows}
