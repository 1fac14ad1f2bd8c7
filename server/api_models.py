"""Response models of the read and write API routes that had none (docs/api.md): every key a route
returns is declared (more may be added later: ``extra="allow"``); nested analyses whose fields are
documented in docs/metrics.md and docs/api.md are objects. Fields are optional where a route leaves
them null for a run without that data."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Health", "RunRegistered", "RunFinished", "RunDeleted", "RunDetail", "Collectives", "Scalars", "Steps",
           "BenchmarksRecorded", "BenchmarkSeries", "BenchmarkList", "TraceList", "RunCheck", "NodeRow", "NodeList",
           "NodeDetail", "Kernels", "Overlap", "RunHealthOut", "RankStepRow", "RankRollups", "RankSteps"]

_OPEN = ConfigDict(extra="allow")


class Health(BaseModel):
    model_config = _OPEN
    status: str = Field(description='"ok"')


class RunRegistered(BaseModel):
    model_config = _OPEN
    id: int
    name: str
    world_size: int | None = None
    created: bool | None = Field(None, description="false when the run existed (another rank registered it)")
    attempt: int | None = None
    job_id: str | None = None
    ingest_encodings: list[str] = Field(default_factory=list, description=(
        "Content-Encoding values POST /api/v1/ingest takes besides none (gzip, zstd): a client may use any"))


class RunFinished(BaseModel):
    model_config = _OPEN
    id: int
    status: str


class RunDeleted(BaseModel):
    model_config = _OPEN
    id: int
    deleted: Any = Field(None, description="what was deleted (rows by table)")


class RunDetail(BaseModel):
    """One run as stored (counters include what landed but is not compacted yet)."""

    model_config = _OPEN
    id: int
    name: str
    model_family: str | None = None
    config: dict[str, Any] | None = None
    config_signature: str | None = None
    world_size: int
    mp_size: int | None = None
    device_type: str | None = None
    device_count: int | None = None
    peak_flops: float | None = None
    git_commit: str | None = None
    status: str
    meta: dict[str, Any] | None = None
    started_at: str | None = None
    finished_at: str | None = None
    last_seen_at: str | None = None
    rank_steps: int
    collective_records: int
    steps: int
    last_step: int | None = None
    thinned: dict[str, Any] | None = None
    job_id: str | None = None
    attempt: int | None = None


class CollectiveRow(BaseModel):
    model_config = _OPEN
    op: str
    group_size: int | None = None
    size_bucket_bytes: int | float | None = None
    records: int | None = None
    calls: int | float | None = None
    bytes: int | float | None = None
    total_s: float | None = None
    exposed_s: float | None = None


class Collectives(BaseModel):
    collectives: list[CollectiveRow]


class ScalarSeries(BaseModel):
    model_config = _OPEN
    step: list[int | float | None]
    value: list[float | int | None]


class Scalars(BaseModel):
    model_config = _OPEN
    scalars: dict[str, ScalarSeries]
    names: list[Any] | None = None


class Steps(BaseModel):
    model_config = _OPEN
    steps: list[Any] = Field(description="one object per step; its keys are `fields`")
    total: int | None = None
    offset: int | None = None
    limit: int | None = None
    fields: list[str] | None = None


class RankStepRow(BaseModel):
    """One step of one rank (seconds; null = not measured, or no record of the rank in the step) and the
    step's cross-rank median of each component (``median_*``)."""

    model_config = _OPEN
    step: int
    ts: float | None = None
    n_ranks: int | None = Field(None, description="ranks with a record in the step")
    present: bool = Field(description="the rank has a record in this step")
    step_s: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    comm_exposed_s: float | None = None
    other_s: float | None = None
    straggler_wait_s: float | None = Field(None, description="the slowest rank's work − this rank's (≥ 0)")
    work_s: float | None = Field(None, description="step_s − comm_exposed_s")
    work_ratio: float | None = Field(None, description="work_s ÷ the median rank's work_s")
    comm_total_s: float | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    median_step_s: float | None = None
    median_data_s: float | None = None
    median_compute_s: float | None = None
    median_comm_exposed_s: float | None = None
    median_other_s: float | None = None
    median_straggler_wait_s: float | None = Field(None, description="slowest rank's work − the median work (as /steps)")
    median_work_s: float | None = None
    median_comm_total_s: float | None = None
    median_forward_s: float | None = None
    median_backward_s: float | None = None
    median_optimizer_s: float | None = None


class RankRollups(BaseModel):
    """The rank's straggler rollups, summed over its compacted steps (docs/metrics.md, "Stragglers")."""

    model_config = _OPEN
    steps: int
    slowdown: float | None = Field(None, description="median over steps of its work ÷ the step's median work")
    excess_s: float | None = None
    data_excess_s: float | None = None
    compute_excess_s: float | None = None
    other_excess_s: float | None = None
    lost_s: float | None = None
    slowest_steps: int | None = None
    last_arrivals: int | None = None
    late_collectives: int | None = Field(None, description="its collectives whose lateness is known (start_ts)")
    lateness_s: float | None = Field(None, description="mean enqueue time − the earliest rank's, same collective; "
                                                       "null without start times")


