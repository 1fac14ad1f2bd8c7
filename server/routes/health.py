"""Liveness/readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import reports
from ..api_models import Health
from ..errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="200 once the server is ready (database reachable)", response_model=Health,
            responses={503: {"description": "Starting, or the database is unreachable; retry after Retry-After seconds"}})
def healthz(request: Request) -> JSONResponse:
    st = getattr(request.app.state, "fs", None)
    if st is None or not st.ready:
        return JSONResponse({"status": "starting", **error_body(503, "starting up")}, status_code=503,
                            headers={"Retry-After": "1"})
    try:
        reports.database_ok(st.engine)
    except Exception as e:  # noqa: BLE001 - any failure to reach the database means not ready
        return JSONResponse({"status": "database unavailable",
                             **error_body(503, f"database unavailable ({type(e).__name__})")}, status_code=503,
                            headers={"Retry-After": "2"})
    return JSONResponse({"status": "ok"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(request: Request) -> Response:
    st = getattr(request.app.state, "fs", None)
    if st is None:
        return JSONResponse(error_body(503, "starting up"), status_code=503, headers={"Retry-After": "1"})
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)
