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
    total: int | None = None
    """runs matching the filters (all pages)"""
    offset: int | None = None
    limit: int | None = None
    groups: list[dict[str, Any]] | None = None
    """with ``group_by``: one row per group (its keys, count, median_mfu, median_tokens_per_s_per_gpu, median_step_s)"""
    group_by: list[str] | None = None


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


class Goodput(BaseModel):
    """Wall time split into productive step time and what was lost, by category (docs/metrics.md "Goodput")."""

    model_config = ConfigDict(extra="allow")
    wall_s: float
    productive_s: float
    fraction: float | None
    lost: dict[str, float]


class SetApart(BaseModel):
    """Steps set apart from the steady-state basis for one reason (docs/metrics.md "Steady-state basis")."""

    reason: str = Field(description="compile | checkpoint | eval | warm-up | outlier")
    steps: list[int] = Field(description="their step numbers (at most 100 listed)")
    n: int = Field(description="how many")
    seconds: float = Field(description="their total step time")


class Basis(BaseModel):
    """The steps every figure of the summary is computed on (docs/metrics.md "Steady-state basis")."""

    steps: int = Field(description="steps the figures are over")
    of: int = Field(description="compacted steps of the run")
    set_apart: list[SetApart]
    rule: str
    fallback: str | None = Field(None, description="why every step was kept although some were marked")


class FlopsPerRankStep(BaseModel):
    """FLOPs one rank executes in one optimizer step (median over steps), and their source."""

    model_config = ConfigDict(extra="allow")
    model: float | None = None
    hardware: float | None = None
    source: str | None = None


class SummaryResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    goodput: Goodput | None = None
    run: RunOut
    rank_steps: int
    collective_records: int
    decomposition: Decomposition
    mfu: float | None
    tokens_per_s: float | None
    stragglers: list[Straggler]
    bottlenecks: list[Bottleneck]
    # every other key the summary returns (reports.run_summary; docs/api.md and docs/metrics.md describe them)
    steps: int | None = None
    basis: Basis | None = None
    phases: dict[str, Any] | None = Field(None, description="forward/backward/optimizer and custom phases: "
                                                                      "median seconds per step")
    comm_total_s: float | None = None
    overlap_ratio: float | None = None
    step_s_p50: float | None = None
    step_s_p95: float | None = None
    hfu: float | None = None
    recompute_overhead: float | None = None
    mfu_flag: str | None = None
    hfu_flag: str | None = None
    mfu_estimated: bool | None = None
    flops_source: str | None = None
    flops_per_rank_step: FlopsPerRankStep | None = None
    tokens_per_s_per_gpu: float | None = None
    packing_efficiency: float | None = None
    mem_peak_bytes: float | None = None
    alloc_retries: float | None = None
    memory: dict[str, Any] | None = Field(None, description="per-rank peaks, imbalance, fragmentation, OOMs")
    negative_residual_steps: int | None = None
    diagnosis: dict[str, Any] | None = Field(None, description="ranked causes of lost step time, with advice")
    compile: dict[str, Any] | None = Field(None, description="torch.compile recompiles and graph breaks")
    graph_collectives: dict[str, Any] | None = Field(None, description="collectives only the Flight Recorder saw")
    token_balance: dict[str, Any] | None = None
    network: dict[str, Any] | None = Field(None, description="slow ranks and nodes on the network")
    overlap_advice: list[Any] | None = None
    folded: dict[str, Any] | None = Field(None, description="records folded or dropped to keep the run within bounds")
    comm_by_dim: dict[str, Any] | None = Field(None, description="communication by parallel dimension")
    pipeline: dict[str, Any] | None = None
    parallel_findings: list[Any] | None = None
    seq_len_hist: dict[str, Any] | None = Field(None, description="sequence lengths (packing)")


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
