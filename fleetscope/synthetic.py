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
           "merge_config", "modality_shares", "token_factor", "modality_rows", "Layout", "LAYOUTS", "DEVICE_MEMORY",
           "layout_of", "memory_model", "parallel_facts", "memory_event", "PeakMemory", "bucket_cap_bytes", "largest_grad_bytes",
           "ddp_buckets"]

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

#: device memory (bytes) per device type: a simulated per-rank peak stays below it
DEVICE_MEMORY = {"A100": 80e9, "H100": 80e9, "H200": 141e9, "B200": 192e9, "MI300X": 192e9}


@dataclass(frozen=True)
class Layout:
    """How a family is trained in the realistic model (``RunSpec.realistic``, the demo): the data-parallel
    strategy and what its memory and collectives follow from.

    ``strategy``: ``ddp`` (replicated states, bucketed gradient all-reduce), ``fsdp`` (full shard across
    the world: all-gather of each unit's parameters before its forward and again before its backward, a
    reduce-scatter of its gradients during backward) or ``hsdp`` (FSDP within ``shard_size`` ranks of a
    node, gradients all-reduced across the replicas)."""

    strategy: str
    layers: int  # FSDP units (one per transformer block)
    act_bytes_per_token: float  # activation memory at the peak (after checkpointing) per token of the step
    shard_size: int = 0  # hsdp: ranks per shard group
    bucket_mb: float = 25.0  # ddp: DDP's bucket_cap_mb
    activation_checkpointing: bool = True
    tokens_per_rank_step: int | None = None  # the family's own batch per GPU when it differs (None: Family's)
    #: ddp: the largest gradient tensor (bytes); 0: one of a block's MLP matrices (4h² of its 12h² parameters, bf16)
    largest_grad_bytes: float = 0.0


LAYOUTS: dict[str, Layout] = {
    # 70B: bf16 parameters alone are 140 GB, so states are sharded over every rank (ZeRO-3)
    # two 8k-token sequences per GPU: enough compute per step to hide ZeRO-3's all-gathers
    "llm-70b": Layout("fsdp", layers=80, act_bytes_per_token=1.6e6, tokens_per_rank_step=16384),
    "vla-7b": Layout("fsdp", layers=32, act_bytes_per_token=0.54e6),
    "video-dit-3b": Layout("hsdp", layers=28, act_bytes_per_token=0.25e6, shard_size=8),
    "vit-h": Layout("ddp", layers=32, act_bytes_per_token=0.45e6, activation_checkpointing=False),
}

#: bytes of state per parameter: bf16 parameters and gradients, fp32 master weights and Adam's two moments
STATE_BYTES_PER_PARAM = 2 + 2 + 12
#: workspace, NCCL buffers and allocator fragmentation per rank
OVERHEAD_BYTES = 3e9
_INTRA_BUSBW = 350e9  # NVLink bus bandwidth (B/s) within a node
_INTER_BUSBW = 45e9  # InfiniBand (400 Gb/s per GPU) bus bandwidth across nodes
_SOCKET_BUSBW = 6e9  # NCCL's socket transport (no RDMA): the comm-bound configuration
_CALL_LATENCY = 30e-6  # per collective call


def layout_of(family: str) -> Layout:
    return LAYOUTS.get(family) or Layout("ddp", layers=24, act_bytes_per_token=0.3e6)


def memory_model(spec: RunSpec) -> dict[str, float]:
    """Per-rank memory of the realistic model (bytes): ``states`` (parameters, gradients, optimizer —
    sharded as the layout shards them), ``buffers`` (FSDP: two unsharded units, current and prefetched,
    plus one unit's gradients; DDP: its gradient buckets), ``activations`` and ``peak`` (their sum plus
    ``OVERHEAD_BYTES``)."""
    lay = layout_of(spec.family)
    p = spec.fam.params
    n = spec.world_size
    shard = {"ddp": 1, "fsdp": n, "hsdp": min(n, lay.shard_size or n)}.get(lay.strategy, 1)
    states = STATE_BYTES_PER_PARAM * p / shard
    buffers = 3 * 2 * p / lay.layers if lay.strategy != "ddp" else 2 * p
    acts = lay.act_bytes_per_token * spec.tokens_per_rank_step
    return {"states": states, "buffers": buffers, "activations": acts,
            "peak": states + buffers + acts + OVERHEAD_BYTES, "shard": float(shard)}


