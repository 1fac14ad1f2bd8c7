"""SQLAlchemy 2 typed models of the store. Alembic (migrations/) owns the schema; these mirror it.

Layout (docs/architecture.md): each accepted batch lands as one ``ingest_fragments`` row holding its
records as compressed columnar blocks; the compactor folds each complete step into one ``steps``
row holding the cross-rank rollup columns plus a compressed columnar block of every rank's record. ``run_id`` leads
the primary key of every per-run table and is in every unique key, so those tables distribute on
Citus by run_id unchanged (``runs`` and the tables without a run id are reference tables;
tests/server/test_schema_catalog.py checks the migrated catalog).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, BIT, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "Run",
    "Rank",
    "IngestFragment",
    "ModalityRaw",
    "Step",
    "RunCollective",
    "RunModality",
    "RunEvent",
    "BenchmarkSeries",
    "BenchmarkPoint",
    "Alert",
    "AlertDelivery",
    "ApiToken",
    "TraceSummary",
]

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TZ = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Run(Base):
    """One training job; all ranks of the job share it (idempotent by name within its owner's namespace)."""

    __tablename__ = "runs"
    __table_args__ = (Index("ix_runs_started_at", "started_at"), UniqueConstraint("owner_key", "name", "attempt"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(256), index=True)
    model_family: Mapped[str | None] = mapped_column(String(128), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    config_signature: Mapped[str | None] = mapped_column(String(64))
    world_size: Mapped[int] = mapped_column(Integer, server_default="1")
    mp_size: Mapped[int] = mapped_column(Integer, server_default="1")
    device_type: Mapped[str | None] = mapped_column(String(64))
    device_count: Mapped[int | None] = mapped_column(Integer)
    peak_flops: Mapped[float | None] = mapped_column(Double)
    git_commit: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), server_default="running")
    meta: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    started_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    finished_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    last_seen_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    owner_token_id: Mapped[int | None] = mapped_column(Integer)
    """the api_tokens.id that registered the run (None: before migration 0005, or auth disabled)"""
    owner_key: Mapped[str] = mapped_column(Text, server_default="")
    """whose namespace the name lives in: 'team:<team>', 'token:<id>', or '' (no owner; migration 0013)"""
    # per-run rollup counters, maintained by the compactor
    rank_steps: Mapped[int] = mapped_column(BigInteger, server_default="0")
    collective_records: Mapped[int] = mapped_column(BigInteger, server_default="0")
    steps: Mapped[int] = mapped_column(Integer, server_default="0")
    last_step: Mapped[int | None] = mapped_column(Integer)
    thinned: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    """what retention removed: {"blocks": iso time, "rollups": iso time} (migration 0008)"""
    job_id: Mapped[str | None] = mapped_column(String(128), index=True)
    """the job this run is an attempt of (runs of one owner with the same job id; migration 0016)"""
    attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    """0 for the first attempt of a job, k for its k-th restart: part of the run's identity"""


class Rank(Base):
    __tablename__ = "ranks"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str | None] = mapped_column(String(256))
    node: Mapped[str | None] = mapped_column(String(256))
    local_rank: Mapped[int | None] = mapped_column(Integer)
    device: Mapped[str | None] = mapped_column(String(128))


class IngestFragment(Base):
    """Landing zone: one row per accepted batch, its records as compressed columnar blocks.

    Ingest writes one small row per batch (no per-record rows); the compactor decodes fragments,
    folds complete steps into ``steps`` and rewrites what is left. Duplicates are removed there."""

    __tablename__ = "ingest_fragments"
    # explicit PK: keeps run_id first in the DDL (Citus); the plain index on id serves the
    # compactor's ORDER BY id LIMIT and DELETE ... WHERE id = ANY(...)
    __table_args__ = (PrimaryKeyConstraint("run_id", "id"), Index("ix_ingest_fragments_id", "id"))
    run_id: Mapped[int] = mapped_column(Integer)
    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)  # BIGSERIAL, unique on its own
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    n_rank_steps: Mapped[int] = mapped_column(Integer)
    n_collectives: Mapped[int] = mapped_column(Integer)
    step_min: Mapped[int] = mapped_column(Integer)
    step_max: Mapped[int] = mapped_column(Integer)
    rank_steps: Mapped[bytes | None] = mapped_column(LargeBinary)
    collectives: Mapped[bytes | None] = mapped_column(LargeBinary)


