"""Projections (docs/analysis.md, "Projections"): one run's step at another data-parallel size, tensor /
pipeline degree, micro-batch count or gradient bucket size, calibrated on the run's own measurements and
on the bus bandwidth this cluster measured. Pure: figures, collective rollups and busbw points in; dicts out.

The projected step is the run's measured decomposition with each part moved by what changes:

* compute: the run's achieved FLOP/s per rank held, applied to the new per-rank work (model FLOPs
  scale with 1 / (tp·pp), and with 1 / dp when the global batch is held);
* communication, per collective class (op × group × message size): the class's measured seconds times
  the ratio of the alpha-beta time at the new group size and message size to that at the old one, the
  time read from the cluster's busbw table (``BusbwTable``); exposed = the share the run left exposed,
  at least what the compute it hid behind (scaled like compute) can no longer hide;
* the pipeline bubble from the schedule, (pp − 1) / m of the per-stage compute (1F1B / GPipe),
  calibrated on the measured bubble when the run was pipelined;
* data wait, other and the straggler wait as measured.

The medians of the parts do not add up to the median step exactly: every part is multiplied by the
run's own ratio step / Σ parts so that the projection at the run's own layout is its measured step.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetscope.wire import busbw_factor

__all__ = ["Layout", "CommClass", "BusbwPoint", "BusbwTable", "Baseline", "Estimate", "project", "dim_kind",
           "latency_steps", "bubble_fraction", "track_error", "error_summary", "PRIOR_SIZE_EXTRAPOLATION",
           "PRIOR_WORLD_EXTRAPOLATION_PER_DOUBLING", "MIN_STEPS", "LATENCY_BOUND_BYTES"]

#: relative error assumed for a busbw read outside the measured message sizes (until a track record exists)
PRIOR_SIZE_EXTRAPOLATION = 0.10
#: relative error assumed per doubling of the group size beyond (or below) the measured ones
PRIOR_WORLD_EXTRAPOLATION_PER_DOUBLING = 0.05
#: fewer steps than this and the run's medians are not a steady step
MIN_STEPS = 3

_P2P_OPS = ("send", "recv")
_DP_DIMS = ("dp", "ddp", "fsdp", "hsdp", "data", "replicate", "shard", "world", "dp_shard", "dp_replicate")
_TP_DIMS = ("tp", "tensor", "sp", "sequence_parallel")
_PP_DIMS = ("pp", "pipeline", "<p2p>")


@dataclass(frozen=True)
class Layout:
    """A parallel layout: world size = dp · tp · pp."""

    world_size: int
    tp: int = 1
    pp: int = 1
    micro_batches: int | None = None  # pipeline micro-batches per step (None: not pipelined / unknown)
    bucket_bytes: float | None = None  # gradient all-reduce bucket (None: as the run)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"world_size {self.world_size} is not a multiple of tp·pp = {self.tp}·{self.pp}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be ≥ 1, got {self.micro_batches}")
        if self.bucket_bytes is not None and not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "micro_batches": self.micro_batches, "bucket_bytes": self.bucket_bytes}


@dataclass(frozen=True)
class CommClass:
    """A run's collectives of one op × group size × message size (sums over its rank-steps)."""

    op: str
    group_size: int
    bytes: float  # summed bytes
    calls: float  # summed calls
    total_s: float
    exposed_s: float
    dim: str | None = None

    @property
    def bytes_per_call(self) -> float:
        return self.bytes / self.calls if self.calls > 0 else 0.0


@dataclass(frozen=True)
class BusbwPoint:
    """One measurement of bus bandwidth (bytes/s) of ``op`` over ``n`` ranks at message size ``size_bytes``."""

    op: str
    n: int
    size_bytes: float
    busbw: float
    source: str  # "run:<id>" or "bench:<series id>"


@dataclass(frozen=True)
class Estimate:
    """A collective's time from the table: seconds, how it was read, what it rests on."""

    seconds: float
    how: str  # measured | interpolated | extrapolated_size | extrapolated_world | no_data
    sources: tuple[str, ...]
    spread: float  # relative


