"""Network health (docs/metrics.md "Network health"): the ranks and nodes whose collectives are
slower than their peers'. Pure: decoded collective blocks and the rank → node map in, plain values out.

Collective records are compared only with records of the same **class**: the same op, group size,
parallel dimension (``dim``), power-of-two size bucket of the bytes per call, and kind —

* *bandwidth* records: ≥ ``LARGE_MESSAGE_BYTES`` (1 MiB) per call, barriers excluded. A rank's figure
  in a step is its busbw = Σ bytes × ``busbw_factor(op, n)`` / Σ total_s (NCCL-tests);
* *latency* records: smaller messages and barriers. A rank's figure is its time per call = Σ total_s / Σ calls.

Per (class, step) the reference is the **median rank** (classes with fewer than ``MIN_PEERS`` ranks
in the step are not compared). Per (step, rank), over the classes it took part in:

    busbw_ratio   = Σ_c T̂_c / Σ_c T_c    T̂_c = the rank's bytes × factor / the median rank's busbw
    latency_ratio = Σ_c T_c / Σ_c T̂_c    T̂_c = the rank's calls × the median rank's time per call

— the time the median rank's speed would have taken over the time taken (time-weighted, so a class
the rank spends most of its communication in counts most). A rank is **slow** when its busbw_ratio
is ≤ ``BUSBW_THRESHOLD`` (0.7) on more than half of its sampled steps, or its latency_ratio ≥
``LATENCY_THRESHOLD`` (1/0.7) on more than half of them (and it has at least ``MIN_STEPS`` such steps);
its reported ratios are the medians over those steps. A **node** is slow when more than half of its
measured ranks are slow (a slow link of a node shows on every rank of it; one slow GPU does not
make its node slow); its ratios are the medians of its ranks'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.wire import COLLECTIVE_OPS

__all__ = [
    "BUSBW_THRESHOLD",
    "LATENCY_THRESHOLD",
    "LARGE_MESSAGE_BYTES",
    "MIN_PEERS",
    "MIN_STEPS",
    "NetworkHealth",
    "network_health",
    "summary_network",
    "node_health_rows",
    "empty_network",
]

BUSBW_THRESHOLD = 0.7
LATENCY_THRESHOLD = 1.0 / BUSBW_THRESHOLD  # ≈ 1.43: the same slowdown as busbw ≤ 0.7
LARGE_MESSAGE_BYTES = 1 << 20  # the same bar as efficiency_large_messages (analysis.collectives)
MIN_PEERS = 3  # ranks of a class in one step needed for a median worth comparing with
MIN_STEPS = 3  # steps a rank needs before it can be called slow
SUMMARY_LIMIT = 50  # slow ranks listed in the summary (slow_ranks_total counts them all)

_OP = {name: i for i, name in enumerate(COLLECTIVE_OPS)}
_BARRIER = _OP["barrier"]
_OTHER = _OP["other"]
_ALL_REDUCE = _OP["all_reduce"]
_N_MINUS_1 = np.array([_OP["all_gather"], _OP["reduce_scatter"], _OP["all_to_all"]])


@dataclass
class NetworkHealth:
    """Per-rank network figures of one run (numpy arrays aligned on ``ranks``) and the verdicts."""

    ranks: np.ndarray  # ranks measured (either kind)
    busbw_ratio: np.ndarray  # median over steps; NaN without a bandwidth step
    busbw_steps: np.ndarray
    busbw_slow_steps: np.ndarray
    latency_ratio: np.ndarray
    latency_steps: np.ndarray
    latency_slow_steps: np.ndarray
    slow: np.ndarray  # bool
    steps_sampled: int
    classes: int
    hosts: Mapping[int, tuple[str | None, str | None]] = field(default_factory=dict)

    def node_of(self, rank: int) -> str | None:
        return self.hosts.get(rank, (None, None))[1]

    def nodes(self) -> dict[str, dict[str, Any]]:
        """{node: {"ranks", "slow_ranks", "busbw_ratio", "latency_ratio", "slow"}} for every node
        with a measured rank."""
        by: dict[str, list[int]] = {}
        for j, r in enumerate(self.ranks.tolist()):
            node = self.node_of(int(r))
            if node:
                by.setdefault(node, []).append(j)
        out = {}
        for node, js in by.items():
            idx = np.array(js)
            n_slow = int(self.slow[idx].sum())
            out[node] = {"ranks": len(js), "slow_ranks": n_slow, "busbw_ratio": _median(self.busbw_ratio[idx]),
                         "latency_ratio": _median(self.latency_ratio[idx]), "slow": n_slow * 2 > len(js)}
        return out


def _median(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else None


def _r(v: float | None) -> float | None:
    return None if v is None or not np.isfinite(v) else round(float(v), 4)


_DENSE_LIMIT = 1 << 24  # key spaces up to this size are grouped by bincount, larger ones by sorting


def _group_sums(key: np.ndarray, size: int, weights: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the distinct keys ascending, the sum of each weight per key) of non-negative int keys < size."""
    if size <= _DENSE_LIMIT:
        cnt = np.bincount(key, minlength=size)
        nz = np.flatnonzero(cnt)
        return nz, [np.bincount(key, weights=w, minlength=size)[nz] for w in weights]
    uk, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    return uk, [np.bincount(inv, weights=w, minlength=len(uk)) for w in weights]


