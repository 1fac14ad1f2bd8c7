"""Kernel hotspots over a run (docs/metrics.md, "Kernel hotspots"): the agent's sampled trace windows
(``trace_summary`` events, each one rank's ``top_kernels`` over a few profiled steps) folded into
bounded per-run sums, and the report made of them — top kernels by time across ranks and over the run,
with category, share, trend (first vs last window) and rank spread.

Pure: windows and stored rows come in as plain tuples (``store.kernels``), the folded state goes back
as plain tuples.

Bounds. A run keeps at most ``MAX_NAMES`` distinct kernel names (in the order they first arrive); a
later name is summed into its category's "other" row (``other_name``), as are the kernels each window
already folded into HTA's ``others`` row. So ``run_kernels`` holds at most ``(MAX_NAMES + len(
CATEGORIES)) × ranks`` rows, ``run_kernel_ranks`` one row per rank, whatever the run's length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

from fleetscope.traces.classify import COMMUNICATION, MEMORY, kernel_type_corrected

from ..limits import MAX_KERNELS_PER_TRACE

__all__ = [
    "CATEGORIES",
    "MAX_NAMES",
    "MAX_NAME_CHARS",
    "kernel_category",
    "other_name",
    "Window",
    "window_from_event",
    "RankAcc",
    "KernelAcc",
    "KernelState",
    "fold_windows",
    "fold_rows",
    "top_names",
    "kernel_report",
    "bound_top_kernels",
]

#: kernel categories, in the order reports list ties
CATEGORIES = ("gemm", "attention", "conv", "comm", "norm", "softmax", "reduction", "elementwise", "optimizer",
              "embedding", "memcpy", "other")
MAX_NAMES = 128  # distinct kernel names kept per run
MAX_NAME_CHARS = 512  # longer names (templated CUTLASS kernels) are cut

# first match wins, case-insensitively, on the kernel's own name (its namespace and function, without
# "void", template arguments or parameters: those mention unrelated types); a generic head such as
# cutlass::Kernel<cutlass_80_tensorop_s1688gemm...> is then matched on its first template argument
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((c, re.compile(p, re.I)) for c, p in (
    ("attention", r"flash|fmha|attention|attn|sdpa|mha"),
    ("conv", r"conv|winograd|implicit_gemm|dgrad|wgrad|fprop"),
    ("embedding", r"embedding|index_?select"),
    ("gemm", r"(?<!fb)gemm|cutlass|cublas|xmma|nvjet|matmul|gemv|bmm|triton_tem"),
    ("norm", r"norm|(^|::|_)bn_"),
    ("softmax", r"softmax"),
    ("optimizer", r"multi_tensor_apply|adam|sgd|lamb|fused_optim"),
    ("reduction", r"reduce|reduction|triton_red|triton_per|(^|::)cub::|radix_?sort|sort|scan|argmax|argmin"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|copy|permute|transpose|nchwtonhwc"
                    r"|nhwctonchw|fill|where"),
))  # fmt: skip
_GENERIC_HEAD = re.compile(r"(^|::)(kernel\d*|cutlass::kernel\d*)$", re.I)


def _head(name: str) -> tuple[str, str]:
    """(namespace::function, first template argument) of a demangled kernel name."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    n = n.replace("(anonymous namespace)", "").split("(", 1)[0]
    head, _, args = n.partition("<")
    return head.strip(), re.split(r"[,<>]", args, maxsplit=1)[0].strip()


def _rule(text: str) -> str | None:
    for cat, rx in _RULES:
        if rx.search(text):
            return cat
    return None


def kernel_category(name: str) -> str:
    """The category of a GPU kernel by its name: communication and memory as HTA's (corrected)
    classifier says, then the first matching rule of ``_RULES``, else ``"other"``."""
    t = kernel_type_corrected(name)
    if t == COMMUNICATION:
        return "comm"
    if t == MEMORY:
        return "memcpy"
    head, first_arg = _head(name)
    cat = _rule(head)
    if (cat is None or _GENERIC_HEAD.search(head)) and first_arg:
        cat = _rule(first_arg) or cat
    return cat or "other"


def other_name(category: str) -> str:
    """The row kernels beyond the name bound (and HTA's folded ``others``) are summed into."""
    return "(other kernels)" if category == "other" else f"(other {category} kernels)"


_RESERVED = frozenset(other_name(c) for c in CATEGORIES)
_HTA_OTHERS = {"COMMUNICATION": "comm", "MEMORY": "memcpy"}  # folded rows of other HTA types: "other"


@dataclass(frozen=True)
class Window:
    """One rank's sampled trace window: its first step, profiled steps, and per kernel name
    (category, summed µs, launches)."""

    rank: int
    seq: int
    step: int
    steps: int
    kernels: dict[str, tuple[str, float, int]]


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and f >= 0 else None


def window_from_event(rank: int, seq: int, step: int | None, data: Any) -> Window | None:
    """A ``trace_summary`` event's data as a window; None for one without usable kernels (a CPU-only
    trace, malformed data). Entries that are not well-formed are skipped one by one."""
    if not isinstance(data, Mapping):
        return None
    summary = data.get("summary")
    if not isinstance(summary, Mapping):
        return None
    rows = summary.get("top_kernels")
    if not isinstance(rows, list) or not rows:
        return None
    steps = data.get("active_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        listed = summary.get("profiler_steps") or summary.get("steps")
        steps = len(listed) if isinstance(listed, list) and listed else 1
    first = data.get("first_step", step)
    if not isinstance(first, int) or isinstance(first, bool):
        first = step if isinstance(step, int) else 0
    kernels: dict[str, tuple[str, float, int]] = {}
    for r in rows:
        if not isinstance(r, Mapping):
            continue
        name, us = r.get("name"), _finite(r.get("sum_us"))
        if not isinstance(name, str) or not name or us is None:
            continue
        count = r.get("count")
        n = int(count) if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
        if name == "others":  # HTA folded these: one row per HTA type
            cat = _HTA_OTHERS.get(str(r.get("kernel_type")), "other")
            name = other_name(cat)
        else:
            name = name[:MAX_NAME_CHARS]
            cat = kernel_category(name)
        c0, us0, n0 = kernels.get(name, (cat, 0.0, 0))
        kernels[name] = (c0, us0 + us, n0 + n)
    if not kernels:
        return None
    return Window(rank=int(rank), seq=int(seq), step=int(first), steps=int(steps), kernels=kernels)


@dataclass
class RankAcc:
    """A rank's folded windows: how many, their profiled steps, kernel µs, first and last window step."""

    windows: int = 0
    steps: int = 0
    kernel_us: float = 0.0
    first_step: int = 0
    last_step: int = 0


@dataclass
class KernelAcc:
    """One kernel on one rank: summed µs and launches over the windows it appears in, and its µs per
    profiled step in the rank's first and last window (0 when absent there)."""

    category: str
    time_us: float = 0.0
    launches: int = 0
    windows: int = 0
    first_us: float = 0.0
    last_us: float = 0.0


@dataclass
class KernelState:
    """The folded state of the ranks a fold touches, plus every kernel name the run keeps."""

    ranks: dict[int, RankAcc] = field(default_factory=dict)
    kernels: dict[int, dict[str, KernelAcc]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


def fold_windows(state: KernelState, windows: Iterable[Window]) -> set[int]:
    """Add windows to ``state`` (in place); returns the ranks whose rows changed. Order-free: a window
    older than a rank's first one becomes its first, a newer one its last, whatever the arrival
    order; each window must be folded once (the store keeps which were)."""
    touched: set[int] = set()
    for w in sorted(windows, key=lambda w: (w.rank, w.step, w.seq)):
        mapped: dict[str, tuple[str, float, int]] = {}
        for name, (cat, us, n) in w.kernels.items():
            if name not in _RESERVED and name not in state.names:
                if len(state.names - _RESERVED) < MAX_NAMES:
                    state.names.add(name)
                else:
                    name = other_name(cat)
            c0, us0, n0 = mapped.get(name, (cat, 0.0, 0))
            mapped[name] = (c0, us0 + us, n0 + n)
        ra = state.ranks.get(w.rank)
        ks = state.kernels.setdefault(w.rank, {})
        if ra is None:
            ra = state.ranks[w.rank] = RankAcc(first_step=w.step, last_step=w.step)
            is_first = is_last = True
        else:
            is_first, is_last = w.step < ra.first_step, w.step > ra.last_step
        ra.windows += 1
        ra.steps += w.steps
        ra.kernel_us += sum(us for _, us, _ in mapped.values())
        for name, (cat, us, n) in mapped.items():
            acc = ks.get(name)
            if acc is None:
                acc = ks[name] = KernelAcc(category=cat)
            acc.time_us += us
            acc.launches += n
            acc.windows += 1
        if is_first:
            ra.first_step = w.step
            for name, acc in ks.items():
                acc.first_us = mapped[name][1] / w.steps if name in mapped else 0.0
        if is_last:
            ra.last_step = w.step
            for name, acc in ks.items():
                acc.last_us = mapped[name][1] / w.steps if name in mapped else 0.0
        touched.add(w.rank)
    return touched


def fold_rows(stored: tuple[Mapping[int, tuple[int, int, float, int, int]],
                          Mapping[int, Mapping[str, tuple[str, float, int, int, float, float]]], Iterable[str]],
              rows: Sequence[tuple[int, int, int | None, Any]]) -> tuple[
        dict[int, tuple[int, int, float, int, int]], dict[int, dict[str, tuple[str, float, int, int, float, float]]],
        set[str]]:
    """:func:`fold_windows` on the store's row shapes (``store.kernels``): the stored state of the ranks
    the new ``(rank, seq, step, data)`` event rows belong to in, the changed rows of those ranks out."""
    rank_rows, kernel_rows, names = stored
    st = KernelState(ranks={r: RankAcc(*v) for r, v in rank_rows.items()},
                     kernels={r: {n: KernelAcc(*v) for n, v in ks.items()} for r, ks in kernel_rows.items()},
                     names=set(names))
    windows = [w for r, s, step, d in rows if (w := window_from_event(r, s, step, d)) is not None]
    touched = fold_windows(st, windows)
    return ({r: astuple(st.ranks[r]) for r in touched},
            {r: {n: astuple(acc) for n, acc in st.kernels[r].items()} for r in touched}, st.names)


_HTA_TYPES = ("COMPUTATION", "COMMUNICATION", "MEMORY")


def bound_top_kernels(rows: Any, cap: int = MAX_KERNELS_PER_TRACE) -> tuple[Any, int]:
    """A trace summary's ``top_kernels`` with at most ``cap`` named kernels: beyond it, the named rows
    with the most ``sum_us`` are kept (ties: the earlier row) and the rest are summed — with the rows
    HTA already folded — into one ``others`` row per kernel type (``COMPUTATION``, ``COMMUNICATION``,
    ``MEMORY``, anything else ``OTHER``: ``{"kernel_type", "name": "others", "count", "kernels",
    "sum_us"}``, HTA's own shape), so ``sum_us`` and ``count`` totals are preserved; entries that are not
    objects are dropped. Returns (the rows, named rows folded); a list within the cap comes back as is."""
    if not isinstance(rows, list) or len(rows) <= cap:
        return rows, 0

    def num(v: Any) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0

    dicts = [r for r in rows if isinstance(r, Mapping)]
    named = [i for i, r in enumerate(dicts) if r.get("name") != "others"]
    keep = set(sorted(named, key=lambda i: -num(dicts[i].get("sum_us")))[:cap])
    others: dict[str, dict[str, Any]] = {}
    n_folded = len(rows) - len(dicts)
    for i, r in enumerate(dicts):
        if i in keep:
            continue
        t = r.get("kernel_type")
        t = t if t in _HTA_TYPES else "OTHER"
        o = others.setdefault(t, {"kernel_type": t, "name": "others", "count": 0, "kernels": 0, "sum_us": 0.0})
        is_others = r.get("name") == "others"
        n_folded += not is_others
        o["count"] += int(num(r.get("count")))
        o["kernels"] += int(num(r.get("kernels"))) if is_others else 1
        o["sum_us"] += num(r.get("sum_us"))
    return [dict(r) for i, r in enumerate(dicts) if i in keep] + [others[t] for t in (*_HTA_TYPES, "OTHER")
                                                                    if t in others], n_folded


def top_names(totals: Sequence[tuple[str, str, float, int]], top: int) -> list[str]:
    """The ``top`` kernel names by time over the run (ties by name) from (name, category, µs, launches)."""
    return [t[0] for t in sorted(totals, key=lambda t: (-t[2], t[0]))[:top]]


#: a finding needs this share of kernel time; a trend this ratio; a rank this spread (max / median)
FINDING_SHARE = 0.05
TREND_RATIO = 1.2
SPREAD_RATIO = 1.2


#: a run's folded ranks in one row (``store.kernels.rank_summary``): ranks with windows, windows, profiled
#: rank-steps, first and last window step (None without ranks), ranks with ≥ 2 windows
RankSummary = tuple[int, int, int, int | None, int | None, int]
#: one kernel over the ranks with windows (``store.kernels.kernel_spread``): min, median and max of the
#: rank's µs per profiled step (0 where the kernel did not appear), the lowest rank with the max, and over
#: the ranks with ≥ 2 windows the median µs per step in their first window and in their last (None: no such rank)
KernelSpread = tuple[float, float, float, int, float | None, float | None]


def kernel_report(ranks: RankSummary, totals: Sequence[tuple[str, str, float, int]],
                  spread: Mapping[str, KernelSpread], top: int) -> dict[str, Any]:
    """The kernel report from the folded rows, aggregated over ranks in the store (so its cost does not
    grow with the ranks): ``ranks`` the rank summary, ``totals`` (name, category, µs, launches) summed
    over ranks, ``spread`` the per-rank figures of the names to show.

    Per kernel: ``time_us`` summed over ranks and windows; ``share`` of all kernel time; ``us_per_step``
    the mean per profiled rank-step; ``rank_spread`` min / median / max over the ranks with windows of
    the rank's µs per profiled step (0 where the kernel did not appear); ``trend`` over the ranks with
    ≥ 2 windows: median of the µs per step in their first window and in their last, and last / first."""
    n_ranks, n_windows, profiled, first_step, last_step, n_multi = ranks
    total_us = float(sum(t[2] for t in totals))
    total_steps = float(profiled)
    cats: dict[str, float] = {}
    for _, cat, us, _ in totals:
        cats[cat] = cats.get(cat, 0.0) + us
    kernels = []
    findings: list[str] = []
    for name, cat, us, launches in sorted(totals, key=lambda t: (-t[2], t[0]))[:top]:
        share = us / total_us if total_us > 0 else None
        sp = spread.get(name)
        rank_spread = trend = None
        if n_ranks and sp is not None:
            lo, med, hi, hi_rank, f, la = sp
            rank_spread = {"min_us": lo, "median_us": med, "max_us": hi, "max_rank": hi_rank,
                           "ratio": hi / med if med > 0 else None}
            if n_multi and f is not None and la is not None:
                trend = {"first_us": f, "last_us": la, "ratio": la / f if f > 0 else None, "ranks": n_multi}
        kernels.append({"name": name, "category": cat, "time_us": us, "share": share, "launches": int(launches),
                        "us_per_step": us / total_steps if total_steps > 0 else None,
                        "rank_spread": rank_spread, "trend": trend})
        if share is not None and share >= FINDING_SHARE and not name.startswith("("):
            if trend and trend["ratio"] is not None and trend["ratio"] >= TREND_RATIO:
                findings.append(f"{name[:80]} ({cat}, {share * 100:.0f} % of kernel time) takes {trend['ratio']:.2f}× "
                                f"longer per step in the last profiled window than in the first")
            if rank_spread and rank_spread["ratio"] is not None and rank_spread["ratio"] >= SPREAD_RATIO:
                findings.append(f"rank {rank_spread['max_rank']} spends {rank_spread['ratio']:.2f}× the median rank's "
                                f"time in {name[:80]} ({cat}, {share * 100:.0f} % of kernel time)")
    return {
        "ranks": n_ranks,
        "windows": n_windows,
        "profiled_rank_steps": int(total_steps),
        "first_step": first_step,
        "last_step": last_step,
        "kernel_us": total_us,
        "names": len(totals),
        "max_names": MAX_NAMES,
        "categories": [{"category": c, "time_us": v, "share": v / total_us if total_us > 0 else None}
                       for c, v in sorted(cats.items(), key=lambda kv: (-kv[1], CATEGORIES.index(kv[0])
                                                                        if kv[0] in CATEGORIES else 99))],
        "kernels": kernels,
        "findings": findings,
    }
