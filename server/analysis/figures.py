"""Per-run figures (docs/metrics.md): every number the API and the dashboard show about a run, each
defined once here, from the run's row and its aggregates over steps (``store.aggregates``).

Every figure is over the run's steady-state steps (``analysis.steady``: compile, checkpoint, eval,
warm-up and outlier steps set apart); ``RunFigures.basis`` says which, and ``steps`` counts them all.

The per-step quantities (FLOPs per device-second, raw tokens/s, straggler wait) are the SQL
expressions of ``store.steps.PER_STEP``; the run's constants are applied here: :func:`mfu`,
:func:`tokens_per_s`, :func:`step_s_per_1k_tokens`, :func:`overlap_ratio`, :func:`component_shares`,
:func:`amdahl_ceiling`. The same functions turn per-step series into per-step figures for charts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

import numpy as np

from ..store.rows import RunAggregate, RunRow
from .steady import SteadyBasis

__all__ = [
    "RunFigures",
    "FIGURES_VERSION",
    "COMPONENTS",
    "COMPONENT_LABELS",
    "SHARE_KEYS",
    "METRICS",
    "run_figures",
    "mfu",
    "plausible_utilisation",
    "recompute_overhead",
    "tokens_per_s",
    "step_s_per_1k_tokens",
    "overlap_ratio",
    "component_shares",
    "amdahl_ceiling",
    "scaling_signature",
    "comparable_key",
]

#: bumped when a figure's definition changes: cached figures of another version are recomputed
FIGURES_VERSION = 6  # 6: the steady-state basis

#: the step-time components in stacking order: (decomposition key, label)
COMPONENTS = (("data_s", "data"), ("compute_s", "compute"), ("comm_exposed_s", "exposed comm"), ("other_s", "other"))
COMPONENT_LABELS = dict(COMPONENTS) | {"straggler_wait_s": "straggler wait"}
#: share names (``component_shares``) -> decomposition key
SHARE_KEYS = {"data": "data_s", "compute": "compute_s", "comm_exposed": "comm_exposed_s", "other": "other_s",
              "straggler_wait": "straggler_wait_s"}

#: metrics compared across runs (regressions, ``check``): name -> (unit, higher_is_better)
METRICS: dict[str, tuple[str, bool]] = {
    "step_s": ("s", False),
    "tokens_per_s_per_gpu": ("tokens/s/GPU", True),
    "mfu": ("", True),
}

X = TypeVar("X", float, np.ndarray)


def mfu(flops_per_dev_s: X, peak_flops: float) -> X:
    """Model FLOPs utilisation: FLOPs done per device-second over the device's peak FLOP/s."""
    return flops_per_dev_s / peak_flops


def plausible_utilisation(name: str, value: float | None) -> tuple[float | None, str | None]:
    """(value, None) for a utilisation (MFU, HFU) a device can reach; (None, why) above 1: more FLOPs
    than peak × step time cannot have run on the device, so the FLOP count (or the peak) is wrong —
    typically FLOPs counted globally under tensor parallelism, or a peak for another dtype."""
    if value is None or value <= 1.0:
        return value, None
    return None, (f"implausible: {name} {value:.2f} > 1 — the FLOP count exceeds peak × step time "
                  "(FLOPs likely counted globally, or the peak is for another dtype/device)")


#: below this, measured recomputation is rounding, not activation checkpointing
RECOMPUTE_MIN = 1e-3


def recompute_overhead(hw_flops: float | None, model_flops: float | None, tokens: float | None,
                       padded_tokens: float | None) -> float | None:
    """Extra FLOPs recomputation adds (activation checkpointing; a fused attention backward's score
    recompute), as a fraction of the model FLOPs of the same positions:
    ``hw / (model × padding) − 1`` with ``padding = padded / real tokens`` (1 when either is unknown),
    over the steps that measured hardware FLOPs. The agent's hardware FLOPs are ``model × padding ×
    (1 + r)`` by construction, so this is r (0.33 = a third more FLOPs than the model needs). None when
    not measured or below ``RECOMPUTE_MIN`` (no recomputation)."""
    if not hw_flops or not model_flops or hw_flops <= 0 or model_flops <= 0:
        return None
    padding = padded_tokens / tokens if tokens and padded_tokens and tokens > 0 and padded_tokens > 0 else 1.0
    r = hw_flops / (model_flops * padding) - 1.0
    return r if r >= RECOMPUTE_MIN else None


def tokens_per_s(tokens_per_s_raw: X, mp_size: int | None) -> X:
    """Training throughput: tokens per second of the step, each token counted once per model replica
    (the ranks of one tensor/pipeline-parallel group see the same tokens)."""
    return tokens_per_s_raw / max(1, int(mp_size or 1))