def _median_by_group(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of the positive finite ``values`` per group id (0..n_groups-1); NaN where none. One
    float sort (group id × 1024 + ln value) instead of a two-key lexsort."""
    ok = np.isfinite(values) & (values > 0)
    v, g = values[ok], gid[ok]
    out = np.full(n_groups, np.nan)
    if not len(v):
        return out
    order = np.argsort(g * 1024.0 + np.clip(np.log(v), -400.0, 400.0))
    v = v[order]
    counts = np.bincount(g, minlength=n_groups)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    has = counts > 0
    lo = starts + (counts - 1) // 2
    hi = starts + counts // 2
    out[has] = (v[lo[has]] + v[hi[has]]) / 2
    return out


def _factor(op: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``fleetscope.wire.busbw_factor`` over arrays."""
    nf = np.maximum(n, 1).astype(np.float64)
    f = np.ones(len(op))
    f = np.where(op == _ALL_REDUCE, 2.0 * (nf - 1) / nf, f)
    f = np.where(np.isin(op, _N_MINUS_1), (nf - 1) / nf, f)
    return np.where(n <= 1, 1.0, f)


def _concat(blocks: Sequence[tuple[int, Mapping[str, np.ndarray] | None]]) -> dict[str, np.ndarray] | None:
    parts = [(i, d) for i, (_, d) in enumerate(blocks) if d is not None and len(d["rank"])]
    if not parts:
        return None
    cols = ("rank", "op", "group_size", "dim", "bytes", "calls", "total_s")
    out = {c: np.concatenate([np.asarray(d[c]) for _, d in parts]) for c in cols}
    out["step"] = np.concatenate([np.full(len(d["rank"]), i, dtype=np.int64) for i, d in parts])
    return out


def network_health(blocks: Sequence[tuple[int, Mapping[str, np.ndarray] | None]],
                   hosts: Mapping[int, tuple[str | None, str | None]], *, threshold: float = BUSBW_THRESHOLD,
                   latency_threshold: float = LATENCY_THRESHOLD, min_steps: int = MIN_STEPS) -> NetworkHealth:
    """The network health of a run from decoded collective blocks ((step, ``COLL_BLOCK_FIELDS``
    columns or None), any order) of a sample of its steps; ``hosts``: {rank: (host, node)}."""
    e = np.empty(0)
    none = NetworkHealth(ranks=np.empty(0, dtype=np.int64), busbw_ratio=e, busbw_steps=e, busbw_slow_steps=e,
                         latency_ratio=e, latency_steps=e, latency_slow_steps=e, slow=np.zeros(0, dtype=bool),
                         steps_sampled=len(blocks), classes=0, hosts=hosts)
    C = _concat(blocks)
    if C is None:
        return none
    op = C["op"].astype(np.int64)
    total = C["total_s"].astype(np.float64)
    calls = np.maximum(C["calls"].astype(np.float64), 1.0)
    rank = C["rank"].astype(np.int64)
    n = np.clip(C["group_size"].astype(np.int64), 0, (1 << 17) - 1)
    ok = np.isfinite(total) & (total > 0) & (rank >= 0) & (op >= 0) & (op < len(COLLECTIVE_OPS)) & (op != _OTHER)
    if not ok.any():
        return none
    op, total, calls, rank, n = op[ok], total[ok], calls[ok], rank[ok], n[ok]
    nbytes = np.nan_to_num(C["bytes"][ok].astype(np.float64))
    step = C["step"][ok]
    dim = C["dim"][ok].astype(np.int64) & 0x7FFFFFFF
    per_call = nbytes / calls
    bw = (per_call >= LARGE_MESSAGE_BYTES) & (op != _BARRIER)
    bucket = np.floor(np.log2(np.maximum(per_call, 1.0))).astype(np.int64)
    # class: kind | op | bucket | group size | dim in one int64 (1 + 4 + 6 + 17 + 31 bits)
    cls_key = ((((dim << 17) | n) << 6 | np.clip(bucket, 0, 63)) << 4 | op) << 1 | bw.astype(np.int64)
    cls_u, cls = np.unique(cls_key, return_inverse=True)
    cls = cls.reshape(-1).astype(np.int64)
    n_steps = int(step.max()) + 1
    span = int(rank.max()) + 1
    # per (class, step, rank): summed bytes × factor, seconds and calls (keys ascending)
    uk, (B, T, K) = _group_sums((cls * n_steps + step) * span + rank, len(cls_u) * n_steps * span,
                                (nbytes * _factor(op, n), total, calls))
    kind_bw = (cls_u[uk // (n_steps * span)] & 1).astype(bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(kind_bw, B / T, T / K)  # busbw, or seconds per call
    # per (class, step): the median rank
    cs = uk // span
    g = np.cumsum(np.r_[True, cs[1:] != cs[:-1]]) - 1
    n_g = int(g[-1]) + 1
    peers = np.bincount(g, minlength=n_g)
    med = _median_by_group(value, g, n_g)[g]
    use = (peers[g] >= MIN_PEERS) & np.isfinite(med) & (med > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.where(kind_bw, B / med, K * med)
    if not use.any():
        return none
    uk, kind_bw, T, expected = uk[use], kind_bw[use], T[use], expected[use]
    step_u, rank_u = (uk // span) % n_steps, uk % span
    # per (kind, step, rank): the ratio over the classes the rank took part in
    sk, (t_sum, e_sum) = _group_sums((kind_bw.astype(np.int64) * n_steps + step_u) * span + rank_u,
                                     2 * n_steps * span, (T, expected))
    is_bw = sk >= n_steps * span
    rank_s = sk % span
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(is_bw, e_sum / t_sum, t_sum / e_sum)
    slow_step = np.where(is_bw, ratio <= threshold, ratio >= latency_threshold)
    ranks = np.unique(rank_s)
    out: dict[str, np.ndarray] = {}
    for kind, sel in (("busbw", is_bw), ("latency", ~is_bw)):
        ri = np.searchsorted(ranks, rank_s[sel])
        out[f"{kind}_steps"] = np.bincount(ri, minlength=len(ranks))
        out[f"{kind}_slow_steps"] = np.bincount(ri, weights=slow_step[sel], minlength=len(ranks)).astype(np.int64)
        out[f"{kind}_ratio"] = _median_by_group(ratio[sel], ri, len(ranks))
    slow = np.zeros(len(ranks), dtype=bool)
    for kind in ("busbw", "latency"):
        st = out[f"{kind}_steps"]
        slow |= (st >= min_steps) & (out[f"{kind}_slow_steps"] * 2 > st)
    return NetworkHealth(ranks=ranks, busbw_ratio=out["busbw_ratio"], busbw_steps=out["busbw_steps"],
                         busbw_slow_steps=out["busbw_slow_steps"], latency_ratio=out["latency_ratio"],
                         latency_steps=out["latency_steps"], latency_slow_steps=out["latency_slow_steps"], slow=slow,
                         steps_sampled=len(blocks), classes=len(cls_u), hosts=hosts)


def _thresholds() -> dict[str, Any]:
    return {"busbw_ratio": BUSBW_THRESHOLD, "latency_ratio": round(LATENCY_THRESHOLD, 4),
            "large_message_bytes": LARGE_MESSAGE_BYTES, "min_peers": MIN_PEERS, "min_steps": MIN_STEPS}


def empty_network(source: str | None = None) -> dict[str, Any]:
    """The summary's ``network`` of a run without comparable collectives."""
    return {"slow_ranks": [], "slow_nodes": [], "slow_ranks_total": 0, "slow_nodes_total": 0, "ranks_measured": 0,
            "nodes_measured": 0, "steps_sampled": 0, "classes": 0, "busbw_ratio_min": None, "source": source,
            "thresholds": _thresholds()}


def summary_network(h: NetworkHealth, *, source: str | None = None, limit: int = SUMMARY_LIMIT) -> dict[str, Any]:
    """The run summary's ``network``: slow ranks and slow nodes, worst first, at most ``limit`` of each
    (``slow_ranks_total`` / ``slow_nodes_total`` count them all)."""
    if not len(h.ranks):
        return {**empty_network(source), "steps_sampled": h.steps_sampled}
    nodes = h.nodes()
    items = []
    for j in np.flatnonzero(h.slow):
        rank = int(h.ranks[j])
        host, node = h.hosts.get(rank, (None, None))
        by = [k for k, thr_ok in (("busbw", h.busbw_slow_steps[j] * 2 > h.busbw_steps[j] >= MIN_STEPS),
                                  ("latency", h.latency_slow_steps[j] * 2 > h.latency_steps[j] >= MIN_STEPS)) if thr_ok]
        items.append({
            "rank": rank, "host": host, "node": node,
            "busbw_ratio": _r(h.busbw_ratio[j]), "latency_ratio": _r(h.latency_ratio[j]), "slow_by": by,
            "busbw_slow_share": _r(h.busbw_slow_steps[j] / h.busbw_steps[j]) if h.busbw_steps[j] else None,
            "latency_slow_share": _r(h.latency_slow_steps[j] / h.latency_steps[j]) if h.latency_steps[j] else None,
            "node_flagged": bool(node and nodes.get(node, {}).get("slow")),
        })  # fmt: skip

    def severity(it: dict[str, Any]) -> float:
        b = it["busbw_ratio"] if it["busbw_ratio"] is not None else 1.0
        lat = it["latency_ratio"] if it["latency_ratio"] else 1.0
        return min(b, 1.0 / lat)

    items.sort(key=lambda it: (severity(it), it["rank"]))
    slow_nodes = [{"node": node, "busbw_ratio": _r(v["busbw_ratio"]), "latency_ratio": _r(v["latency_ratio"]),
                   "ranks": v["ranks"], "slow_ranks": v["slow_ranks"]}
                  for node, v in nodes.items() if v["slow"]]
    slow_nodes.sort(key=lambda x: (severity(x), x["node"]))
    finite = h.busbw_ratio[np.isfinite(h.busbw_ratio)]
    bmin = float(finite.min()) if len(finite) else None
    return {"slow_ranks": items[:limit], "slow_nodes": slow_nodes[:limit], "slow_ranks_total": len(items),
            "slow_nodes_total": len(slow_nodes),
            "ranks_measured": len(h.ranks), "nodes_measured": len(nodes), "steps_sampled": h.steps_sampled,
            "classes": h.classes, "busbw_ratio_min": _r(bmin), "source": source, "thresholds": _thresholds()}


def node_health_rows(h: NetworkHealth, hosts: Mapping[int, tuple[str | None, str | None]],
                     straggler_ranks: Sequence[int]) -> list[dict[str, Any]]:
    """One health row per node of the run (every node with a rank, measured or not): its ranks, how
    many were stragglers (the straggler report's list), how many were network-slow, whether the node
    was, and its median busbw / latency ratios."""
    measured = h.nodes()
    ranks_of: dict[str, int] = {}
    for _rank, (_host, node) in hosts.items():
        if node:
            ranks_of[node] = ranks_of.get(node, 0) + 1
    strag: dict[str, int] = {}
    for r in straggler_ranks:
        node = hosts.get(int(r), (None, None))[1]
        if node:
            strag[node] = strag.get(node, 0) + 1
    out = []
    for node, k in sorted(ranks_of.items()):
        m = measured.get(node, {})
        out.append({"node": node, "ranks": k, "straggler_ranks": strag.get(node, 0),
                    "slow_ranks": int(m.get("slow_ranks", 0)), "slow_network": bool(m.get("slow", False)),
                    "busbw_ratio": m.get("busbw_ratio"), "latency_ratio": m.get("latency_ratio")})
    return out