def latency_steps(op: str, n: int) -> int:
    """Latency terms (alpha) of the ring algorithm: all_reduce 2(n−1), all_gather / reduce_scatter /
    all_to_all n−1, a point-to-point or rooted op 1."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "barrier"):
        return n - 1
    return 1


#: messages up to this size are latency-bound (their busbw is not a bandwidth figure, docs/metrics.md):
#: the latency term is fitted only when one was measured
LATENCY_BOUND_BYTES = 1 << 20


def _fit_alpha_beta(op: str, n: int, pts: Sequence[BusbwPoint]) -> tuple[float, float] | None:
    """Least squares t = L + size·factor / beta over the points of one op and group size, with L ≥ 0:
    (L, beta); None without two sizes or without a latency-bound (≤ 1 MiB) measurement — large
    messages alone do not show the latency term, and differences in their busbw are not latency."""
    f = busbw_factor(op, n)
    xt = [(p.size_bytes * f, p.size_bytes * f / p.busbw) for p in pts]
    if len({x for x, _ in xt}) < 2 or not any(p.size_bytes <= LATENCY_BOUND_BYTES for p in pts):
        return None
    mx = statistics.fmean(x for x, _ in xt)
    mt = statistics.fmean(t for _, t in xt)
    sxx = sum((x - mx) ** 2 for x, _ in xt)
    slope = sum((x - mx) * (t - mt) for x, t in xt) / sxx
    lat = mt - slope * mx
    if lat < 0 or slope <= 0:  # bandwidth alone describes it better
        slope = sum(x * t for x, t in xt) / sum(x * x for x, _ in xt)
        lat = 0.0
    return (lat, 1.0 / slope) if slope > 0 else None


class BusbwTable:
    """The cluster's busbw by op × group size × message size, from runs' collectives and bench results.

    Read at the measured group size: busbw interpolated linearly in log(size) between the measured
    sizes; outside them the alpha-beta fit of that group size (t = L + size·factor / beta). At another
    group size: the nearest measured one's latency scaled by the ring's latency steps and its bandwidth
    term by the busbw factor (busbw is the per-link figure that does not change with n on a ring)."""

    def __init__(self, points: Iterable[BusbwPoint]) -> None:
        self._by: dict[str, dict[int, list[BusbwPoint]]] = {}
        for p in points:
            if p.busbw > 0 and p.size_bytes > 0 and p.n >= 2 and math.isfinite(p.busbw):
                self._by.setdefault(p.op, {}).setdefault(int(p.n), []).append(p)
        for per_n in self._by.values():
            for lst in per_n.values():
                lst.sort(key=lambda p: p.size_bytes)

    def ops(self) -> list[str]:
        return sorted(self._by)

    def without(self, sources: Collection[str]) -> BusbwTable:
        """The table less the points of ``sources``."""
        return BusbwTable(p for per_n in self._by.values() for pts in per_n.values() for p in pts
                          if p.source not in sources)

    def covers(self, op: str, n: int) -> bool:
        """Whether a point of ``op`` (or of the op it falls back to) was measured at group size ``n``."""
        found = self._op(op)
        return found is not None and n in found[1]

    def sizes(self, op: str) -> list[int]:
        return sorted(self._by.get(op, {}))

    def _op(self, op: str) -> tuple[str, dict[int, list[BusbwPoint]]] | None:
        if op in self._by:
            return op, self._by[op]
        if op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce") and "all_reduce" in self._by:
            return "all_reduce", self._by["all_reduce"]  # busbw is the per-link figure, comparable across ring ops
        return None

    def _at_n(self, op: str, n: int, size: float, pts: list[BusbwPoint]) -> tuple[float, str, list[BusbwPoint]]:
        f = busbw_factor(op, n)
        sizes = sorted({p.size_bytes for p in pts})
        by_size: dict[float, list[float]] = {}
        for p in pts:
            by_size.setdefault(p.size_bytes, []).append(p.busbw)
        med = {s: statistics.median(v) for s, v in by_size.items()}
        if sizes[0] <= size <= sizes[-1]:
            i = bisect.bisect_left(sizes, size)
            if sizes[i] == size:
                near = [p for p in pts if p.size_bytes == size]
                return size * f / med[size], "measured", near
            lo, hi = sizes[i - 1], sizes[i]
            w = (math.log(size) - math.log(lo)) / (math.log(hi) - math.log(lo))
            bw = med[lo] * (1 - w) + med[hi] * w
            return size * f / bw, "interpolated", [p for p in pts if p.size_bytes in (lo, hi)]
        fit = _fit_alpha_beta(op, n, pts)
        edge = sizes[0] if size < sizes[0] else sizes[-1]
        near = [p for p in pts if p.size_bytes == edge]
        if fit is None:
            return size * f / med[edge], "extrapolated_size", near
        lat, beta = fit
        return lat + size * f / beta, "extrapolated_size", near

    def time_s(self, op: str, n: int, size: float) -> Estimate | None:
        """Seconds of one ``op`` call of ``size`` bytes over ``n`` ranks, or None without a measurement."""
        if n <= 1 or size <= 0:
            return Estimate(0.0, "measured", (), 0.0)
        found = self._op(op)
        if found is None:
            return None
        _, per_n = found
        if n in per_n:
            t, how, used = self._at_n(op, n, size, per_n[n])
            spread = _spread([p.busbw for p in used])
            if how == "extrapolated_size":
                spread = math.hypot(spread, PRIOR_SIZE_EXTRAPOLATION)
            return Estimate(t, how, tuple(sorted({p.source for p in used})), spread)
        n_ref = min(per_n, key=lambda m: (abs(math.log(m) - math.log(n)), -m))
        pts = per_n[n_ref]
        t_ref, how, used = self._at_n(op, n_ref, size, pts)
        f_ref = busbw_factor(op, n_ref)
        fit = _fit_alpha_beta(op, n_ref, pts)
        lat_ref = min(fit[0], t_ref) if fit is not None else 0.0
        bw_part = t_ref - lat_ref
        lat_steps_ref = latency_steps(op, n_ref)
        t = (lat_ref * latency_steps(op, n) / lat_steps_ref if lat_steps_ref else 0.0) \
            + bw_part * busbw_factor(op, n) / f_ref
        doublings = abs(math.log2(n / n_ref))
        spread = math.hypot(_spread([p.busbw for p in used]), PRIOR_WORLD_EXTRAPOLATION_PER_DOUBLING * doublings)
        return Estimate(t, "extrapolated_world", tuple(sorted({p.source for p in used})), spread)


def _spread(vals: Sequence[float]) -> float:
    """Relative spread of repeated measurements (coefficient of variation; 0 for one)."""
    if len(vals) < 2:
        return 0.0
    m = statistics.fmean(vals)
    return statistics.pstdev(vals) / m if m > 0 else 0.0


@dataclass(frozen=True)
class Baseline:
    """What the projection rests on: the run's figures (medians over steps) and its collective rollup."""

    run_id: int
    layout: Layout
    steps: int
    step_s: float | None
    data_s: float | None
    compute_s: float | None
    comm_exposed_s: float | None
    other_s: float | None
    comm_total_s: float | None
    straggler_wait_s: float | None = None
    step_s_p95: float | None = None
    flops_per_rank_step: float | None = None
    flops_estimated: bool = False
    peak_flops: float | None = None
    tokens_per_s: float | None = None
    bubble_s: float | None = None  # measured pipeline bubble (a part of exposed comm)
    collectives: tuple[CommClass, ...] = field(default_factory=tuple)


