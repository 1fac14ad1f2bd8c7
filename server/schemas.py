"""Pydantic models of the wire and the API (documentation and response validation).

Ingest bodies are parsed by the vectorised validator (validate.py), not by these models — a
100k-record batch would cost seconds as pydantic objects — but their JSON schema is what the
OpenAPI document publishes for the request body.
"""

from __future__ import annotations

from types import GenericAlias
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict, Field, create_model

from fleetscope.wire import SECTIONS, WIRE_VERSION

if TYPE_CHECKING:
    from typing_extensions import TypeForm

__all__ = ["INGEST_BODY_SCHEMA", "IngestResponse", "RunsResponse", "SummaryResponse", "AlertsResponse"]

_PY: dict[str, type] = {"int": int, "float": float, "str": str}


def _section_model(section: str) -> type[BaseModel]:
    # Any: the values are (annotation, FieldInfo) pairs, and a ``**`` dict passed to create_model must
    # also fit its ``__config__``/``__doc__``/... keyword parameters
    fields: dict[str, Any] = {}
    for f in SECTIONS[section][1]:
        py = _PY[f.type]
        # list[py] / list[py | None] | None, built at runtime (py is a value, not a type expression)
        t = GenericAlias(list, (py,)) if f.required else GenericAlias(list, (py | None,)) | None
        fields[f.name] = (t, Field(... if f.required else None, description=f.doc or None))
    return create_model(f"{section.title().replace('_', '')}Columns", __config__=ConfigDict(extra="forbid"), **fields)


def _optional(model: type[BaseModel]) -> TypeForm[BaseModel | None]:
    """``model | None`` as an annotation for create_model: mypy cannot see a model built at runtime as
    a type expression, so the union is a TypeForm by declaration."""
    return cast("TypeForm[BaseModel | None]", model | None)


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
    rank_steps=(_optional(_section_model("rank_steps")), None),
    collectives=(_optional(_section_model("collectives")), None),
    modality_tokens=(_optional(_section_model("modality_tokens")), None),
    phases=(_optional(_section_model("phases")), None),
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
    phases: int = 0
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
