"""POST /api/v1/ingest: authenticated, size-limited, validated, idempotent batch ingest."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from ..deps import IngestAuth, IngestCaller, State
from ..errors import error_body
from ..ingest import Overloaded
from ..ownership import forbidden_detail, owners_for
from ..schemas import INGEST_BODY_SCHEMA, IngestResponse
from ..state import AppState
from ..validate import BatchError

router = APIRouter(tags=["ingest"])
log = logging.getLogger(__name__)

_REASONS = {400: "malformed", 401: "auth", 403: "forbidden", 413: "too_large", 415: "unsupported", 422: "invalid",
            429: "backlog", 503: "db_unavailable"}
#: Overloaded's reasons (server/ingest.py) as metric reasons
_OVERLOAD = {"compaction backlog": "backlog", "ingest queue full": "queue_full", "ingest writers busy": "writers_busy"}


def _error(st: AppState, status: int, detail: str | dict[str, Any], headers: dict[str, str] | None = None, *,
           reason: str | None = None, records: int = 0) -> JSONResponse:
    st.metrics.reject(reason or _REASONS.get(status, str(status)), records)
    return JSONResponse(error_body(status, detail), status_code=status, headers=headers)


@router.post(
    "/ingest",
    dependencies=[IngestAuth],
    response_model=IngestResponse,
    summary="Ingest a batch of rank-step, collective, modality, rank and event records",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/msgpack": {"schema": INGEST_BODY_SCHEMA},
                "application/json": {"schema": INGEST_BODY_SCHEMA},
            },
        }
    },
    responses={
        400: {"description": "Malformed body (bad gzip/msgpack/JSON)"},
        401: {"description": "Missing or invalid bearer token; nothing written"},
        403: {"description": "The batch's run belongs to another owner (not this token or its team; admin tokens "
              "write any run); nothing written"},
        413: {"description": "Batch too large"},
        415: {"description": "Unsupported Content-Type or Content-Encoding"},
        422: {"description": "Invalid record: the detail names the record index and field (`where`, and structured "
              "in `loc`: {section, index, field}); nothing written"},
        429: {"description": "Compaction backlog; retry after Retry-After seconds"},
        503: {"description": "Overloaded; retry after Retry-After seconds"},
    },
)
async def ingest(request: Request, st: State, who: IngestCaller) -> Any:
    t0 = time.perf_counter()
    limit = st.settings.max_body_bytes
    clen = request.headers.get("content-length")
    if clen is not None:
        try:
            if int(clen) > limit:
                return _error(st, 413, f"body of {clen} bytes exceeds the limit of {limit} bytes")
        except ValueError:
            return _error(st, 400, "invalid Content-Length")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _error(st, 413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    owners = owners_for(st.engine)

    def authorize(run_id: int) -> None:
        if not owners.may_write(who, run_id):
            raise BatchError("run_id", forbidden_detail(who, run_id), status=403)

    def work() -> Any:
        return st.ingest.ingest_body(body, request.headers.get("content-type"), request.headers.get("content-encoding"),
                                     max_decoded=st.settings.max_decoded_bytes,
                                     authorize=None if who.allows("admin") else authorize)

    try:
        res = await run_in_threadpool(work)
    except BatchError as e:
        return _error(st, e.status, e.detail(), records=int(getattr(e, "records", 0) or 0))
    except Overloaded as e:
        return _error(st, e.status, e.reason, {"Retry-After": str(e.retry_after)}, reason=_OVERLOAD.get(e.reason))
    except (OperationalError, psycopg.OperationalError, TimeoutError) as e:
        log.warning("database unavailable during ingest: %s", type(e).__name__)
        return _error(st, 503, "database unavailable; retry later", {"Retry-After": "2"})
    for kind, n in res.accepted.items():
        if n:
            st.metrics.records.labels(kind).inc(n)
    st.metrics.batches.inc()
    st.metrics.batch_seconds.observe(time.perf_counter() - t0)
    return {"run_id": res.run_id, "accepted": res.accepted}
