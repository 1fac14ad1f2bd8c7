"""Pydantic models of the wire and the API (documentation and response validation).

Ingest bodies are parsed by the vectorised validator (validate.py), not by these models — a
100k-record batch would cost seconds as pydantic objects — but their JSON schema is what the
OpenAPI document publishes for the request body.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from fleetscope.wire import SECTIONS, WIRE_VERSION

__all__ = ["INGEST_BODY_SCHEMA", "IngestResponse", "RunsResponse", "SummaryResponse", "AlertsResponse"]

_PY = {"int": int, "float": float, "str": str}


def _section_model(section: str) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for f in SECTIONS[section][1]:
        t = list[_PY[f.type]] if f.required else list[_PY[f.type] | None] | None  # type: ignore[valid-type]
        fields[f.name] = (t, Field(... if f.required else None, description=f.doc or None))
    return create_model(f"{section.title().replace('_', '')}Columns", __config__=ConfigDict(extra="forbid"), **fields)


class RankInfo(BaseModel):
    rank: int = Field(ge=0)
    host: str | None = None
    node: str | None = None
    local_rank: int | None = None
    device: str | None = None


class EventRecord(BaseModel):
    rank: int = Field(ge=0)
    seq: int = Field(ge=0, description="unique per (run, rank): the idempotency key")
    kind: str
    ts: float | None = None
    step: int | None = None
    data: dict[str, Any] = Field(default_factory=dict)


IngestBatch = create_model(
    "IngestBatch",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One batch for one run: columnar sections (equal-length arrays) or row-form `records`.",
    v=(int, Field(WIRE_VERSION, description="wire version")),
    run_id=(int, Field(..., description="id from POST /api/v1/runs")),
    sent_at=(float | None, None),
    rank_steps=(_section_model("rank_steps") | None, None),
    collectives=(_section_model("collectives") | None, None),
    modality_tokens=(_section_model("modality_tokens") | None, None),
    ranks=(list[RankInfo] | None, None),
    events=(list[EventRecord] | None, None),
    records=(list[dict[str, Any]] | None, Field(None, description="row form: objects with a 'kind' and the fields")),
)

INGEST_BODY_SCHEMA = IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
# inline nested definitions so the schema is self-contained in openapi_extra
_defs = INGEST_BODY_SCHEMA.pop("$defs", {})


def _inline(node: Any) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _inline(_defs[ref.rsplit("/", 1)[1]])
        return {k: _inline(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(x) for x in node]
    return node


INGEST_BODY_SCHEMA = _inline(INGEST_BODY_SCHEMA)


class Accepted(BaseModel):
    rank_steps: int
    collectives: int
    modality_tokens: int
    ranks: int
    events: int


class IngestResponse(BaseModel):
    run_id: int
    accepted: Accepted


class RunOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: int
    name: str
    model_family: str | None
    world_size: int
    status: str
    started_at: str | None
    steps: int
    rank_steps: int
    collective_records: int


class RunsResponse(BaseModel):
    runs: list[RunOut]


class Decomposition(BaseModel):
    step_s: float | None
    data_s: float | None
    compute_s: float | None
    comm_exposed_s: float | None
    other_s: float | None


class Straggler(BaseModel):
    model_config = ConfigDict(extra="allow")
    rank: int
    host: str | None
    slowdown: float


class Bottleneck(BaseModel):
    model_config = ConfigDict(extra="allow")
    component: str
    share: float
    max_speedup: float | None
    finding: str


class SummaryResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    run: RunOut
    rank_steps: int
    collective_records: int
    decomposition: Decomposition
    mfu: float | None
    tokens_per_s: float | None
    stragglers: list[Straggler]
    bottlenecks: list[Bottleneck]


class AlertOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: int
    kind: str
    metric: str
    state: str
    run_id: int | None
    before: float | None
    after: float | None
    change: float | None
    url: str | None


class AlertsResponse(BaseModel):
    alerts: list[AlertOut]