class ModalityRaw(Base):
    """Landing zone for per-modality token counts (COPY at ingest). A retried batch lands its rows
    again: the compactor keeps the first copy of each (run, step, rank, modality), so the primary
    key is a surrogate ``(run_id, id)``, not that natural key."""

    __tablename__ = "modality_raw"
    __table_args__ = (PrimaryKeyConstraint("run_id", "id"),)
    run_id: Mapped[int] = mapped_column(Integer)
    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)  # BIGSERIAL
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    modality: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class Step(Base):
    """One row per (run, step): cross-rank rollup columns + the compressed per-rank block."""

    __tablename__ = "steps"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    n_ranks: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float | None] = mapped_column(Double)
    step_s: Mapped[float | None] = mapped_column(Double)  # cross-rank median
    data_s: Mapped[float | None] = mapped_column(Double)
    compute_s: Mapped[float | None] = mapped_column(Double)
    comm_exposed_s: Mapped[float | None] = mapped_column(Double)
    other_s: Mapped[float | None] = mapped_column(Double)
    comm_total_s: Mapped[float | None] = mapped_column(Double)
    forward_s: Mapped[float | None] = mapped_column(Double)
    backward_s: Mapped[float | None] = mapped_column(Double)
    optimizer_s: Mapped[float | None] = mapped_column(Double)
    step_s_max: Mapped[float | None] = mapped_column(Double)
    work_s: Mapped[float | None] = mapped_column(Double)  # median over ranks of step - exposed comm
    work_s_max: Mapped[float | None] = mapped_column(Double)
    slowest_rank: Mapped[int | None] = mapped_column(Integer)
    tokens: Mapped[float | None] = mapped_column(Double)  # sums over ranks
    padded_tokens: Mapped[float | None] = mapped_column(Double)
    samples: Mapped[float | None] = mapped_column(Double)
    flops: Mapped[float | None] = mapped_column(Double)
    mem_peak_bytes: Mapped[float | None] = mapped_column(Double)  # max over ranks
    mem_reserved_bytes: Mapped[float | None] = mapped_column(Double)
    alloc_retries: Mapped[float | None] = mapped_column(Double)  # sum over ranks
    neg_residual: Mapped[int] = mapped_column(Integer, server_default="0")
    coll_records: Mapped[int] = mapped_column(Integer, server_default="0")
    ranks: Mapped[str] = mapped_column(BIT(varying=True))  # bit r set = rank r present
    block: Mapped[bytes] = mapped_column(LargeBinary)
    coll_block: Mapped[bytes | None] = mapped_column(LargeBinary)
    hw_flops: Mapped[float | None] = mapped_column(Double)  # sum over ranks; flops = model FLOPs (migration 0009)


class RunCollective(Base):
    """Per-run rollup of collectives by (op, group size, message-size bucket)."""

    __tablename__ = "run_collectives"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    op: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    group_size: Mapped[int] = mapped_column(Integer, primary_key=True)
    size_bucket: Mapped[int] = mapped_column(SmallInteger, primary_key=True)  # floor(log2(bytes/call))
    dim: Mapped[int] = mapped_column(Integer, primary_key=True, server_default="0")  # codec.dim_code; 0: unknown
    records: Mapped[int] = mapped_column(BigInteger)
    calls: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[float] = mapped_column(Double)
    total_s: Mapped[float] = mapped_column(Double)
    exposed_s: Mapped[float] = mapped_column(Double)


class PhaseRaw(Base):
    """Landing queue of custom phase times (like ``modality_raw``: surrogate key, first copy wins)."""

    __tablename__ = "phase_raw"
    __table_args__ = (PrimaryKeyConstraint("run_id", "id"),)
    run_id: Mapped[int] = mapped_column(Integer)
    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)  # BIGSERIAL
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(64))
    seconds: Mapped[float] = mapped_column(Double)
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class RunPhase(Base):
    """Custom phase seconds per step, summed over the ranks in ``ranks`` (a bit string)."""

    __tablename__ = "run_phases"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    phase: Mapped[str] = mapped_column(String(64), primary_key=True)
    seconds: Mapped[float] = mapped_column(Double)
    ranks: Mapped[str] = mapped_column(BIT(varying=True))


