"""Runs: registration (write) and the read API (list, one, summary, collectives)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from .. import reports
from ..api_models import (
    Collectives,
    RankSteps,
    RunDeleted,
    RunDetail,
    RunFinished,
    RunRegistered,
    Scalars,
    Steps,
)
from ..deps import AdminAuth, IngestAuth, IngestCaller, State
from ..ingest import INGEST_ENCODINGS
from ..limits import MAX_PAGE_ROWS, MAX_SCALAR_READ_POINTS
from ..ownership import owners_for
from ..reads import ReadState
from ..reports import rank_view, research
from ..runs import NotOwner, RunFinish, RunRegistration, delete_run, finish_run, register_run
from ..schemas import RunsResponse, SummaryResponse

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.post("/runs", dependencies=[IngestAuth], response_model=RunRegistered,
             summary="Register a run (idempotent by job id and attempt, else by name, within the token's team, else the "
                     "token; every rank of every node may call it)")
def post_run(reg: RunRegistration, st: State, who: IngestCaller) -> dict[str, Any]:
    out = register_run(st.engine, reg, owner_token_id=who.token_id, owner_key=who.owner_key)
    st.ingest.forget_run(out["id"])
    return {**out, "ingest_encodings": list(INGEST_ENCODINGS)}


@router.post("/runs/{run_id}/finish", dependencies=[IngestAuth], response_model=RunFinished, summary="Mark a run finished/failed/aborted",
             responses={403: {"description": "The run belongs to another owner (not this token or its team); "
                                             "nothing changed"}})
def post_finish(run_id: RunId, body: RunFinish, st: State, who: IngestCaller) -> dict[str, Any]:
    try:
        found = finish_run(st.engine, run_id, body.status, body.finished_at, owner_key=who.owner_key,
                           admin=who.allows("admin"))
    except NotOwner as e:
        raise HTTPException(status_code=403, detail=str(e)) from None
    if not found:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return {"id": run_id, "status": body.status}


@router.delete("/runs/{run_id}", dependencies=[AdminAuth], response_model=RunDeleted,
               summary="Delete a run and everything that hangs off it (admin token)")
def delete_run_route(run_id: RunId, st: State) -> dict[str, Any]:
    deleted = delete_run(st.engine, run_id)
    if deleted is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    st.ingest.forget_run(run_id)
    owners_for(st.engine).forget(run_id)
    reports.clear_caches()
    return {"id": run_id, "deleted": deleted}


_FILTERS_DOC = (
    "Filters (docs/api.md, \"Run filters\"): `config.KEY=VALUE` (also `!=`, `<`, `>`, `<=`, `>=`, or "
    "`config.KEY=in:a,b`; the prefixes `eq:` `ne:` `lt:` `gt:` `le:` `ge:` `in:` work for every field), `meta.KEY`, "
    "`tag=T` (repeatable: all of them), `commit=PREFIX`, `since`/`until` (ISO 8601 or unix seconds), `name`, "
    "`family`, `status`, figures (`mfu>0.4`) and `scalar.NAME.last` / `scalar.NAME.min`. A bad filter is a 422 "
    "naming it.")


def _rendered(body: dict[str, Any]) -> Any:
    """The answer rendered to JSON here, on the worker thread — a page of 10,000 runs is not encoded on
    the event loop, where it would hold up every other request (``/healthz`` included); the dict itself
    (FastAPI's encoder) when it holds what plain JSON cannot."""
    from fastapi.responses import JSONResponse

    try:
        return JSONResponse(body)
    except (TypeError, ValueError):
        return body


@router.get("/runs", response_model=RunsResponse, summary="List runs: filtered, sorted and paged in SQL",
            description=_FILTERS_DOC, responses={422: {"description": "A filter, sort or group the server cannot run "
                                                                      "(the message names the parameter)"}})
async def get_runs(
    request: Request,
    st: ReadState,
    name: Annotated[str | None, Query(max_length=256)] = None,
    family: Annotated[str | None, Query(max_length=128)] = None,
    status: Annotated[str | None, Query(max_length=16)] = None,
    tag: Annotated[list[str] | None, Query(max_length=128, description="a tag of the run (repeatable: all)")] = None,
    commit: Annotated[str | None, Query(max_length=64, description="a prefix of the run's git commit")] = None,
    since: Annotated[str | None, Query(max_length=40, description="started at or after (ISO 8601 or unix s)")] = None,
    until: Annotated[str | None, Query(max_length=40, description="started before (ISO 8601 or unix s)")] = None,
    sort: Annotated[str | None, Query(max_length=512, description="fields, comma-separated; -FIELD descending "
                                                                   "(default -started_at)")] = None,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    group_by: Annotated[str | None, Query(max_length=300, description="one or two keys: the answer is "
                                                                       "`groups` with count and medians")] = None,
    columns: Annotated[str | None, Query(max_length=4000, description="extra columns per run, comma-separated "
                                                                      "(config.KEY, meta.KEY, figures, scalar.NAME.last)")] = None,
    figures: Annotated[bool, Query(description="add each run's figures (mfu, step_s, tokens_per_s …)")] = False,
) -> Any:
    items = [(k, v) for k, v in request.query_params.multi_items() if k not in ("columns", "figures")]
    cols = [c.strip() for c in (columns or "").split(",") if c.strip()]
    try:
        q = research.parse_query(items)
        if q.group_by:
            return await run_in_threadpool(lambda: _rendered({"runs": [], **research.groups_view(st.engine, q)}))
        return await run_in_threadpool(
            lambda: _rendered(research.runs_view(st.engine, q, columns=cols, with_figures=figures)))
    except research.QueryError as e:
        raise HTTPException(status_code=422, detail=f"{e.param}: {e.message}") from None


@router.get("/runs/{run_id}/scalars", response_model=Scalars, summary="Training scalars of a run (run.log, HF Trainer, Lightning) by step",
            responses={404: {"description": "No such run"}})
def get_scalars(
    run_id: RunId, st: ReadState,
    names: Annotated[str | None, Query(max_length=33_000, description="names, comma-separated (default: all)")] = None,
    max_points: Annotated[int, Query(ge=2, le=MAX_SCALAR_READ_POINTS,
                                     description="points per name at most (min/max downsampling)")] = 2_000,
) -> dict[str, Any]:
    if reports.get_run(st.engine, run_id) is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    wanted = [n for n in (names or "").split(",") if n] if names else None
    return research.run_scalars(st.engine, run_id, wanted, max_points)


@router.get("/runs/{run_id}/steps", response_model=Steps, summary="A run's per-step rows (decomposition, MFU, throughput), paged",
            responses={404: {"description": "No such run"}})
def get_steps(
    run_id: RunId, st: ReadState,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS)] = MAX_PAGE_ROWS,
    after: Annotated[int | None, Query(ge=-1, le=2**63 - 1, description="rows after this step (a cursor; "
                                                                          "offset ignored)")] = None,
) -> dict[str, Any]:
    out = research.run_steps(st.engine, run_id, offset=offset, limit=limit, after=after)
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out