def bucket_cap_bytes(spec: RunSpec) -> float:
    """DDP's bucket cap in the realistic model (bytes): ``spec.bucket_mb`` or the layout's, in MiB."""
    return float(spec.bucket_mb if spec.bucket_mb is not None else layout_of(spec.family).bucket_mb) * (1 << 20)


def largest_grad_bytes(spec: RunSpec) -> float:
    """The model's largest gradient tensor (bytes): ``spec.largest_grad_mb``, the layout's, else one of a
    block's two MLP matrices (4h² of the block's 12h² parameters, bf16)."""
    if spec.largest_grad_mb is not None:
        return float(spec.largest_grad_mb) * (1 << 20)
    lay = layout_of(spec.family)
    return lay.largest_grad_bytes or 2.0 * spec.fam.params / lay.layers / 3


def ddp_buckets(spec: RunSpec) -> int:
    """Gradient buckets per step of a realistic DDP run: DDP fills buckets up to the cap without splitting a
    parameter, so none is smaller than the largest gradient tensor."""
    grad = 2.0 * spec.fam.params
    return max(1, math.ceil(grad / max(bucket_cap_bytes(spec), largest_grad_bytes(spec))))


def parallel_facts(spec: RunSpec) -> tuple[str, dict[str, Any]] | None:
    """The ``ddp`` or ``fsdp`` run event the agent sends for the realistic model's layout (what
    agent/parallel_facts.py reads from a wrapped model), consistent with the collectives ``_plan`` draws:
    DDP's cap, first bucket (the cap: bucket_cap_mb set explicitly), largest gradient tensor and buckets;
    FSDP's (and HSDP's) units, one per block of equal size. None for the legacy model."""
    if not spec.realistic:
        return None
    lay = layout_of(spec.family)
    grad = 2.0 * spec.fam.params
    tensors = lay.layers * 12 + 4  # a block's weights, biases and norms; embeddings, final norm and head
    if lay.strategy == "ddp" or spec.world_size == 1:
        cap = int(bucket_cap_bytes(spec))
        return "ddp", {"bucket_cap_bytes": cap, "first_bucket_bytes": cap, "gradient_as_bucket_view": False,
                       "params": tensors, "grad_bytes": int(grad), "largest_grad_bytes": int(largest_grad_bytes(spec)),
                       "largest_grad_param": "blocks.0.mlp.fc1.weight", "buckets_estimated": ddp_buckets(spec),
                       "find_unused_parameters": False, "static_graph": False}
    unit = int(grad / lay.layers)
    return "fsdp", {"units": lay.layers, "params": tensors, "largest_unit_bytes": unit, "smallest_unit_bytes": unit,
                    "root_bytes": None}


def memory_event(spec: RunSpec, peak_allocated: float, peak_reserved: float) -> dict[str, Any]:
    """The data of a rank's ``memory`` event at the run's end in the realistic model (the agent's fields on
    a GPU, agent/memory.py) with the device's memory (``device_total_bytes``: ``DEVICE_MEMORY``)."""
    pa, pr = int(peak_allocated), int(peak_reserved)
    return {"source": "cuda", "samples": spec.steps, "peak_allocated_bytes": pa, "peak_exact": True,
            "peak_reserved_bytes": pr, "fragmentation_bytes": max(0, pr - pa), "alloc_retries": 0, "ooms": 0,
            "device_total_bytes": int(DEVICE_MEMORY.get(spec.gpu, 80e9))}