class RunDim(Base):
    """The names of a run's parallel dimensions, by the code collective blocks store."""

    __tablename__ = "run_dims"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    code: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))


class StepComm(Base):
    """Per step and dimension: cross-rank medians of the per-rank communication sums (dim -1: send/recv)."""

    __tablename__ = "step_comm"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    dim: Mapped[int] = mapped_column(Integer, primary_key=True)
    calls: Mapped[float] = mapped_column(Double)
    bytes: Mapped[float] = mapped_column(Double)
    total_s: Mapped[float] = mapped_column(Double)
    exposed_s: Mapped[float] = mapped_column(Double)


class RunModality(Base):
    __tablename__ = "run_modalities"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    modality: Mapped[str] = mapped_column(String(64), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger)
    ranks: Mapped[str] = mapped_column(BIT(varying=True))


class RunEvent(Base):
    __tablename__ = "run_events"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    ts: Mapped[float | None] = mapped_column(Double)
    step: Mapped[int | None] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")


class BenchmarkSeries(Base):
    __tablename__ = "benchmark_series"
    __table_args__ = (UniqueConstraint("owner_key", "name", "cluster", "params_key",
                                       name="uq_benchmark_series_owner_name_cluster_params_key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner_key: Mapped[str] = mapped_column(Text, server_default="")
    name: Mapped[str] = mapped_column(String(128))
    cluster: Mapped[str] = mapped_column(String(128))
    params_key: Mapped[str] = mapped_column(String(256))
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    unit: Mapped[str] = mapped_column(String(32))


class BenchmarkPoint(Base):
    __tablename__ = "benchmark_points"
    series_id: Mapped[int] = mapped_column(
        ForeignKey("benchmark_series.id", ondelete="CASCADE"), primary_key=True
    )
    ts: Mapped[dt.datetime] = mapped_column(TZ, primary_key=True)
    value: Mapped[float] = mapped_column(Double)
    git_commit: Mapped[str | None] = mapped_column(String(64))


class Alert(Base):
    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_state", "state"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dedup_key: Mapped[str] = mapped_column(String(256), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    metric: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), server_default="firing")
    run_id: Mapped[int | None] = mapped_column(Integer)
    before: Mapped[float | None] = mapped_column(Double)
    after: Mapped[float | None] = mapped_column(Double)
    change: Mapped[float | None] = mapped_column(Double)
    significance: Mapped[float | None] = mapped_column(Double)
    first_bad: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    url: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    acknowledged_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    resolved_at: Mapped[dt.datetime | None] = mapped_column(TZ)


class AlertDelivery(Base):
    """What one sink (``slack``, ``webhook``, ``alertmanager``) was last told about one alert (migration
    0019, server/store/alert_deliveries.py): a reference table on Citus, like ``alerts``."""

    __tablename__ = "alert_deliveries"
    alert_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    sink: Mapped[str] = mapped_column(String(16), primary_key=True)
    seq: Mapped[int | None] = mapped_column(Integer)
    """the last transition told: 3 × reopens + 0 fired / 1 acknowledged / 2 resolved"""
    state: Mapped[str | None] = mapped_column(String(16))
    told_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claimed_until: Mapped[dt.datetime | None] = mapped_column(TZ)
    updated_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class ApiToken(Base):
    """API tokens, stored as SHA-256 hashes only."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint("scope IN ('ingest', 'read', 'admin')", name="scope"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(String(16), server_default="ingest")
    team: Mapped[str | None] = mapped_column(Text)
    """tokens of one team share their runs (migration 0013)"""
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    last_used_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    expires_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(TZ)


class TraceSummary(Base):
    """Reduced Kineto trace attached to a run (issue #7)."""

    __tablename__ = "trace_summaries"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String(512), primary_key=True)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


# --- analysis rollups (issue #6; migration 0002) -------------------------------------------------


class RankRollup(Base):
    """Per-(run, rank) straggler rollup, folded at compaction (server/analysis/rollups.py).

    ``hist`` counts steps by the rank's work ratio (rank work_s / the step's median work_s) in
    log-spaced bins (int32 little-endian); sums are over the rank's compacted steps."""

    __tablename__ = "rank_rollups"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(Integer, server_default="0")
    above: Mapped[int] = mapped_column(Integer, server_default="0")  # steps with ratio > 1.05
    hist: Mapped[bytes | None] = mapped_column(LargeBinary)
    slowdown: Mapped[float | None] = mapped_column(Double)  # median ratio from hist, kept at fold time
    work_s: Mapped[float] = mapped_column(Double, server_default="0")
    step_s: Mapped[float] = mapped_column(Double, server_default="0")
    data_s: Mapped[float] = mapped_column(Double, server_default="0")
    excess_s: Mapped[float] = mapped_column(Double, server_default="0")  # Σ work - step median work
    data_excess_s: Mapped[float] = mapped_column(Double, server_default="0")
    compute_excess_s: Mapped[float] = mapped_column(Double, server_default="0")
    other_excess_s: Mapped[float] = mapped_column(Double, server_default="0")
    lost_s: Mapped[float] = mapped_column(Double, server_default="0")  # Σ max - median where slowest
    slowest_steps: Mapped[int] = mapped_column(Integer, server_default="0")
    late_s: Mapped[float] = mapped_column(Double, server_default="0")  # Σ collective lateness
    late_n: Mapped[int] = mapped_column(Integer, server_default="0")
    last_arrivals: Mapped[int] = mapped_column(Integer, server_default="0")


class RankWindow(Base):
    """Per-(run, rank, window of steps) counts: is the rank's median ratio above 1.05 in that window."""

    __tablename__ = "rank_windows"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    win: Mapped[int] = mapped_column(Integer, primary_key=True)  # step // WINDOW_STEPS
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(Integer, server_default="0")
    above: Mapped[int] = mapped_column(Integer, server_default="0")
    ratio_sum: Mapped[float] = mapped_column(Double, server_default="0")  # Σ min(ratio, 3)
    excess_s: Mapped[float] = mapped_column(Double, server_default="0")


class RunStat(Base):
    """Cached per-run summary figures (regression series, scaling, compare); recomputed when stale."""

    __tablename__ = "run_stats"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank_steps: Mapped[int] = mapped_column(BigInteger)  # the run's rank_steps when computed
    status: Mapped[str] = mapped_column(String(16))
    stats: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    computed_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


__all__ += ["RankRollup", "RankWindow", "RunStat"]


# --- kernel hotspots (migration 0009; server/analysis/kernels.py) ----------------------------------


class RunKernelName(Base):
    """A run's kernel names, once each (migration 0012): at most ``analysis.kernels.MAX_NAMES`` plus the
    per-category "other" rows."""

    __tablename__ = "run_kernel_names"
    __table_args__ = (UniqueConstraint("run_id", "name"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(512))
    category: Mapped[str] = mapped_column(String(16))


class RunKernel(Base):
    """Per-(run, rank, kernel name id) sums over the rank's sampled trace windows."""

    __tablename__ = "run_kernels"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    name_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # run_kernel_names.id
    time_us: Mapped[float] = mapped_column(Double)  # summed kernel time over the windows
    launches: Mapped[int] = mapped_column(BigInteger)
    windows: Mapped[int] = mapped_column(Integer)  # windows the kernel appears in
    first_us: Mapped[float] = mapped_column(Double)  # per profiled step, in the rank's first window
    last_us: Mapped[float] = mapped_column(Double)  # per profiled step, in the rank's last window


class RunKernelRank(Base):
    """Per-(run, rank) totals of the folded windows."""

    __tablename__ = "run_kernel_ranks"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    windows: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)  # profiled steps over the windows
    kernel_us: Mapped[float] = mapped_column(Double)
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)


class RunKernelWindow(Base):
    """A ``trace_summary`` event (run, rank, seq) already folded into ``run_kernels``."""

    __tablename__ = "run_kernel_windows"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)