@router.get("/runs/{run_id}/ranks/{rank}/steps", response_model=RankSteps,
            summary="One rank's step-time components per step against the median rank, paged or downsampled",
            responses={404: {"description": "No such run, or a rank outside its world size"}})
def get_rank_steps(
    run_id: RunId, st: ReadState,
    rank: Annotated[int, Path(ge=0, le=2**31 - 1, description="rank (0 … world size − 1)")],
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS, description="rows; fewer on a wide run (the answer's "
                                                                    "`limit` says how many were used)")] = MAX_PAGE_ROWS,
    after: Annotated[int | None, Query(ge=-1, le=2**63 - 1, description="rows after this step (a cursor; "
                                                                          "offset ignored)")] = None,
    max_points: Annotated[int | None, Query(ge=2, le=rank_view.MAX_SERIES_POINTS,
                                            description="one series over the run (after `after`), min/max-downsampled "
                                                        "to at most this many rows; offset and limit ignored")] = None,
) -> dict[str, Any]:
    try:
        out = rank_view.rank_steps(st.engine, run_id, rank, offset=offset, limit=limit, after=after,
                                   max_points=max_points)
    except rank_view.RankOutsideRun as e:
        raise HTTPException(status_code=404, detail=str(e)) from None
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out


@router.get("/runs/{run_id}", response_model=RunDetail, summary="One run")
def get_run(run_id: RunId, st: ReadState) -> dict[str, Any]:
    run = reports.get_run(st.engine, run_id)
    if run is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run


@router.get("/runs/{run_id}/summary", response_model=SummaryResponse, summary="Run summary (docs/metrics.md)")
def get_summary(run_id: RunId, st: ReadState) -> Any:
    s = reports.run_summary(st.engine, run_id)
    if s is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return s


@router.get("/runs/{run_id}/collectives", response_model=Collectives, summary="Collectives by op × group × message size, with busbw")
def get_collectives(run_id: RunId, st: ReadState) -> dict[str, Any]:
    if reports.get_run(st.engine, run_id) is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return {"collectives": reports.run_collectives(st.engine, run_id)}