class PeakMemory:
    """Each rank's largest peak allocated and reserved memory over the steps seen (``add``), and the run
    events a realistic run's agent sends at its end (``events``): its ``ddp`` / ``fsdp`` facts (rank 0) and
    every rank's ``memory`` event (``synthetic.memory_event``, with the device's memory)."""

    def __init__(self) -> None:
        names = [f.name for f in RANK_STEP_FIELDS]
        self._ix = (names.index("mem_peak_bytes"), names.index("mem_reserved_bytes"))
        self.peaks: dict[int, tuple[float, float]] = {}

    def add(self, rows: list[tuple]) -> None:
        ia, ir = self._ix
        for row in rows:
            pa, pr = self.peaks.get(int(row[0]), (0.0, 0.0))
            self.peaks[int(row[0])] = (max(pa, float(row[ia] or 0)), max(pr, float(row[ir] or 0)))

    def events(self, spec: RunSpec, ts: float, seq0: int = 0) -> list[dict[str, Any]]:
        if not spec.realistic:
            return []
        out: list[dict[str, Any]] = []
        facts = parallel_facts(spec)
        if facts is not None:
            out.append({"rank": 0, "seq": seq0, "kind": facts[0], "ts": spec.start_ts, "step": None, "data": facts[1]})
        for r, (pa, pr) in sorted(self.peaks.items()):
            out.append({"rank": r, "seq": seq0 + 1, "kind": "memory", "ts": ts, "step": spec.steps - 1,
                        "data": memory_event(spec, pa, pr)})
        return out


def _busbw(spec: RunSpec, group: int, *, inter: bool) -> float:
    """Bus bandwidth of a group: NVLink within a node; across nodes InfiniBand, a little lower the more
    nodes a ring spans (more hops, more contention), or NCCL's socket transport (comm-bound run)."""
    if not inter or group <= 1:
        return _INTRA_BUSBW
    nodes = group / spec.gpus_per_node if group > spec.gpus_per_node else group
    return (_SOCKET_BUSBW if spec.comm_bound else _INTER_BUSBW) / (1 + 0.05 * math.log2(max(nodes, 1)))


