"""Projections of a run to another layout and their track record per family (docs/api.md "Projections")."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..api_models import Projection, ProjectionTrackRecord
from ..deps import State
from ..reads import ReadState

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]
_MAX_RANKS = 1 << 20


@router.get("/runs/{run_id}/projection", response_model=Projection,
            summary="The run's step, MFU, tokens/s and parts projected to another world size / tp / pp / micro-batches")
def get_projection(
    run_id: RunId, st: ReadState, full: State,
    world_size: Annotated[int, Query(ge=1, le=_MAX_RANKS, description="target world size (GPUs)")],
    tp: Annotated[int | None, Query(ge=1, le=4096, description="tensor-parallel degree (default: the run's)")] = None,
    pp: Annotated[int | None, Query(ge=1, le=4096, description="pipeline-parallel degree (default: the run's)")] = None,
    micro_batches: Annotated[int | None, Query(ge=1, le=1 << 16,
                                               description="pipeline micro-batches per step (default: the run's)")] = None,
    bucket_bytes: Annotated[int | None, Query(ge=1 << 10, le=1 << 40,
                                              description="gradient all-reduce bucket in bytes (default: the run's)")] = None,
    batch: Annotated[str, Query(pattern="^(per_replica|global)$",
                                description="held when the layout changes: the per-replica batch (weak scaling) "
                                            "or the global batch (strong)")] = "per_replica",
) -> dict[str, Any]:
    try:
        out = reports.run_projection(st.engine, run_id, world_size=world_size, tp=tp, pp=pp,
                                     micro_batches=micro_batches, bucket_bytes=bucket_bytes, batch=batch,
                                     write_engine=full.engine)
    except ValueError as e:
        raise HTTPException(status_code=422, detail=str(e)) from None
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out


@router.get("/projections/track_record", response_model=ProjectionTrackRecord,
            summary="A family's projections checked against the runs measured at their layouts, and the back-test")
def get_track_record(
    st: ReadState,
    family: Annotated[str, Query(min_length=1, max_length=128, description="model family")],
) -> dict[str, Any]:
    return reports.track_record(st.engine, family)