def step_s_per_1k_tokens(step_s: float | None, tokens_per_rank_step: float | None, mp_size: int | None) -> float | None:
    """GPU-seconds of one step per 1,000 tokens that GPU processed (= 1000 / tokens_per_s_per_gpu when
    every figure is the same step's); comparable across batch sizes and scales."""
    if not step_s or not tokens_per_rank_step:
        return None
    return step_s * 1000.0 / (tokens_per_rank_step * max(1, int(mp_size or 1)))


def overlap_ratio(comm_exposed_s: float | None, comm_total_s: float | None) -> float | None:
    """Share of communication hidden behind compute: 1 − exposed / total (None without communication)."""
    if not comm_total_s or comm_exposed_s is None or comm_total_s <= 0:
        return None
    return 1.0 - comm_exposed_s / comm_total_s


def component_shares(*, data_s: float, compute_s: float, comm_exposed_s: float, other_s: float,
                     wait_in_comm_s: float) -> dict[str, float] | None:
    """Shares of step time, summed over steps, of data, compute, exposed comm, other and straggler wait.

    A synchronous job waits for the slowest rank inside its collectives: that wait (per step, at most
    the step's exposed comm) is carved out of exposed comm and shown as its own component, so the
    shares add up to 1 (docs/metrics.md "Bottleneck attribution")."""
    parts = {"data": data_s, "compute": compute_s, "comm_exposed": comm_exposed_s - wait_in_comm_s,
             "other": other_s, "straggler_wait": wait_in_comm_s}
    total = sum(parts.values())
    if total <= 0:
        return None
    return {k: v / total for k, v in parts.items()}


def amdahl_ceiling(share: float) -> float | None:
    """The most a step can speed up when a component of this share vanishes: 1 / (1 − p)."""
    return 1.0 / (1.0 - share) if share < 1 else None


def scaling_signature(config: dict[str, Any] | None) -> str:
    """Config signature without the keys that change with cluster size (global batch, world size,
    data-parallel degree): the runs of one scaling curve share it."""
    c = {k: v for k, v in (config or {}).items() if k not in _SCALE_KEYS}
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:16]


_SCALE_KEYS = {
    "global_batch_tokens", "global_batch_size", "global_batch", "world_size", "num_nodes", "nnodes", "nodes",
    "dp", "dp_size", "data_parallel", "gpus", "num_gpus", "seed", "run_name", "output_dir", "timestamp",
}


def comparable_key(run: RunRow) -> tuple[Any, ...]:
    """Runs are comparable baselines when family, config signature, device type and world size match."""
    return (run.model_family, run.config_signature, run.device_type, run.world_size)


@dataclass(frozen=True)
class RunFigures:
    """A run's figures. Medians are over steps of the cross-rank median (``step_s_p95``: over steps of
    the slowest rank); ``sum_*`` are sums over steps; None where nothing was measured. Every median and
    sum is over the steady-state steps (``basis``); ``steps`` counts every compacted step."""

    steps: int = 0
    step_s: float | None = None
    step_s_p95: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    comm_exposed_s: float | None = None
    other_s: float | None = None
    comm_total_s: float | None = None
    phases: dict[str, float] | None = None  # forward / backward / optimizer (median over steps of the cross-rank median)
    straggler_wait_s: float | None = None
    overlap_ratio: float | None = None
    mfu: float | None = None
    hfu: float | None = None  # hardware FLOPs utilisation: padding and recomputation included
    mfu_flag: str | None = None  # why mfu is None although it was computed (plausible_utilisation)
    hfu_flag: str | None = None
    flops_per_rank_step: float | None = None  # model FLOPs one rank executes per step (median over steps)
    hw_flops_per_rank_step: float | None = None
    recompute_overhead: float | None = None  # see recompute_overhead(); None without recomputation
    tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tokens_per_rank_step: float | None = None
    tokens_per_step: float | None = None
    step_s_per_1k_tokens: float | None = None
    packing_efficiency: float | None = None
    mem_peak_bytes: float | None = None
    alloc_retries: float | None = None
    negative_residual_steps: int = 0
    shares: dict[str, float] | None = None
    sum_step_s: float | None = None
    sum_comm_total_s: float | None = None
    sum_comm_exposed_s: float | None = None
    sum_wait_s: float | None = None
    skew_p50: float | None = None
    skew_p95: float | None = None
    skew_max: float | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    basis_steps: int | None = None  # the steps the medians and sums are over (None: every step, figures of v5)
    basis: dict[str, Any] | None = None  # the summary's ``basis`` (``SteadyBasis.as_dict``)
    set_apart_steps: list[int] | None = None  # every set-apart step number (``basis`` lists ≤ 100 per reason)
    set_apart_excess: dict[str, float] | None = None  # goodput: {category: s} (``steady.set_apart_excess``)
    # sums over every step, set-apart ones included: time accounting (straggler time lost), not shares
    sum_step_all_s: float | None = None
    sum_wait_all_s: float | None = None

    @property
    def decomposition(self) -> dict[str, float | None]:
        return {"step_s": self.step_s, "data_s": self.data_s, "compute_s": self.compute_s,
                "comm_exposed_s": self.comm_exposed_s, "other_s": self.other_s}

    def get(self, name: str) -> Any:
        """A figure by name (None for an unknown one)."""
        return getattr(self, name, None) if name in _NAMES else None

    def to_json(self) -> dict[str, Any]:
        return {"v": FIGURES_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any], *, any_version: bool = False) -> RunFigures | None:
        """Figures cached by this version (None for another version's, unless ``any_version``: what a
        run whose per-step rows are gone keeps)."""
        if d.get("v") != FIGURES_VERSION and not any_version:
            return None
        return cls(**{k: d[k] for k in _NAMES if k in d})