__all__ += ["RunKernelName", "RunKernel", "RunKernelRank", "RunKernelWindow"]


# --- node health (migration 0010; server/analysis/network.py, server/reports/network.py) ----------


class RunNodeHealth(Base):
    """Per-(run, node) health, written when the run's network health is computed (its summary, or the
    node history catching up): the node's ranks, how many were stragglers / network-slow, whether the
    node was network-slow, its median busbw and latency ratios, at the run's ``rank_steps`` /
    ``status`` then. ``GET /api/v1/nodes`` aggregates these rows per node."""

    __tablename__ = "run_node_health"
    __table_args__ = (Index("ix_run_node_health_node", "node"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[str] = mapped_column(String(256), primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)
    straggler_ranks: Mapped[int] = mapped_column(Integer)
    slow_ranks: Mapped[int] = mapped_column(Integer)
    slow_network: Mapped[bool] = mapped_column(Boolean)
    busbw_ratio: Mapped[float | None] = mapped_column(Double)  # median of its ranks' (None: not measured)
    latency_ratio: Mapped[float | None] = mapped_column(Double)
    rank_steps: Mapped[int] = mapped_column(BigInteger)  # the run's rank_steps when computed
    status: Mapped[str] = mapped_column(String(16))  # the run's status when computed
    seen_at: Mapped[dt.datetime | None] = mapped_column(TZ)  # the run's last activity
    computed_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


__all__ += ["RunNodeHealth"]


class RunRankModality(Base):
    """Per-(run, rank, modality) tokens summed over steps, folded from ``modality_raw`` at compaction
    (migration 0011; token balance, server/analysis/tokens.py)."""

    __tablename__ = "run_rank_modalities"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    modality: Mapped[str] = mapped_column(String(64), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)  # steps the rank had tokens of this modality


__all__ += ["RunRankModality"]


# --- cardinality bounds (migration 0014; server/limits.py, server/store/bounds.py) ---------------------


class RunName(Base):
    """A name a run keeps under a bound of ``server/limits.py``: kind ``phase`` (custom phase names,
    admitted at compaction) or ``node`` (host / node names, admitted at ingest)."""

    __tablename__ = "run_names"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(256), primary_key=True)


class RunFolded(Base):
    """Records of a run folded or dropped to keep one bound (``store.bounds.BOUNDS``), summed."""

    __tablename__ = "run_folded"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    bound: Mapped[str] = mapped_column(String(64), primary_key=True)
    records: Mapped[int] = mapped_column(BigInteger)


__all__ += ["RunName", "RunFolded"]


# --- run groups and event counts (migration 0015; server/groups.py, server/store/events.py) ---------------


class RunGroup(Base):
    """A process group a run's ``comm_group`` events describe, stored once (not once per rank): its size
    and ranks as ``start``/``stride`` (an arithmetic progression) or ``ranks`` (a compressed int32 list
    of ``listed`` ranks); ``key`` is a digest of the membership."""

    __tablename__ = "run_groups"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    dim: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    size: Mapped[int] = mapped_column(Integer)
    start: Mapped[int | None] = mapped_column(Integer)
    stride: Mapped[int | None] = mapped_column(Integer)
    listed: Mapped[int] = mapped_column(Integer)
    ranks: Mapped[bytes | None] = mapped_column(LargeBinary)
    name: Mapped[str | None] = mapped_column(String(64))


class RunEventCount(Base):
    """Per run and event kind: ``run_events`` rows stored, events dropped beyond a cap, events stored
    folded. Kind ``''`` is the run's total; kind ``comm_group`` counts ``run_groups`` rows."""

    __tablename__ = "run_event_counts"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(64), primary_key=True)
    stored: Mapped[int] = mapped_column(BigInteger, server_default="0")
    dropped: Mapped[int] = mapped_column(BigInteger, server_default="0")
    folded: Mapped[int] = mapped_column(BigInteger, server_default="0")