def dim_kind(c: CommClass, layout: Layout) -> str:
    """Which parallel dimension a class belongs to: dp, tp, pp or other (by its name, else its group size)."""
    if c.op in _P2P_OPS:
        return "pp"
    d = (c.dim or "").lower()
    if d:
        if d in _DP_DIMS:
            return "dp"
        if d in _TP_DIMS:
            return "tp"
        if d in _PP_DIMS:
            return "pp"
        if not d.startswith("g"):
            return "other"
    if c.group_size == layout.world_size and layout.tp * layout.pp == 1:
        return "dp"
    if layout.tp > 1 and c.group_size == layout.tp:
        return "tp"
    if c.group_size == layout.dp:
        return "dp"
    return "other"


def bubble_fraction(pp: int, m: int) -> float:
    """Share of a 1F1B / GPipe step the pipeline is idle: (pp − 1) / (m + pp − 1)."""
    return (pp - 1) / (m + pp - 1) if pp > 1 else 0.0


def _scaled_class(c: CommClass, kind: str, b: Layout, t: Layout, hold_global_batch: bool) -> tuple[int, float, float]:
    """(new group size, new bytes per call, calls factor) of a class at layout ``t``."""
    size = c.bytes_per_call
    calls = 1.0
    if kind == "dp":
        g = t.world_size if (c.dim or "").lower() == "world" or c.group_size == b.world_size else t.dp
        size *= (b.tp * b.pp) / (t.tp * t.pp)  # gradients / parameters of the rank's model shard
        if t.bucket_bytes is not None and c.op in ("all_reduce", "reduce_scatter") and size > 0:
            # the step's gradient bytes are the same, split into calls of the new bucket size
            calls = size / t.bucket_bytes
            size = t.bucket_bytes
        return g, size, calls
    if kind == "tp":
        m0, m1 = b.micro_batches or 1, t.micro_batches or b.micro_batches or 1
        size *= m0 / m1  # activations of a smaller micro-batch
        calls *= (b.pp / t.pp) * (m1 / m0)  # layers per stage × micro-batches
        if hold_global_batch:
            size *= b.dp / t.dp
        return t.tp, size, calls
    return c.group_size, size, calls


