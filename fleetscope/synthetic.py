"""Synthetic but realistic training runs: per-rank step decompositions as a synchronous job makes them.

Used by `fleetscope demo` (a fleet history) and `fleetscope simulate` (one run through the agent's
transport). Deterministic per seed. The model: every rank computes for ``compute_s`` (FLOPs / peak /
MFU), loads data, has host overhead; collectives of the step take ``comm_total_s`` of which a
share is overlapped with backward — and since training is synchronous, every rank also waits in
the collectives for the slowest rank's extra work (a straggler shows up as everyone else's exposed
comm, docs/metrics.md "Stragglers"). Communication's share grows with the world size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .wire import RANK_STEP_FIELDS

__all__ = ["Family", "FAMILIES", "RunSpec", "rank_step_rows", "collective_rows", "PEAK_FLOPS", "SHIFT_COMPONENTS",
           "merge_config", "modality_shares", "token_factor", "modality_rows"]

#: dense bf16 peak FLOP/s per device (docs/metrics.md; vendor datasheets)
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2.25e15, "MI300X": 1307e12}


@dataclass(frozen=True)
class Family:
    name: str
    params: float  # non-embedding parameters
    tokens_per_rank_step: int
    base_mfu: float  # compute-only efficiency at small scale
    comm_bytes_factor: float = 2.0  # bytes of gradient per param (bf16)
    modalities: tuple[str, ...] = ("text",)


FAMILIES: dict[str, Family] = {
    "vla-7b": Family("vla-7b", 7e9, 16384, 0.48, modalities=("vision", "text", "action")),
    "llm-70b": Family("llm-70b", 70e9, 8192, 0.42, modalities=("text",)),
    "vit-h": Family("vit-h", 0.63e9, 65536, 0.38, modalities=("vision",)),
    "video-dit-3b": Family("video-dit-3b", 3e9, 32768, 0.44, modalities=("video", "text")),
}

#: the step-time components ``RunSpec.shift`` can scale (``fleetscope simulate --shift``)
SHIFT_COMPONENTS = ("data_s", "compute_s", "comm_exposed_s", "other_s")


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on top: nested objects merged key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class RunSpec:
    """One synthetic run."""

    name: str
    family: str
    world_size: int
    steps: int
    seed: int = 0
    gpu: str = "H100"
    step_ms: float | None = None  # force the median step time (ms); else from the model
    straggler: dict[int, float] = field(default_factory=dict)  # rank -> compute slowdown factor
    slow_factor: float = 1.0  # whole-run slowdown (a regression)
    comm_bound: bool = False  # small buckets / no overlap: exposed comm dominates
    gpus_per_node: int = 8
    start_ts: float = 1.7e9
    #: node name (``host_of``) -> factor: every collective of that node's ranks takes FACTOR× as long (a slow
    #: link or NIC: lower busbw, higher latency); their work is unchanged, the extra exposed comm lengthens their step
    slow_nodes: dict[str, float] = field(default_factory=dict)
    #: scale one or more step-time components for this run (``SHIFT_COMPONENTS`` -> factor): data, compute and
    #: other scale the rank's work; comm_exposed_s scales the exposed part of communication, and the extra time
    #: is communication that was not hidden (``comm_total_s`` grows by the same seconds)
    shift: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None  # laid over the synthetic config (``merge_config``)
    #: rank -> factor: the rank gets FACTOR× the tokens (of ``token_skew_modality`` only, when set) and its
    #: compute and FLOPs grow with them (a data loader that balances samples, not tokens)
    token_skew: dict[int, float] = field(default_factory=dict)
    token_skew_modality: str | None = None
    git_commit: str | None = None

    def host_of(self, rank: int) -> str:
        return f"node{rank // self.gpus_per_node:04d}"

    @property
    def fam(self) -> Family:
        return FAMILIES.get(self.family) or Family(self.family, 1e9, 8192, 0.4)

    @property
    def peak_flops(self) -> float:
        return PEAK_FLOPS.get(self.gpu, 989e12)

    def flops_per_rank_step(self) -> float:
        return 6.0 * self.fam.params * self.fam.tokens_per_rank_step

    def run_info(self) -> dict[str, Any]:
        config = {"global_batch_tokens": self.fam.tokens_per_rank_step * self.world_size,
                  "bucket_mb": 5 if self.comm_bound else 25, "overlap": not self.comm_bound}
        info = {
            "name": self.name,
            "model_family": self.family,
            "config": merge_config(config, self.config or {}),
            "world_size": self.world_size,
            "device_type": self.gpu,
            "device_count": self.world_size,
            "peak_flops": self.peak_flops,
            "meta": {"flops_source": "estimated", "synthetic": True, "seed": self.seed},
        }
        if self.git_commit:
            info["git_commit"] = self.git_commit
        return info


def _base(spec: RunSpec) -> dict[str, float]:
    fam = spec.fam
    bad = sorted(set(spec.shift) - set(SHIFT_COMPONENTS))
    if bad or any(not (math.isfinite(f) and f > 0) for f in spec.shift.values()):
        raise ValueError(f"shift: components must be {', '.join(SHIFT_COMPONENTS)} with a factor > 0, got {spec.shift}")
    if any(not (0 <= r < spec.world_size and math.isfinite(f) and f > 0) for r, f in spec.token_skew.items()):
        raise ValueError(f"token_skew: ranks must be in [0, {spec.world_size}) with a factor > 0, got {spec.token_skew}")
    if spec.token_skew_modality is not None and spec.token_skew_modality not in fam.modalities:
        raise ValueError(f"token_skew_modality: {spec.token_skew_modality!r} is not a modality of {spec.family} "
                         f"({', '.join(fam.modalities)})")
    compute = spec.flops_per_rank_step() / (spec.peak_flops * fam.base_mfu)
    n = spec.world_size
    # ring all-reduce of the gradients: 2(n-1)/n * bytes / busbw; inter-node bandwidth is lower
    busbw = 350e9 if n <= spec.gpus_per_node else 45e9
    comm_total = 2 * (n - 1) / max(n, 1) * fam.params * fam.comm_bytes_factor / busbw / 8  # sharded over 8 buckets
    comm_total *= 1 + 0.12 * math.log2(max(n / spec.gpus_per_node, 1))  # latency terms grow with scale
    overlap = 0.15 if spec.comm_bound else max(0.35, 0.92 - 0.06 * math.log2(max(n / spec.gpus_per_node, 1)))
    data = 0.02 * compute
    other = 0.03 * compute
    scale = 1.0
    if spec.step_ms:
        total = compute + data + other + comm_total * (1 - overlap)
        scale = spec.step_ms / 1e3 / total
    sh = spec.shift
    return {
        "compute": compute * scale * spec.slow_factor * sh.get("compute_s", 1.0),
        "comm_total": comm_total * scale,
        "overlap": overlap,
        "data": data * scale * sh.get("data_s", 1.0),
        "other": other * scale * sh.get("other_s", 1.0),
        "exposed_factor": sh.get("comm_exposed_s", 1.0),
    }


def modality_shares(fam: Family) -> dict[str, float]:
    """Each modality's share of a sample's tokens: the first 0.7, the others the rest equally."""
    mods = fam.modalities
    if len(mods) == 1:
        return {mods[0]: 1.0}
    return {m: 0.7 if i == 0 else 0.3 / (len(mods) - 1) for i, m in enumerate(mods)}


def token_factor(spec: RunSpec, rank: int) -> float:
    """How many times the usual tokens (and work) ``rank`` gets under ``spec.token_skew``."""
    skew = spec.token_skew.get(rank, 1.0)
    if skew == 1.0:
        return 1.0
    share = modality_shares(spec.fam).get(spec.token_skew_modality, 0.0) if spec.token_skew_modality else 1.0
    return 1.0 + share * (skew - 1.0)


def modality_rows(spec: RunSpec, step: int, rank_rows: list[tuple]) -> list[tuple]:
    """Per-modality tokens of each rank of a step (wire.MODALITY_FIELDS order) summing to its ``tokens``;
    the skewed modality of a ``token_skew`` rank carries the extra tokens."""
    i_tok = [f.name for f in RANK_STEP_FIELDS].index("tokens")
    shares = modality_shares(spec.fam)
    out = []
    for row in rank_rows:
        r, tokens = row[0], row[i_tok]
        skew = spec.token_skew.get(r, 1.0)
        base = tokens / token_factor(spec, r)
        parts = {m: base * s * (skew if spec.token_skew_modality in (None, m) else 1.0) for m, s in shares.items()}
        names = list(parts)
        vals = [int(parts[m]) for m in names[:-1]]
        vals.append(tokens - sum(vals))
        out += [(r, step, m, v) for m, v in zip(names, vals, strict=True)]
    return out


def rank_step_rows(spec: RunSpec, step_lo: int = 0, step_hi: int | None = None) -> Iterator[tuple[int, list[tuple]]]:
    """Yield (step, rows) with one tuple per rank in wire.RANK_STEP_FIELDS order."""
    b = _base(spec)
    fam = spec.fam
    names = [f.name for f in RANK_STEP_FIELDS]
    hi = spec.steps if step_hi is None else min(step_hi, spec.steps)
    ts = spec.start_ts
    flops = spec.flops_per_rank_step()
    for step in range(step_lo, hi):
        rng = random.Random(f"{spec.seed}:{spec.name}:{step}")
        step_jitter = rng.lognormvariate(0, 0.03)
        work = []
        parts = []
        for r in range(spec.world_size):
            f = spec.straggler.get(r, 1.0) * token_factor(spec, r)
            compute = b["compute"] * step_jitter * rng.lognormvariate(0, 0.01) * f
            data = b["data"] * rng.lognormvariate(0, 0.3)
            other = b["other"] * rng.lognormvariate(0, 0.1)
            parts.append((data, compute, other))
            work.append(data + compute + other)
        slowest = max(work)
        comm_total = b["comm_total"] * step_jitter
        own_exposed = comm_total * (1 - b["overlap"])
        if b["exposed_factor"] != 1.0:  # --shift comm_exposed_s=F: the extra exposed seconds were not hidden
            comm_total += own_exposed * (b["exposed_factor"] - 1)
            own_exposed *= b["exposed_factor"]
        rows = []
        for r in range(spec.world_size):
            data, compute, other = parts[r]
            wait = slowest - work[r]  # waiting for the slowest rank inside the collectives
            exposed = own_exposed + wait
            total_r = comm_total + wait
            if spec.slow_nodes:  # --slow-node: this rank's collectives are FACTOR× slower (not more work)
                net = spec.slow_nodes.get(spec.host_of(r), 1.0)
                exposed, total_r = exposed * net, total_r * net
            step_s = data + compute + other + exposed
            tf = token_factor(spec, r)
            padded = int(fam.tokens_per_rank_step * tf)
            tokens = int(padded * (0.86 + 0.1 * rng.random()))
            rec = {
                "rank": r,
                "step": step,
                "step_s": step_s,
                "ts": ts,
                "data_s": data,
                "compute_s": compute,
                "forward_s": compute / 3,
                "backward_s": compute * 0.6,
                "optimizer_s": compute - compute / 3 - compute * 0.6,
                "comm_exposed_s": exposed,
                "comm_total_s": total_r,
                "other_s": other,
                "tokens": tokens,
                "padded_tokens": padded,
                "samples": max(1, padded // 2048),
                "flops": flops * tf * tokens / padded,
                "mem_allocated_bytes": int(60e9 + 1e9 * rng.random()) // 512 * 512,
                "mem_reserved_bytes": int(72e9) // 512 * 512,
                "mem_peak_bytes": int(66e9 + 2e9 * rng.random()) // 512 * 512,
                "alloc_retries": 0,
                "flags": 0,
            }
            rows.append(tuple(rec.get(n) for n in names))  # fields not simulated (hw_flops): not measured
        ts += max(work) + own_exposed
        yield step, rows


def collective_rows(spec: RunSpec, step: int, rank_rows: list[tuple]) -> list[tuple]:
    """Collective records (wire.COLLECTIVE_FIELDS order) consistent with the step rows."""
    b = _base(spec)
    n = spec.world_size
    grad_bytes = int(spec.fam.params * spec.fam.comm_bytes_factor / 8)
    i_total = [f.name for f in RANK_STEP_FIELDS].index("comm_total_s")
    i_exp = [f.name for f in RANK_STEP_FIELDS].index("comm_exposed_s")
    i_ts = [f.name for f in RANK_STEP_FIELDS].index("ts")
    out = []
    for row in rank_rows:
        r = row[0]
        total, exposed = row[i_total], row[i_exp]
        # four records per rank-step: bucketed gradient all-reduce (two size buckets), an all-gather, a barrier
        split = [(0, "all_reduce", grad_bytes * 6, 6, 0.7, "dp"), (1, "all_reduce", grad_bytes * 2 // 4, 2, 0.2, "dp"),
                 (2, "all_gather", 4 << 20, 1, 0.08, "dp"), (3, "barrier", 0, 1, 0.02, "world")]  # fmt: skip
        for seq, op, nbytes, calls, share, dim in split:
            out.append((r, step, seq, op, n, int(nbytes), calls, total * share, exposed * share, row[i_ts], dim))
    del b
    return out