__all__ += ["RunGroup", "RunEventCount"]


# ------------------------------------------------------------------ run health (migration 0016)


class RunPosition(Base):
    """The latest position one rank reported (``position`` events): one row per (run, rank), overwritten."""

    __tablename__ = "run_positions"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float | None] = mapped_column(Double)
    step: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str | None] = mapped_column(String(16))
    phase: Mapped[str | None] = mapped_column(String(64))
    open_s: Mapped[float | None] = mapped_column(Double)
    coll_op: Mapped[str | None] = mapped_column(String(64))
    coll_dim: Mapped[str | None] = mapped_column(String(64))
    coll_group: Mapped[str | None] = mapped_column(String(128))
    coll_seq: Mapped[int | None] = mapped_column(BigInteger)
    coll_bytes: Mapped[int | None] = mapped_column(BigInteger)
    coll_since_s: Mapped[float | None] = mapped_column(Double)
    coll_done: Mapped[bool | None] = mapped_column(Boolean)
    stack: Mapped[Any | None] = mapped_column(JSONB)
    source: Mapped[str | None] = mapped_column(String(32))
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class RunFailure(Base):
    """A rank's failure (``failure`` events): at most one per (run, rank, source)."""

    __tablename__ = "run_failures"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String(16), primary_key=True)
    ts: Mapped[float | None] = mapped_column(Double)
    step: Mapped[int | None] = mapped_column(BigInteger)
    exception: Mapped[str | None] = mapped_column(String(256))
    message: Mapped[str | None] = mapped_column(Text)
    frames: Mapped[Any | None] = mapped_column(JSONB)
    phase: Mapped[str | None] = mapped_column(String(64))
    signal: Mapped[str | None] = mapped_column(String(32))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class RunPause(Base):
    """Declared pauses per (run, rank, reason): the open one (``open_since``) and the time in ended ones."""

    __tablename__ = "run_pauses"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    reason: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, server_default="-1")
    """the last pause event of this rank and reason applied (a re-sent batch is not counted twice)"""
    open_since: Mapped[float | None] = mapped_column(Double)
    expected_s: Mapped[float | None] = mapped_column(Double)
    total_s: Mapped[float] = mapped_column(Double, server_default="0")
    count: Mapped[int] = mapped_column(Integer, server_default="0")
    received_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