def project(base: Baseline, target: Layout, table: BusbwTable, *, hold_global_batch: bool = False,
            track_record: float | None = None) -> dict[str, Any]:
    """The step of ``base`` at ``target`` (module docstring): ``{"status", "step_s", "mfu",
    "tokens_per_s", "parts", "error_band", "basis", "missing"}``; ``status: "insufficient_data"`` with
    what is missing when the run's measurements do not support it. ``track_record``: the median
    relative error of this family's checked projections (widens the band)."""
    b = base.layout
    missing: list[str] = []
    if base.step_s is None or base.steps < MIN_STEPS:
        missing.append(f"steady steps: the run has {base.steps} compacted step(s), at least {MIN_STEPS} are needed")
    if base.compute_s is None:
        missing.append("compute time (compute_s) of the run's steps")
    if b.pp > 1 and (b.micro_batches is None) and target.pp > 1:
        missing.append("the run's pipeline micro-batch count (pp_schedule event or config micro_batches)")
    if target.pp > 1 and target.micro_batches is None and b.micro_batches is None:
        missing.append("micro_batches for a pipelined target (pass micro_batches)")
    changes_layout = (target.world_size, target.tp, target.pp) != (b.world_size, b.tp, b.pp) \
        or target.bucket_bytes is not None
    exposed_meas = base.comm_exposed_s or 0.0
    if changes_layout and exposed_meas > 0 and not base.collectives:
        missing.append("the run's collectives (none recorded): communication cannot be moved to another layout")
    if missing:
        return {"status": "insufficient_data", "missing": missing, "step_s": None, "mfu": None, "tokens_per_s": None,
                "parts": None, "error_band": None, "basis": {"run": base.run_id, "layout": b.as_dict()}}
    assert base.step_s is not None and base.compute_s is not None
    w = (b.tp * b.pp) / (target.tp * target.pp) * ((b.dp / target.dp) if hold_global_batch else 1.0)
    m0 = b.micro_batches or 1
    m1 = target.micro_batches or b.micro_batches or 1
    compute1 = base.compute_s * w
    data0 = base.data_s or 0.0
    other0 = base.other_s or 0.0
    wait0 = min(base.straggler_wait_s or 0.0, exposed_meas)
    bubble0 = min(base.bubble_s or 0.0, max(0.0, exposed_meas - wait0)) if b.pp > 1 else 0.0
    exposed0 = max(0.0, exposed_meas - wait0 - bubble0)
    # collectives, per class: measured per-step seconds moved by the table's time ratio
    classes = [c for c in base.collectives if c.total_s > 0 and c.op != "barrier"]
    sum_total = sum(c.total_s for c in base.collectives if c.total_s > 0)
    per_step = (base.comm_total_s or 0.0) / sum_total if sum_total > 0 else 0.0
    comm_rows: list[dict[str, Any]] = []
    model_exp0 = model_exp1 = total1 = 0.0
    sources: set[str] = set()
    spreads: list[tuple[float, float]] = []  # (seconds exposed, relative spread)
    others = table.without({f"run:{base.run_id}"})
    for c in classes:
        kind = dim_kind(c, b)
        t0 = c.total_s * per_step
        e = min(max(c.exposed_s / c.total_s, 0.0), 1.0)
        if kind == "pp":
            continue  # the pipeline's point-to-point waits are its bubble (modelled from the schedule)
        g1, s1, calls_f = _scaled_class(c, kind, b, target, hold_global_batch)
        same = g1 == c.group_size and abs(s1 - c.bytes_per_call) <= 1e-9 * max(1.0, s1) and calls_f == 1.0
        row: dict[str, Any] = {"op": c.op, "dim": kind, "group_size": c.group_size, "bytes_per_call": c.bytes_per_call,
                               "to_group_size": g1, "to_bytes_per_call": s1, "seconds": t0, "exposed_s": t0 * e}
        if same or kind == "other":
            t1 = t0
            row["how"] = "as measured"
        else:
            # both times from one consistent curve: other runs and benches measured at the run's own group size
            # set the ratio (a run's own level — contention, waits — is in its measured seconds already);
            # only where nothing else was measured there does the run's own collective anchor it
            ref = others if others.covers(c.op, c.group_size) else table
            est0 = ref.time_s(c.op, c.group_size, c.bytes_per_call)
            est1 = ref.time_s(c.op, g1, s1)
            if est0 is None or est1 is None or est0.seconds <= 0:
                missing.append(f"bus bandwidth of {c.op} on this cluster (no run or bench measured it)")
                continue
            t1 = t0 * calls_f * est1.seconds / est0.seconds
            row["how"] = est1.how
            row["sources"] = list(est1.sources)
            sources.update(est0.sources + est1.sources)
            spreads.append((t1, math.hypot(est0.spread, est1.spread)))
        hidden0 = t0 * (1 - e)
        exp1 = max(t1 * e, t1 - hidden0 * w)  # the share it left exposed, or what the scaled compute cannot hide
        row.update({"to_seconds": t1, "to_exposed_s": exp1})
        comm_rows.append(row)
        model_exp0 += t0 * e
        model_exp1 += exp1
        total1 += t1
    if missing:
        return {"status": "insufficient_data", "missing": sorted(set(missing)), "step_s": None, "mfu": None,
                "tokens_per_s": None, "parts": None, "error_band": None,
                "basis": {"run": base.run_id, "layout": b.as_dict()}}
    cal = exposed0 / model_exp0 if model_exp0 > 0 else 1.0
    exposed1 = model_exp1 * cal if model_exp0 > 0 else (exposed0 + max(0.0, model_exp1))
    # pipeline bubble: (pp−1)/m of the per-stage compute, calibrated on the measured bubble
    model_b0 = base.compute_s * (b.pp - 1) / m0 if b.pp > 1 else 0.0
    model_b1 = compute1 * (target.pp - 1) / m1 if target.pp > 1 else 0.0
    if b.pp > 1 and base.bubble_s is not None and model_b0 > 0:
        bubble1, bubble_how = bubble0 * model_b1 / model_b0, "measured bubble scaled by the schedule"
    else:
        bubble1, bubble_how = model_b1, "from the schedule (pp−1)/m (not measured on this run)"
    parts0 = {"data": data0, "compute": base.compute_s, "comm_exposed": exposed0, "other": other0,
              "bubble": bubble0, "straggler_wait": wait0}
    sum0 = sum(parts0.values())
    k = base.step_s / sum0 if sum0 > 0 else 1.0
    raw1 = {"data": data0, "compute": compute1, "comm_exposed": exposed1, "other": other0, "bubble": bubble1,
            "straggler_wait": wait0}
    parts1 = {n: v * k for n, v in raw1.items()}
    step1 = sum(parts1.values())
    flops1 = base.flops_per_rank_step * w if base.flops_per_rank_step else None
    mfu1 = flops1 / step1 / base.peak_flops if flops1 and base.peak_flops and step1 > 0 else None
    tps1 = None
    if base.tokens_per_s and step1 > 0:
        tps1 = base.tokens_per_s * (1.0 if hold_global_batch else target.dp / b.dp) * base.step_s / step1
    # error band: the spread of the measurements used, in quadrature with the track record
    step_spread = ((base.step_s_p95 / base.step_s - 1.0) / 1.645) if base.step_s_p95 and base.step_s > 0 else 0.0
    step_spread = max(0.0, step_spread)
    comm_rel = math.sqrt(sum((s * r) ** 2 for s, r in spreads)) / step1 if step1 > 0 and spreads else 0.0
    rel = math.sqrt(step_spread ** 2 + comm_rel ** 2 + (track_record or 0.0) ** 2)
    how = sorted({r["how"] for r in comm_rows})
    extrap = [h for h in how if h.startswith("extrapolated")]

    def band(v: float | None) -> list[float] | None:
        return [v * (1 - rel), v * (1 + rel)] if v is not None else None

    return {
        "status": "ok",
        "missing": [],
        "estimated": True,
        "step_s": step1,
        "mfu": mfu1,
        "tokens_per_s": tps1,
        "comm_total_s": total1 * (base.comm_total_s or 0.0) / sum(r["seconds"] for r in comm_rows)
        if comm_rows and sum(r["seconds"] for r in comm_rows) > 0 else base.comm_total_s,
        "flops_per_rank_step": flops1,
        "parts": parts1,
        "error_band": {"relative": rel, "step_s": band(step1), "mfu": band(mfu1) if mfu1 is not None else None,
                       "tokens_per_s": band(tps1),
                       "from": {"step_spread": step_spread, "collectives": comm_rel, "track_record": track_record}},
        "basis": {
            "run": base.run_id,
            "layout": b.as_dict(),
            "target": target.as_dict(),
            "batch": "global batch held" if hold_global_batch else "per-replica batch held",
            "measured_step_s": base.step_s,
            "measured_parts": {n: v * k for n, v in parts0.items()},
            "calibration": k,
            "work_factor": w,
            "flops": ("estimated" if base.flops_estimated else "measured") if base.flops_per_rank_step else None,
            "achieved_flops_per_s": base.flops_per_rank_step / base.compute_s
            if base.flops_per_rank_step and base.compute_s else None,
            "collectives": comm_rows,
            "sources": sorted(sources),
            "sizes": "interpolated" if not extrap else ", ".join(extrap),
            "bubble": bubble_how if target.pp > 1 or b.pp > 1 else None,
            "held_as_measured": ["data", "other", "straggler_wait"],
        },
    }


def track_error(projected_step_s: float, measured_step_s: float) -> float:
    """Relative error of a projection: projected / measured − 1 (positive: it projected slower)."""
    return projected_step_s / measured_step_s - 1.0


def error_summary(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median and worst |error| overall and per world-size ratio (target / baseline) of checked projections."""
    def stats(xs: list[float]) -> dict[str, Any]:
        a = [abs(x) for x in xs]
        return {"n": len(a), "median_abs_error": statistics.median(a) if a else None, "worst_abs_error": max(a, default=None)}

    by_ratio: dict[str, list[float]] = {}
    for e in errors:
        r = e["world_size"] / e["from_world_size"] if e.get("from_world_size") else None
        by_ratio.setdefault(f"{r:g}" if r is not None else "?", []).append(float(e["error"]))
    return {**stats([float(e["error"]) for e in errors]),
            "by_ratio": {k: stats(v) for k, v in sorted(by_ratio.items())}}
