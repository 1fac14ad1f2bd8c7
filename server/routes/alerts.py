"""Alerts (raised by the regression detector) with their lifecycle, and the CI check of a run."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from starlette.concurrency import run_in_threadpool

from .. import alerts as alert_lifecycle
from .. import reports
from ..api_models import RunCheck
from ..deps import AdminAuth, State
from ..reads import ReadState
from ..schemas import AlertOut, AlertsResponse

router = APIRouter(tags=["alerts"])

AlertId = Annotated[int, Path(ge=1, le=2**31 - 1, description="alert id")]
RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/alerts", response_model=AlertsResponse, summary="Alerts, newest first")
def get_alerts(
    st: ReadState,
    state: Annotated[str | None, Query(pattern="^(firing|resolved|acknowledged)$")] = None,
    kind: Annotated[str | None, Query(pattern="^(run_series|benchmark|step_time_shift|straggler|slow_node|hang|node_lost|failure|device)$")] = None,
    run_id: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> Any:
    return {"alerts": reports.list_alerts(st.engine, state=state, kind=kind, run_id=run_id, limit=limit)}


@router.get("/alerts/{alert_id}", response_model=AlertOut, summary="One alert")
def get_alert(alert_id: AlertId, st: ReadState) -> dict[str, Any]:
    a = reports.get_alert(st.engine, alert_id)
    if a is None:
        raise HTTPException(status_code=404, detail=f"alert {alert_id} not found")
    return a


def _transition(alert_id: int, st: State, state: str) -> dict[str, Any]:
    # a transition reaches every configured sink once (the notifier's workers deliver it from the table)
    a = alert_lifecycle.set_state(st.engine, alert_id, state, notifier=getattr(st, "notifier", None))
    if a is None:
        raise HTTPException(status_code=404, detail=f"alert {alert_id} not found")
    return a


@router.post("/alerts/{alert_id}/ack", dependencies=[AdminAuth], response_model=AlertOut, summary="Acknowledge a firing alert (it stays active); every sink is told")
def post_ack(alert_id: AlertId, st: State) -> dict[str, Any]:
    return _transition(alert_id, st, "acknowledged")


@router.post("/alerts/{alert_id}/resolve", dependencies=[AdminAuth], response_model=AlertOut, summary="Resolve an alert by hand (the same regression is not raised again); every sink is told")
def post_resolve(alert_id: AlertId, st: State) -> dict[str, Any]:
    return _transition(alert_id, st, "resolved")


@router.get("/runs/{run_id}/check", tags=["regressions"], response_model=RunCheck,
            summary="Is this run a regression against its family's baseline? (fleetscope check)")
async def get_check(run_id: RunId, st: ReadState) -> dict[str, Any]:
    res = await run_in_threadpool(reports.check_run, st.engine, run_id)
    if res is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return res
