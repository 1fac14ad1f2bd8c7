"""Device telemetry: a run's per rank (docs/api.md ``GET /runs/{id}/devices``), nodes by GPU trouble across runs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from starlette.concurrency import run_in_threadpool

from ..api_models import DeviceNodes, Devices
from ..limits import MAX_PAGE_ROWS
from ..reads import ReadState
from ..reports.devices import node_device_trouble, run_devices

router = APIRouter(tags=["runs"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]


@router.get("/runs/{run_id}/devices", response_model=Devices,
            summary="Device telemetry per rank (NVML via the agent): clocks, power, temperature, utilisation, the "
                    "throttle reasons with the share of time throttled, XID and ECC errors, node; throttled ranks")
async def get_run_devices(run_id: RunId, st: ReadState) -> dict[str, Any]:
    out = await run_in_threadpool(run_devices, st.engine, run_id)
    if out is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return out


@router.get("/devices/nodes", tags=["nodes"], response_model=DeviceNodes,
            summary="Nodes ranked by GPU trouble across runs: runs whose GPUs throttled there, seconds throttled, "
                    "windows with XID events, ECC errors (from the agents' device telemetry)")
async def get_device_nodes(
    st: ReadState,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS, description="nodes returned, worst first")] = 100,
    since: Annotated[float | None, Query(ge=0, le=1e11, description="only telemetry from this Unix time on")] = None,
) -> dict[str, Any]:
    return {"nodes": await run_in_threadpool(node_device_trouble, st.engine, since_s=since, limit=limit)}
