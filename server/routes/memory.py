"""Memory explained per module and the activation-checkpointing advice with its price (docs/api.md, "Memory")."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..api_models import MemoryReport
from ..reads import ReadState

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/runs/{run_id}/memory", response_model=MemoryReport,
            summary="Memory per module, the peak's parts, imbalance across ranks and checkpointing advice")
def get_memory(
    run_id: RunId, st: ReadState,
    target_bytes: Annotated[int | None, Query(ge=1, le=1 << 50,
                                              description="memory target per rank in bytes (default: 10 % headroom "
                                                          "under the device memory, else room for one more sample "
                                                          "per micro-batch)")] = None,
) -> dict[str, Any]:
    out = reports.memory_report(st.engine, run_id, target_bytes=target_bytes)
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out