class RunHealth(Base):
    """What the health pass last concluded about a run, and the last progress it saw."""

    __tablename__ = "run_health"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), server_default="running")
    since: Mapped[dt.datetime | None] = mapped_column(TZ)
    finding: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    progress_at: Mapped[dt.datetime | None] = mapped_column(TZ)
    hang_s: Mapped[float] = mapped_column(Double, server_default="0")
    updated_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())


__all__ += ["RunPosition", "RunFailure", "RunPause", "RunHealth"]


# ------------------------------------------------------------------ training scalars (migration 0017)


class RunScalarName(Base):
    """A scalar name a run logged (``run.log``), once: at most ``MAX_SCALAR_NAMES_PER_RUN`` per run, with
    its last value and minimum (``scalar.NAME.last`` / ``.min`` in run filters)."""

    __tablename__ = "run_scalar_names"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    """the highest step logged, and at it the lowest rank and its value (kept at ingest)"""
    last_rank: Mapped[int | None] = mapped_column(Integer)
    last_value: Mapped[float | None] = mapped_column(Double)
    min_value: Mapped[float | None] = mapped_column(Double)


class RunScalar(Base):
    """One training-scalar value per (run, name, step, rank), the first logged (``store/scalars.py``)."""

    __tablename__ = "run_scalars"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    value: Mapped[float] = mapped_column(Double)


__all__ += ["RunScalarName", "RunScalar"]


# --- pinned regression baselines (migration 0020; server/store/baselines.py) ---------------------


class Baseline(Base):
    """The run a namespace pinned as the regression baseline of a family and config signature."""

    __tablename__ = "baselines"
    owner_key: Mapped[str] = mapped_column(Text, primary_key=True, server_default="")
    model_family: Mapped[str] = mapped_column(String(128), primary_key=True)
    config_signature: Mapped[str] = mapped_column(String(64), primary_key=True)
    # nullable: a reference table on Citus (a NOT NULL run_id would make it a per-run table)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    pinned_at: Mapped[dt.datetime] = mapped_column(TZ, server_default=func.now())
    pinned_by: Mapped[str | None] = mapped_column(String(128))