class RankSteps(BaseModel):
    """``GET /runs/{id}/ranks/{rank}/steps``: one rank's decomposition per step against the median rank."""

    model_config = _OPEN
    run_id: int
    rank: int
    world_size: int
    host: str | None = None
    node: str | None = None
    local_rank: int | None = None
    device: str | None = None
    rollups: RankRollups | None = None
    steps: list[RankStepRow]
    total: int = Field(description="compacted steps of the run")
    offset: int
    limit: int = Field(description="rows asked for, as used: at most 1,000 and a cell budget over the run's width")
    fields: list[str]
    reduced: bool = Field(description="min/max-downsampled to max_points")
    points: int = Field(description="steps read (before downsampling)")
    sampled_every_steps: int = Field(description="1: every step read; k: every k-th (a run too large to read whole)")
    max_points: int | None = None


class BenchmarksRecorded(BaseModel):
    model_config = _OPEN
    series: list[int]
    points: int


class BenchmarkPoint(BaseModel):
    model_config = _OPEN
    ts: str
    value: float | None
    git_commit: str | None = None


class BenchmarkSeries(BaseModel):
    model_config = _OPEN
    id: int
    name: str
    cluster: str | None = None
    params: dict[str, Any] | None = None
    unit: str | None = None
    points: list[BenchmarkPoint]


class BenchmarkList(BaseModel):
    series: list[BenchmarkSeries]


class TraceList(BaseModel):
    model_config = _OPEN
    run_id: int
    traces: list[Any] = Field(description="per rank (rank -1: cross-rank figures): the trace summaries")


class RunCheck(BaseModel):
    model_config = _OPEN
    run: dict[str, Any]
    baseline: Any = None
    regressions: list[Any]
    regressed: bool
    min_change: float | None = None


class NodeRow(BaseModel):
    model_config = _OPEN
    node: str
    runs: int
    straggler_runs: int | None = None
    slow_network_runs: int | None = None
    slowed_runs: int | None = None
    slowed_share: float | None = None
    busbw_ratio_median: float | None = None
    latency_ratio_median: float | None = None
    last_seen: str | None = None
    microbench: Any = None


class NodeList(BaseModel):
    model_config = _OPEN
    nodes: list[NodeRow]
    total: int
    slowed_total: int | None = None
    slow_network_total: int | None = None
    limit: int | None = None
    offset: int | None = None
    refreshed_runs: int | None = None
    pending_runs: int | None = None


class NodeDetail(NodeRow):
    run_history: list[Any] = Field(default_factory=list)


class Kernels(BaseModel):
    model_config = _OPEN
    run_id: int
    ranks: int | None = None
    windows: int | None = None
    profiled_rank_steps: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    kernel_us: float | None = None
    names: int | None = None
    max_names: int | None = None
    categories: list[Any] = Field(default_factory=list)
    kernels: list[Any] = Field(default_factory=list)
    findings: list[Any] = Field(default_factory=list)
    folded_now: int | None = None


class Overlap(BaseModel):
    model_config = _OPEN
    run_id: int
    step: int | None = None
    rank: int | None = None
    step_s: float | None = None
    comm_exposed_s: float | None = None
    backward: Any = None
    collectives: list[Any] = Field(default_factory=list)
    collectives_total: int | None = None
    collectives_folded: Any = None
    tail_s: float | None = None
    overlap_ratio: float | None = None
    backward_overlap_ratio: float | None = None
    note: str | None = None


class RunHealthOut(BaseModel):
    """``GET /runs/{id}/health`` (docs/api.md, "Run health"): the run's state and, for a hang or a
    failure, who and where (nested objects as docs/api.md describes them)."""

    model_config = _OPEN
    run_id: int | None = None
    state: str = Field(description="running, stalled, hung, failed or finished")
    since: Any = None
    finding: str | None = None
    cause: str | None = Field(None, description="what ended or stopped the run: failure (a rank's own), node_lost "
                                                "(a node stopped without a word; the others lost their connection "
                                                "to it), hang; null while it runs")
    lost_nodes: list[Any] = Field(default_factory=list, description="with cause node_lost: [{node (null: ranks "
                                                                     "never heard of, node unknown), ranks, "
                                                                     "rank_count}]")
    settling: bool | None = Field(None, description="a failure that blames a peer, while the nodes not heard from "
                                                    "have time to report (its alert waits for it)")
    waiting: Any = None
    missing_ranks: list[Any] = Field(default_factory=list)
    missing_count: int | None = Field(None, description="every missing rank (missing_ranks lists the first 1,024)")
    missing_nodes: list[Any] = Field(default_factory=list)
    missing_nodes_count: int | None = Field(None, description="every missing or lost node (missing_nodes lists "
                                                              "the first 1,024)")
    collective: Any = None
    stacks: dict[str, Any] = Field(default_factory=dict)
    stuck: Any = None
    failures: list[Any] = Field(default_factory=list)
    failures_count: int | None = None
    failed_ranks: Any = None
    attempts: list[Any] = Field(default_factory=list)
    pause: Any = None
    threshold_s: float | None = None
    hang_s: float | None = None
    limits: Any = None