def _plan(spec: RunSpec) -> list[dict[str, Any]]:
    """The realistic model's collectives of one rank-step in issue order: op, dim, group size, bytes
    (NCCL-tests: all-gather its output, reduce-scatter its input), calls, seconds, and ``when``: the phase
    they are issued in (``forward`` / ``backward``)."""
    lay = layout_of(spec.family)
    n = spec.world_size
    g = spec.gpus_per_node
    grad = 2.0 * spec.fam.params  # bf16 parameters / gradients
    out: list[dict[str, Any]] = []

    def add(op: str, dim: str, group: int, nbytes: float, calls: int, when: str) -> None:
        from .wire import busbw_factor

        bw = _busbw(spec, group, inter=group > g or dim == "dp_replicate")
        secs = nbytes * busbw_factor(op, group) / bw + calls * _CALL_LATENCY * max(1.0, math.log2(max(group, 2)))
        out.append({"op": op, "dim": dim, "group": group, "bytes": nbytes, "calls": calls, "s": secs, "when": when})

    if lay.strategy == "ddp" or n == 1:
        buckets = ddp_buckets(spec)
        add("all_reduce", "dp", n, grad, buckets, "backward")
    elif lay.strategy == "fsdp" or n <= lay.shard_size:
        add("all_gather", "dp", n, grad, lay.layers, "forward")
        add("all_gather", "dp", n, grad, lay.layers, "backward")
        add("reduce_scatter", "dp", n, grad, lay.layers, "backward")
    else:  # hsdp: shard within the node, replicate across nodes
        s = lay.shard_size
        add("all_gather", "dp_shard", s, grad, lay.layers, "forward")
        add("all_gather", "dp_shard", s, grad, lay.layers, "backward")
        add("reduce_scatter", "dp_shard", s, grad, lay.layers, "backward")
        # the comm-bound configuration also reduces across replicas in fp32 (twice the bytes)
        add("all_reduce", "dp_replicate", n // s, grad / s * (2 if spec.comm_bound else 1), lay.layers, "backward")
    return out


def _exposure(spec: RunSpec, compute: float) -> dict[str, float]:
    """Where a rank-step of the realistic model waits for communication (seconds): ``forward`` — the
    first unit's all-gather (nothing to overlap it with) and what the forward (1/3 of compute) cannot
    hide of the forward all-gathers; ``backward`` — what the backward (0.6 of compute) cannot hide, waited
    for inside backward when units' all-gathers are late (FSDP), else (DDP) after it; ``tail`` — the last
    gradient reduction, which the optimizer waits for (plus DDP's unhidden buckets). The comm-bound
    configuration overlaps nothing: every collective is waited for where it is issued."""
    plan = _plan(spec)
    fwd = sum(c["s"] for c in plan if c["when"] == "forward")
    bwd = sum(c["s"] for c in plan if c["when"] == "backward")
    last = plan[-1]["s"] / plan[-1]["calls"]
    if spec.comm_bound:
        return {"forward": fwd, "backward": max(bwd - last, 0.0), "tail": last}
    first = next((c["s"] / c["calls"] for c in plan if c["when"] == "forward"), 0.0)
    f_wait = min(fwd, first + max(0.0, fwd - compute / 3))
    b_excess = max(0.0, bwd - 0.6 * compute)
    in_bwd = any(c["op"] == "all_gather" and c["when"] == "backward" for c in plan)
    return {"forward": f_wait, "backward": b_excess if in_bwd else 0.0, "tail": last + (0.0 if in_bwd else b_excess)}


def _realistic_comm(spec: RunSpec, compute: float) -> tuple[float, float]:
    """(total, exposed) communication seconds of a rank-step in the realistic model (``_exposure``)."""
    total = sum(c["s"] for c in _plan(spec))
    return total, min(sum(_exposure(spec, compute).values()), total)


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
    #: rank -> factor: that one rank's collectives take FACTOR× as long (a bad NIC, cable or switch port of one GPU)
    slow_links: dict[int, float] = field(default_factory=dict)
    #: rank -> factor: that rank's data loading takes FACTOR× as long (a slow loader: a slow disk, a hot shard)
    slow_loaders: dict[int, float] = field(default_factory=dict)
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
    #: the realistic model (the demo): each family's own parallelism (``LAYOUTS``), memory from its states
    #: and activations (``memory_model``), communication from its bytes and links, collectives issued where
    #: the step issues them; False: one DDP-like all-reduce model for every family (fixtures of the tests)
    realistic: bool = False
    #: realistic DDP layouts: DDP's bucket_cap_mb (None: the layout's) and the model's largest gradient tensor in
    #: MiB (None: the layout's) — the buckets the collectives show and the ``ddp`` facts the run sends
    bucket_mb: float | None = None
    largest_grad_mb: float | None = None

    def host_of(self, rank: int) -> str:
        return f"node{rank // self.gpus_per_node:04d}"

    @property
    def fam(self) -> Family:
        return FAMILIES.get(self.family) or Family(self.family, 1e9, 8192, 0.4)

    @property
    def peak_flops(self) -> float:
        return PEAK_FLOPS.get(self.gpu, 989e12)

    @property
    def tokens_per_rank_step(self) -> int:
        """Tokens one rank processes per step: the family's, or its layout's in the realistic model."""
        lay = LAYOUTS.get(self.family) if self.realistic else None
        return (lay.tokens_per_rank_step if lay is not None else None) or self.fam.tokens_per_rank_step

    def flops_per_rank_step(self) -> float:
        return 6.0 * self.fam.params * self.tokens_per_rank_step

    def run_info(self) -> dict[str, Any]:
        config: dict[str, Any] = {"global_batch_tokens": self.tokens_per_rank_step * self.world_size,
                                  "bucket_mb": 5 if self.comm_bound else 25, "overlap": not self.comm_bound}
        meta: dict[str, Any] = {"flops_source": "estimated", "synthetic": True, "seed": self.seed}
        info: dict[str, Any] = {
            "name": self.name,
            "model_family": self.family,
            "config": merge_config(config, self.config or {}),
            "world_size": self.world_size,
            "device_type": self.gpu,
            "device_count": self.world_size,
            "peak_flops": self.peak_flops,
            "meta": meta,
        }
        # the model's size (``fs.init(params=, active_params=)``): every family here is dense
        meta.update(params=self.fam.params, active_params=self.fam.params, params_source="given")
        if self.realistic:
            lay = layout_of(self.family)
            mem = memory_model(self)
            par: dict[str, Any] = {"strategy": lay.strategy, "activation_checkpointing": lay.activation_checkpointing}
            if lay.strategy == "ddp":
                config["bucket_mb"] = bucket_cap_bytes(self) / (1 << 20)
            else:
                config.pop("bucket_mb", None)
                par["shard_group"] = int(mem["shard"])
                if lay.strategy == "hsdp" and self.world_size > lay.shard_size:
                    par["replicas"] = self.world_size // lay.shard_size
            if self.comm_bound:
                config["nccl_net"] = "socket"
                config["reduce_dtype"] = "fp32"
            config["parallelism"] = par
            info["config"] = merge_config(config, self.config or {})
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
    if spec.realistic:
        return _realistic_base(spec, compute)
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


def _realistic_base(spec: RunSpec, compute: float) -> dict[str, float]:
    total, exposed = _realistic_comm(spec, compute)
    sh = spec.shift
    # step_ms: every part of the step (work and communication alike) scaled to that median step
    scale = spec.step_ms / 1e3 / (1.05 * compute + exposed) if spec.step_ms else 1.0
    return {
        "compute": compute * scale * spec.slow_factor * sh.get("compute_s", 1.0),
        "comm_total": total * scale,
        "overlap": 1.0 - exposed / total if total > 0 else 1.0,
        "data": 0.02 * compute * scale * sh.get("data_s", 1.0),
        "other": 0.03 * compute * scale * sh.get("other_s", 1.0),
        "exposed_factor": sh.get("comm_exposed_s", 1.0),
        "scale": scale,
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
    names = [f.name for f in RANK_STEP_FIELDS]
    hi = spec.steps if step_hi is None else min(step_hi, spec.steps)
    ts = spec.start_ts
    flops = spec.flops_per_rank_step()
    mem = memory_model(spec) if spec.realistic else None
    for step in range(step_lo, hi):
        rng = random.Random(f"{spec.seed}:{spec.name}:{step}")
        step_jitter = rng.lognormvariate(0, 0.03)
        work = []
        parts = []
        for r in range(spec.world_size):
            f = spec.straggler.get(r, 1.0) * token_factor(spec, r)
            compute = b["compute"] * step_jitter * rng.lognormvariate(0, 0.01) * f
            data = b["data"] * rng.lognormvariate(0, 0.3) * spec.slow_loaders.get(r, 1.0)
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
            if spec.slow_links:  # --slow-link: this one rank's collectives are FACTOR× slower
                net = spec.slow_links.get(r, 1.0)
                exposed, total_r = exposed * net, total_r * net
            step_s = data + compute + other + exposed
            tf = token_factor(spec, r)
            padded = int(spec.tokens_per_rank_step * tf)
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
            if mem is not None:  # states and buffers stay; activations are freed by the step's end
                peak = mem["peak"] * (1 + 0.01 * rng.random()) * (0.86 + 0.14 * tf)
                rec["mem_peak_bytes"] = int(peak) // 512 * 512
                rec["mem_allocated_bytes"] = int(peak - mem["activations"]) // 512 * 512
                rec["mem_reserved_bytes"] = int(peak * 1.06) // 512 * 512
            rows.append(tuple(rec.get(n) for n in names))  # fields not simulated (hw_flops): not measured
        ts += max(work) + own_exposed
        yield step, rows


def collective_rows(spec: RunSpec, step: int, rank_rows: list[tuple]) -> list[tuple]:
    """Collective records (wire.COLLECTIVE_FIELDS order) consistent with the step rows."""
    if spec.realistic:
        return _realistic_collectives(spec, step, rank_rows)
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


def _realistic_collectives(spec: RunSpec, step: int, rank_rows: list[tuple]) -> list[tuple]:
    """The realistic model's collective records, placed where the step issues them (times from the step's
    ``ts``): data → forward → backward → wait → optimizer. Forward all-gathers are issued when the forward
    starts; backward ones and the gradient reductions while backward runs, each kind as two records — the
    first calls early in backward, the last call when backward ends — as the agent records them, so that
    the last gradient reduction's issue marks backward's end. The step's exposed communication is the wait
    at the end of that last reduction (the optimizer waits for the last gradients)."""
    names = [f.name for f in RANK_STEP_FIELDS]
    ix = {k: names.index(k) for k in ("ts", "data_s", "forward_s", "backward_s", "comm_total_s", "comm_exposed_s")}
    b = _base(spec)
    sc = b.get("scale", 1.0)  # --step-ms: the model's seconds scaled to the forced step
    plan = [{**c, "s": c["s"] * sc} for c in _plan(spec)]
    base_total = sum(c["s"] for c in plan) or 1.0
    grads = [i for i, c in enumerate(plan) if c["op"] in ("all_reduce", "reduce_scatter")]
    last_grad = grads[-1] if grads else len(plan) - 1
    waits = {k: v * sc for k, v in _exposure(spec, b["compute"] / spec.slow_factor / spec.shift.get("compute_s", 1.0)
                                             / sc).items()}
    bwd_ag = next((i for i, c in enumerate(plan) if c["op"] == "all_gather" and c["when"] == "backward"), None)
    out = []
    for row in rank_rows:
        r = row[0]
        ts, data, fwd, bwd = (float(row[ix[k]]) for k in ("ts", "data_s", "forward_s", "backward_s"))
        total, exposed = float(row[ix["comm_total_s"]]), float(row[ix["comm_exposed_s"]])
        scale = min(1.0, total / base_total)  # jitter; a wait for a slower rank lands in the last reduction
        others = sum(c["s"] * scale for i, c in enumerate(plan) if i != last_grad)
        # the waits in forward and in backward as modelled; the rest of the rank's exposed time (the last
        # reduction, a slower rank) after backward
        f_wait = min(waits["forward"] * scale, exposed)
        b_wait = min(waits["backward"] * scale, exposed - f_wait)
        # each record's wait: within its own time (the forward's on the forward all-gathers; the backward's
        # on its late all-gathers, or — nothing overlapped — spread over backward's collectives)
        wait_of: dict[int, float] = {}
        for _when, w, idx in (("forward", f_wait, [i for i, c in enumerate(plan) if c["when"] == "forward"]),
                             ("backward", b_wait, [bwd_ag] if bwd_ag is not None and not spec.comm_bound else
                              [i for i, c in enumerate(plan) if c["when"] == "backward" and i != last_grad])):
            cap = sum(plan[i]["s"] * scale for i in idx)
            for i in idx:
                wait_of[i] = min(w * plan[i]["s"] * scale / cap, plan[i]["s"] * scale) if cap > 0 else 0.0
        f_wait = sum(w for i, w in wait_of.items() if plan[i]["when"] == "forward")
        b_wait = sum(w for i, w in wait_of.items() if plan[i]["when"] == "backward")
        tail = exposed - f_wait - b_wait
        bwd_start = data + fwd + f_wait
        bwd_end = bwd_start + bwd + b_wait
        seq = 0
        for i, c in enumerate(plan):
            calls = int(c["calls"])
            if i != last_grad:  # all-gathers (and the earlier of HSDP's reductions): issued as the phase starts
                fwd_op = c["when"] == "forward"
                out.append((r, step, seq, c["op"], c["group"], int(c["bytes"]), calls, c["s"] * scale,
                            wait_of.get(i, 0.0), ts + (data if fwd_op else bwd_start), c["dim"]))
                seq += 1
                continue
            # the last reduction: its calls but the last issued during backward, the last one at its end
            # carrying any extra time (the wait for a slower rank); the tail waited for from the end back
            secs = max(total - others, tail)
            own = min(c["s"] * scale, secs)
            first_s = own * (calls - 1) / calls if calls > 1 else 0.0
            last_s = secs - first_s
            last_w = min(tail, last_s)
            if first_s > 0:
                out.append((r, step, seq, c["op"], c["group"], int(c["bytes"] * (calls - 1) / calls), calls - 1,
                            first_s, min(tail - last_w, first_s), ts + bwd_start + bwd / calls, c["dim"]))
                seq += 1
            out.append((r, step, seq, c["op"], c["group"], int(c["bytes"] / calls), 1, last_s, last_w,
                        ts + bwd_end, c["dim"]))
            seq += 1
    return out