# --- device telemetry (migration 0021; server/store/devices.py) ----------------------------------


class RunDevice(Base):
    """One window of one rank's device telemetry (the agent's ``device`` events, NVML on the sender thread)."""

    __tablename__ = "run_devices"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    t_ms: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    """the window's start, wall clock in milliseconds"""
    window_s: Mapped[float] = mapped_column(REAL)
    samples: Mapped[int] = mapped_column(Integer)
    sm_clock_min: Mapped[float | None] = mapped_column(REAL)
    sm_clock_mean: Mapped[float | None] = mapped_column(REAL)
    sm_clock_max: Mapped[float | None] = mapped_column(REAL)
    mem_clock_mean: Mapped[float | None] = mapped_column(REAL)
    power_mean: Mapped[float | None] = mapped_column(REAL)
    power_max: Mapped[float | None] = mapped_column(REAL)
    power_limit: Mapped[float | None] = mapped_column(REAL)
    temp_mean: Mapped[float | None] = mapped_column(REAL)
    temp_max: Mapped[float | None] = mapped_column(REAL)
    util_mean: Mapped[float | None] = mapped_column(REAL)
    mem_used_max: Mapped[int | None] = mapped_column(BigInteger)
    throttle: Mapped[int] = mapped_column(Integer, server_default="0")
    """bit mask over ``device_wire.REASONS``"""
    throttled_s: Mapped[float] = mapped_column(REAL, server_default="0")
    """seconds any slowing reason (``device_wire.THROTTLING``) was active"""
    throttle_s: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    ecc_errors: Mapped[int | None] = mapped_column(Integer)
    xid: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    step: Mapped[int | None] = mapped_column(BigInteger)
    source: Mapped[str] = mapped_column(String(16), server_default="agent")
    """'agent' (NVML in the job) or 'dcgm' (read from dcgm-exporter / Prometheus by the server; migration 0024)"""


__all__ += ["RunDevice"]


# --- projections asked of a run (migration 0023; server/store/projections.py) --------------------


class RunProjection(Base):
    """A projection asked of a run at a target layout: the first projected figures (what the track
    record checks against the runs that followed) and the latest."""

    __tablename__ = "run_projections"
    __table_args__ = (PrimaryKeyConstraint("run_id", "world_size", "tp", "pp", "micro_batches", "bucket_bytes",
                                           "hold_global_batch"),
                      Index("ix_run_projections_family", "model_family", "signature"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    world_size: Mapped[int] = mapped_column(Integer, autoincrement=False)
    tp: Mapped[int] = mapped_column(Integer, autoincrement=False)
    pp: Mapped[int] = mapped_column(Integer, autoincrement=False)
    micro_batches: Mapped[int] = mapped_column(Integer, autoincrement=False)
    """0: as the run (or not pipelined)"""
    bucket_bytes: Mapped[int] = mapped_column(BigInteger, autoincrement=False)
    """0: as the run"""
    hold_global_batch: Mapped[bool] = mapped_column(Boolean)
    owner_key: Mapped[str] = mapped_column(Text, server_default="")
    model_family: Mapped[str | None] = mapped_column(String(128))
    signature: Mapped[str] = mapped_column(String(64))
    """``analysis.figures.scaling_signature`` of the config without its parallel-layout keys"""
    device_type: Mapped[str | None] = mapped_column(String(64))
    from_world_size: Mapped[int] = mapped_column(Integer)
    from_tp: Mapped[int] = mapped_column(Integer)
    from_pp: Mapped[int] = mapped_column(Integer)
    step_s: Mapped[float] = mapped_column(Double)
    mfu: Mapped[float | None] = mapped_column(Double)
    tokens_per_s: Mapped[float | None] = mapped_column(Double)
    error_rel: Mapped[float | None] = mapped_column(Double)
    latest_step_s: Mapped[float] = mapped_column(Double)
    requests: Mapped[int] = mapped_column(Integer, server_default="1")
    first_at: Mapped[dt.datetime] = mapped_column(TZ)
    last_at: Mapped[dt.datetime] = mapped_column(TZ)


__all__ += ["RunProjection"]
