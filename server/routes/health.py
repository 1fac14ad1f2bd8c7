"""Liveness/readiness and Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from .. import reports
from ..api_models import Health
from ..errors import error_body

router = APIRouter(tags=["health"])

#: how long a successful database check answers /healthz without another (seconds)
_OK_FOR_S = 0.5


@router.get("/healthz", summary="200 once the server is ready (database reachable)", response_model=Health,
            responses={503: {"description": "Starting, or the database is unreachable; retry after Retry-After seconds"}})
async def healthz(request: Request) -> JSONResponse:
    st = getattr(request.app.state, "fs", None)
    if st is None or not st.ready:
        return JSONResponse({"status": "starting", **error_body(503, "starting up")}, status_code=503,
                            headers={"Retry-After": "1"})
    # a database check that succeeded within the last half second answers at once, on the event loop: a
    # busy server (reads, ingest) answers its probes without queueing them behind its work; a failed check
    # is never reused
    if time.monotonic() - getattr(request.app.state, "healthz_ok_at", float("-inf")) < _OK_FOR_S:
        return JSONResponse({"status": "ok"})
    try:
        await run_in_threadpool(reports.database_ok, st.engine)
        request.app.state.healthz_ok_at = time.monotonic()
    except Exception as e:  # noqa: BLE001 - any failure to reach the database means not ready
        request.app.state.healthz_ok_at = float("-inf")
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
