"""Kineto trace summaries of a run: attach (``fleetscope import-trace --server``) and read."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import reports
from ..api_models import TraceList
from ..deps import IngestAuth, IngestCaller, State
from ..jsonsafe import UnsafeValue, check_json, valid_text
from ..ownership import forbidden_detail, owners_for
from ..reads import ReadState
from ..store.traces import SET_RANK, save_traces

router = APIRouter(tags=["traces"])

RunId = Annotated[int, Path(ge=1, le=2**31 - 1, description="run id")]

_MAX_DEPTH = 32
_MAX_SUMMARY_CHARS = 4_000_000


class TraceUpload(BaseModel):
    """What ``fleetscope import-trace --json`` prints, plus the name of what was imported."""

    model_config = ConfigDict(extra="ignore")

    ranks: dict[str, dict[str, Any]] = Field(
        ...,
        max_length=65_536,
        description="per-rank summaries keyed by rank; each has a 'source' (file name)",
    )
    include_last_step: bool = False
    files: list[dict[str, Any]] = Field(default_factory=list, max_length=65_536)
    kernel_types: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
    stragglers: dict[str, Any] = Field(default_factory=dict)
    source: str | None = Field(
        default=None, min_length=1, max_length=512, description="file or directory imported"
    )

    @field_validator("source")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        return valid_text(v, max_len=512)


class TracesStored(BaseModel):
    run_id: int
    stored: int


def _check_json(v: Any, where: str) -> None:
    """What JSONB cannot store or pages cannot read (NaN/inf, NUL, lone surrogates, huge integers, deep
    nesting): a 422 naming the field."""
    try:
        check_json(v, where, max_depth=_MAX_DEPTH, max_items=2_000_000)
    except UnsafeValue as e:
        raise HTTPException(status_code=422, detail=f"{e.where}: {e.message}") from None


def _rows(body: TraceUpload, world_size: int) -> list[tuple[int, str, dict[str, Any]]]:
    import json

    rows: list[tuple[int, str, dict[str, Any]]] = []
    for key, summary in body.ranks.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) > 2**31 - 1:
            raise HTTPException(
                status_code=422, detail=f"ranks.{key[:40]}: a rank must be an integer in [0, 2^31)"
            )
        if int(key) >= world_size:
            raise HTTPException(
                status_code=422,
                detail=f"ranks.{key}: rank {int(key)} is outside the run's world size {world_size} "
                       f"(ranks 0..{world_size - 1})",
            )
        source = summary.get("source")
        if not isinstance(source, str) or not 1 <= len(source) <= 512:
            raise HTTPException(
                status_code=422, detail=f"ranks.{key}.source: expected the trace file name (1-512 chars)"
            )
        _check_json(summary, f"ranks.{key}")
        if len(json.dumps(summary)) > _MAX_SUMMARY_CHARS:
            raise HTTPException(
                status_code=422, detail=f"ranks.{key}: summary larger than {_MAX_SUMMARY_CHARS} characters"
            )
        rows.append((int(key), source, summary))
    set_summary = {
        "include_last_step": body.include_last_step,
        "files": body.files,
        "kernel_types": body.kernel_types,
        "stragglers": body.stragglers,
    }
    _check_json(set_summary, "body")
    if rows:
        rows.append((SET_RANK, body.source or ",".join(sorted({s for _, s, _ in rows}))[:512], set_summary))
    return rows


@router.post(
    "/runs/{run_id}/traces", response_model=TracesStored, dependencies=[IngestAuth],
    summary="Attach reduced Kineto traces to a run",
    responses={403: {"description": "The run belongs to another owner (not this token or its team; admin tokens "
                                    "write any run); nothing stored"},
               404: {"description": "No such run"},
               422: {"description": "Invalid summary, or a rank outside the run's world size; the detail names "
                                    "the field; nothing stored"}},
)
def post_traces(run_id: RunId, body: TraceUpload, st: State, who: IngestCaller) -> Any:
    run = reports.get_run(st.engine, run_id)
    if run is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    if not owners_for(st.engine).may_write(who, run_id):
        raise HTTPException(status_code=403, detail=forbidden_detail(who, run_id))
    rows = _rows(body, int(run["world_size"]))
    stored = save_traces(st.engine, run_id=run_id, rows=rows)
    return {"run_id": run_id, "stored": stored}


@router.get(
    "/runs/{run_id}/traces", response_model=TraceList, summary="The run's trace summaries (per rank; rank -1: cross-rank figures)"
)
def get_traces(run_id: RunId, st: ReadState) -> dict[str, Any]:
    if reports.get_run(st.engine, run_id) is None:
        raise HTTPException(status_code=404, detail=f"run {run_id} not found")
    return {"run_id": run_id, "traces": reports.run_traces(st.engine, run_id)}