_NAMES = frozenset(f.name for f in fields(RunFigures))


def run_figures(run: RunRow, a: RunAggregate | None, basis: SteadyBasis | None = None,
                excess: dict[str, float] | None = None) -> RunFigures:
    """The run's figures from its aggregates over the steps of ``basis`` (all None/0 for a run without
    steps); ``excess``: the set-apart steps' time goodput counts as lost (``steady.set_apart_excess``)."""
    if a is None:
        return RunFigures(steps=basis.of if basis is not None else 0)
    mp = run.mp_size
    tps = tokens_per_s(a.tokens_per_s_raw, mp) if a.tokens_per_s_raw is not None else None
    per_gpu = tps / max(int(run.world_size or 1), 1) if tps is not None else None
    packing = None
    if a.sum_padded_tokens is not None and a.sum_padded_tokens > 0:
        packing = (a.sum_tokens or 0.0) / a.sum_padded_tokens
    m, m_flag = plausible_utilisation(
        "MFU", mfu(a.flops_per_dev_s, run.peak_flops) if a.flops_per_dev_s is not None and run.peak_flops else None)
    h, h_flag = plausible_utilisation(
        "HFU", mfu(a.hw_flops_per_dev_s, run.peak_flops) if a.hw_flops_per_dev_s is not None and run.peak_flops else None)
    return RunFigures(
        steps=basis.of if basis is not None and basis.of else a.n,
        basis_steps=a.n,
        basis=basis.as_dict() if basis is not None else None,
        set_apart_steps=basis.excluded if basis is not None else None,
        set_apart_excess=dict(excess) if excess else None,
        step_s=a.step_s,
        step_s_p95=a.step_s_max_p95,
        data_s=a.data_s,
        compute_s=a.compute_s,
        comm_exposed_s=a.comm_exposed_s,
        other_s=a.other_s,
        comm_total_s=a.comm_total_s,
        phases={k: v for k, v in (("forward", a.forward_s), ("backward", a.backward_s), ("optimizer", a.optimizer_s))
                if v is not None} or None,
        straggler_wait_s=a.straggler_wait_s,
        overlap_ratio=overlap_ratio(a.comm_exposed_s, a.comm_total_s),
        mfu=m,
        hfu=h,
        mfu_flag=m_flag,
        hfu_flag=h_flag,
        flops_per_rank_step=a.flops_per_rank_step,
        hw_flops_per_rank_step=a.hw_flops_per_rank_step,
        recompute_overhead=recompute_overhead(a.sum_hw_flops, a.sum_flops_with_hw, a.sum_tokens_with_hw,
                                              a.sum_padded_with_hw),
        tokens_per_s=tps,
        tokens_per_s_per_gpu=per_gpu,
        tokens_per_rank_step=a.tokens_per_rank_step,
        tokens_per_step=a.tokens_per_step,
        step_s_per_1k_tokens=step_s_per_1k_tokens(a.step_s, a.tokens_per_rank_step, mp),
        packing_efficiency=packing,
        mem_peak_bytes=a.mem_peak_bytes,
        alloc_retries=a.alloc_retries if a.alloc_retries is not None else 0.0,
        negative_residual_steps=int(a.neg_residual_steps or 0),
        shares=component_shares(data_s=a.sum_data_s or 0.0, compute_s=a.sum_compute_s or 0.0,
                                comm_exposed_s=a.sum_comm_exposed_s or 0.0, other_s=a.sum_other_s or 0.0,
                                wait_in_comm_s=a.sum_wait_in_comm_s or 0.0),
        sum_step_s=a.sum_step_s,
        sum_comm_total_s=a.sum_comm_total_s,
        sum_comm_exposed_s=a.sum_comm_exposed_s,
        sum_wait_s=a.sum_wait_s,
        skew_p50=a.skew_p50,
        skew_p95=a.skew_p95,
        skew_max=a.skew_max,
        first_ts=a.first_ts,
        last_ts=a.last_ts,
    )