class BaselinePin(BaseModel):
    """``POST /api/v1/baselines``: the run to pin as its family's baseline."""

    run_id: int = Field(ge=1, le=2**31 - 1)


class BaselinePinned(BaseModel):
    model_config = _OPEN
    run_id: int
    name: str
    model_family: str
    config_signature: str


class BaselineList(BaseModel):
    model_config = _OPEN
    baselines: list[dict[str, Any]]


class CompareRuns(BaseModel):
    """``GET /api/v1/compare``: runs side by side in normalised units (docs/api.md, "Compare")."""

    model_config = _OPEN
    runs: list[dict[str, Any]] = Field(description="per run: figures, params / active_params, "
                                                   "param_tokens_per_s_per_gpu, samples_per_s_per_gpu, "
                                                   "modality_tokens_per_s, same_family (as the first run)")
    relative_to_first: dict[str, list[float | None]]
    config_diff: dict[str, list[Any]]
    missing: list[int]


class Projection(BaseModel):
    """``GET /runs/{id}/projection`` (docs/api.md "Projections"): estimated figures at another layout."""

    model_config = _OPEN
    run_id: int
    status: str = Field(description='"ok", or "insufficient_data" with what is missing')
    missing: list[str] = Field(default_factory=list)
    step_s: float | None = None
    mfu: float | None = None
    tokens_per_s: float | None = None
    parts: dict[str, float] | None = Field(None, description="data, compute, comm_exposed, other, bubble, straggler_wait")
    error_band: dict[str, Any] | None = None
    basis: dict[str, Any] | None = None
    target: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None


class ProjectionTrackRecord(BaseModel):
    """``GET /projections/track_record?family=``: recorded projections against the runs that followed."""

    model_config = _OPEN
    family: str
    summary: dict[str, Any]
    checked: list[dict[str, Any]]
    pending: list[dict[str, Any]]
    backtest: list[dict[str, Any]]
    backtest_summary: dict[str, Any]


__all__ += ["Projection", "ProjectionTrackRecord"]


class MemoryReport(BaseModel):
    """``GET /api/v1/runs/{id}/memory``: the summary's ``memory`` section plus memory per module."""

    model_config = _OPEN
    run_id: int
    modules: list[Any] = Field(default_factory=list)
    modules_rank: int | None = None
    breakdown: dict[str, Any] | None = None
    ranks: list[Any] = Field(default_factory=list)
    module_imbalance: dict[str, Any] | None = None
    checkpoint_advice: list[Any] = Field(default_factory=list)
    advice_note: str | None = None


class DeviceRank(BaseModel):
    """One rank's GPU telemetry (docs/api.md ``GET /runs/{id}/devices``; definitions in docs/metrics.md)."""

    model_config = _OPEN
    rank: int
    host: str | None = None
    node: str | None = None
    windows: int
    seconds: float | None = None
    sm_clock_mhz: float | None = None
    peers_sm_clock_mhz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temp_c_max: float | None = None
    util: float | None = None
    throttle: list[str] = Field(default_factory=list, description="throttle reason names seen")
    throttle_share: dict[str, float] = Field(default_factory=dict, description="{reason: share of the time active}")
    throttled_share: float = 0.0
    throttled: bool = False
    reason: str | None = Field(None, description="the slowing reason active longest, when throttled")
    xid: list[int] = Field(default_factory=list)
    ecc_errors: int = 0


class Devices(BaseModel):
    """``GET /api/v1/runs/{id}/devices``: per-rank GPU telemetry and the ranks to look at."""

    model_config = _OPEN
    run_id: int
    world_size: int | None = None
    ranks: list[DeviceRank]
    peers: dict[str, Any]
    throttled_ranks: list[int]
    error_ranks: list[int]
    throttled_share_min: float


class DeviceNode(BaseModel):
    model_config = _OPEN
    node: str
    runs: int
    runs_throttled: int
    throttled_s: float
    seconds: float
    xid_windows: int
    ecc_errors: int


class DeviceNodes(BaseModel):
    """``GET /api/v1/devices/nodes``: nodes ranked by GPU trouble across the runs the reader sees."""

    model_config = _OPEN
    nodes: list[DeviceNode]


__all__ += ["DeviceRank", "Devices", "DeviceNode", "DeviceNodes"]
