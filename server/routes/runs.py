"""Runs: registration (write) and the read API (list, one, summary, collectives)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from starlette.concurrency import run_in_threadpool

from .. import reports
from ..deps import AdminAuth, IngestAuth, IngestCaller, State
from ..ownership import owners_for
from ..runs import NotOwner, RunFinish, RunRegistration, delete_run, finish_run, register_run
from ..schemas import RunsResponse, SummaryResponse

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.post("/runs", dependencies=[IngestAuth],
             summary="Register a run (idempotent by name within the token's team, else the token; every rank may call it)")
def post_run(reg: RunRegistration, st: State, who: IngestCaller) -> dict[str, Any]:
    out = register_run(st.engine, reg, owner_token_id=who.token_id, owner_key=who.owner_key)
    st.ingest.forget_run(out["id"])
    return out


@router.post("/runs/{run_id}/finish", dependencies=[IngestAuth], summary="Mark a run finished/failed/aborted",
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


@router.delete("/runs/{run_id}", dependencies=[AdminAuth],
               summary="Delete a run and everything that hangs off it (admin token)")
def delete_run_route(run_id: RunId, st: State) -> dict[str, Any]:
    deleted = delete_run(st.engine, run_id)
    if deleted is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    st.ingest.forget_run(run_id)
    owners_for(st.engine).forget(run_id)
    reports.clear_caches()
    return {"id": run_id, "deleted": deleted}


@router.get("/runs", response_model=RunsResponse, summary="List runs, newest first")
async def get_runs(
    st: State,
    name: Annotated[str | None, Query(max_length=256)] = None,
    family: Annotated[str | None, Query(max_length=128)] = None,
    status: Annotated[str | None, Query(max_length=16)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> Any:
    runs = await run_in_threadpool(lambda: reports.list_runs(st.engine, name=name, family=family, status=status, limit=limit))
    return {"runs": runs}


@router.get("/runs/{run_id}", summary="One run")
def get_run(run_id: RunId, st: State) -> dict[str, Any]:
    run = reports.get_run(st.engine, run_id)
    if run is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return run


@router.get("/runs/{run_id}/summary", response_model=SummaryResponse, summary="Run summary (docs/metrics.md)")
def get_summary(run_id: RunId, st: State) -> Any:
    s = reports.run_summary(st.engine, run_id)
    if s is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return s


@router.get("/runs/{run_id}/collectives", summary="Collectives by op × group × message size, with busbw")
def get_collectives(run_id: RunId, st: State) -> dict[str, Any]:
    if reports.get_run(st.engine, run_id) is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return {"collectives": reports.run_collectives(st.engine, run_id)}
