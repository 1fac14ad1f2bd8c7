"""Nodes across runs: how often each slowed a job (stragglers, slow network) and its microbenchmarks."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query

from .. import reports
from ..api_models import NodeDetail, NodeList
from ..limits import MAX_PAGE_ROWS
from ..reads import ReadState

router = APIRouter(tags=["nodes"])

NodeName = Annotated[str, Path(min_length=1, max_length=256, description="node name (as the ranks reported it)")]


@router.get("/nodes", response_model=NodeList, summary="Nodes ranked by how often they slowed a job, with their latest per-node microbenchmarks")
def get_nodes(st: ReadState,
              limit: Annotated[int, Query(ge=1, le=10_000, description=f"nodes returned (at most {MAX_PAGE_ROWS:,}: a "
                                          "larger limit is clamped)")] = 500,
              offset: Annotated[int, Query(ge=0, le=2**31 - 1, description="nodes skipped (worst first)")] = 0,
              ) -> dict[str, Any]:
    return reports.node_list(st.engine, limit=limit, offset=offset)


@router.get("/nodes/{node}", response_model=NodeDetail, summary="One node: its history over runs and its latest microbenchmarks")
def get_node(node: NodeName, st: ReadState,
             runs: Annotated[int, Query(ge=1, le=1000, description="most recent runs listed")] = 50) -> dict[str, Any]:
    out = reports.node_detail(st.engine, node, runs=runs)
    if out is None:
        raise HTTPException(status_code=404, detail=f"node {node!r} not found")
    return out
