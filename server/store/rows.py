"""The typed rows the store returns: plain dataclasses of Python values and numpy arrays.

Pure (no database imports), so the analysis functions that take them stay free of the store."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RunRow", "StepFrame", "RunAggregate", "CollectiveRow", "StepCommRow", "P2P", "RankRollups"]


@dataclass(frozen=True, slots=True)
class RunRow:
    """One ``runs`` row. Times are ISO 8601 strings; counters are the compacted ones."""

    id: int
    name: str
    model_family: str | None
    config: dict[str, Any] | None
    config_signature: str | None
    world_size: int
    mp_size: int
    device_type: str | None
    device_count: int | None
    peak_flops: float | None
    git_commit: str | None
    status: str
    meta: dict[str, Any] | None
    started_at: str | None
    finished_at: str | None
    last_seen_at: str | None
    rank_steps: int
    collective_records: int
    steps: int
    last_step: int | None
    pending_rank_steps: int = 0
    pending_collectives: int = 0
    thinned: dict[str, Any] | None = None  # what retention removed ({"blocks": iso, "rollups": iso})
    job_id: str | None = None  # the job this run is an attempt of (migration 0016)
    attempt: int = 0  # 0 = the job's first attempt, k = its k-th restart
    owner_key: str = ""  # the run's namespace (migration 0013): 'team:<t>', 'token:<id>', '' without owner

    @property
    def version(self) -> tuple[int, int, int, int | None, str, int]:
        """Changes whenever compaction folds data into the run, its status changes or retention thins
        it (cache key)."""
        return (self.rank_steps, self.collective_records, self.steps, self.last_step, self.status,
                len(self.thinned or ()))

    def as_dict(self) -> dict[str, Any]:
        """The run as the API shows it: counters include what landed but is not compacted yet."""
        return {
            "id": self.id, "name": self.name, "model_family": self.model_family, "config": self.config,
            "config_signature": self.config_signature, "world_size": self.world_size, "mp_size": self.mp_size,
            "device_type": self.device_type, "device_count": self.device_count, "peak_flops": self.peak_flops,
            "git_commit": self.git_commit, "status": self.status, "meta": self.meta, "started_at": self.started_at,
            "finished_at": self.finished_at, "last_seen_at": self.last_seen_at,
            "rank_steps": self.rank_steps + self.pending_rank_steps,
            "collective_records": self.collective_records + self.pending_collectives,
            "steps": self.steps, "last_step": self.last_step, "thinned": self.thinned,
            "job_id": self.job_id, "attempt": self.attempt,
        }  # fmt: skip


@dataclass(frozen=True)
class StepFrame:
    """Per-step columns of one run as float64 numpy arrays ordered by step (NaN = not measured)."""

    columns: Mapping[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def __len__(self) -> int:
        return len(self.columns["step"]) if "step" in self.columns else 0

    @property
    def steps(self) -> np.ndarray:
        return self.columns["step"]


@dataclass(frozen=True, slots=True)
class RunAggregate:
    """Aggregates over a run's compacted steps (None where no step measured the column)."""

    n: int
    step_s: float | None  # median over steps of the cross-rank median
    step_s_max_p95: float | None  # p95 over steps of the slowest rank's step time
    data_s: float | None
    compute_s: float | None
    comm_exposed_s: float | None
    other_s: float | None
    comm_total_s: float | None
    forward_s: float | None  # the compute phases the agent times (None when no step measured them)
    backward_s: float | None
    optimizer_s: float | None
    straggler_wait_s: float | None  # median of max − median work
    sum_step_s: float | None
    sum_data_s: float | None
    sum_compute_s: float | None
    sum_comm_exposed_s: float | None
    sum_other_s: float | None
    sum_comm_total_s: float | None
    sum_wait_s: float | None
    sum_wait_in_comm_s: float | None
    flops_per_dev_s: float | None
    tokens_per_s_raw: float | None
    tokens_per_rank_step: float | None
    tokens_per_step: float | None
    n_ranks: float | None
    sum_tokens: float | None
    sum_padded_tokens: float | None
    mem_peak_bytes: float | None
    alloc_retries: float | None
    neg_residual_steps: float | None
    skew_p50: float | None
    skew_p95: float | None
    skew_max: float | None
    first_ts: float | None
    last_ts: float | None
    # hardware FLOPs (HFU); the model FLOPs and token sums of the steps that measured them (recompute overhead)
    hw_flops_per_dev_s: float | None = None
    sum_hw_flops: float | None = None
    sum_flops_with_hw: float | None = None
    sum_tokens_with_hw: float | None = None
    sum_padded_with_hw: float | None = None
    # FLOPs one rank executes in one step (model / hardware): median over steps of the ranks' mean
    flops_per_rank_step: float | None = None
    hw_flops_per_rank_step: float | None = None


@dataclass(frozen=True, slots=True)
class CollectiveRow:
    """One (op, group size, log2 bytes-per-call bucket) of a run, summed over its records."""

    op: str
    group_size: int
    size_bucket: int  # log2 of the bytes per call, floored
    records: int
    calls: int
    bytes: float
    total_s: float
    exposed_s: float
    dim: str | None = None  # the parallel dimension (None: not named by the sender)


P2P = "<p2p>"
"""``StepCommRow.dim`` of the per-step row that sums a rank's send/recv calls of any dimension."""


@dataclass(frozen=True)
class StepCommRow:
    """One step × dimension: cross-rank medians of the per-rank sums (``step_comm``)."""

    step: int
    dim: str | None
    calls: float
    bytes: float
    total_s: float
    exposed_s: float


@dataclass(frozen=True)
class RankRollups:
    """One array per ``ROLLUP_COLUMNS`` entry (one row per rank with steps), plus the windows in which a
    rank's median work ratio was above the threshold and how many full windows each rank has."""

    arr: dict[str, np.ndarray]
    flagged_windows: dict[int, list[tuple[int, float]]]
    n_windows: dict[int, int]
