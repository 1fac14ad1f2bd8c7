"""Nodes across runs: how often each slowed a job (stragglers, slow network) and its microbenchmarks."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..deps import State

router = APIRouter(tags=["nodes"])

NodeName = Annotated[str, Path(min_length=1, max_length=256, description="node name (as the ranks reported it)")]


@router.get("/nodes", summary="Nodes ranked by how often they slowed a job, with their latest per-node microbenchmarks")
def get_nodes(st: State, limit: Annotated[int, Query(ge=1, le=10_000, description="nodes returned")] = 500) -> dict[str, Any]:
    return reports.node_list(st.engine, limit=limit)


@router.get("/nodes/{node}", summary="One node: its history over runs and its latest microbenchmarks")
def get_node(node: NodeName, st: State,
             runs: Annotated[int, Query(ge=1, le=1000, description="most recent runs listed")] = 50) -> dict[str, Any]:
    out = reports.node_detail(st.engine, node, runs=runs)
    if out is None:
        raise HTTPException(status_code=404, detail=f"node {node!r} not found")
    return out
