"""Nodes across runs (``GET /api/v1/nodes``, the Cluster page): how often each node slowed a job —
a rank of it was a straggler, or the node was network-slow — its median busbw ratio over its runs,
and its latest per-node microbenchmarks (``fleetscope bench``: series named ``node_…`` whose params
name the node).

Read from ``run_node_health`` (one row per run and node, written when a run's network health is
computed: ``reports.network``), never from step blocks. Runs without current rows (never summarised,
or finished since) are brought up to date first, at most ``REFRESH_RUNS`` per call, newest first;
``pending_runs`` says how many are still behind.
"""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import Engine

from ..store import nodes as node_store
from ..store import runs as run_store
from .network import run_network
from .runs import stragglers

__all__ = ["node_list", "node_detail", "refresh_node_health", "REFRESH_RUNS"]

REFRESH_RUNS = 20
_VS_MEDIAN_MIN_NODES = 3  # nodes needed before a microbenchmark is compared with the others'


def refresh_node_health(engine: Engine, limit: int = REFRESH_RUNS) -> tuple[int, int]:
    """Compute the node health rows of up to ``limit`` runs that lack current ones; (refreshed, still pending)."""
    ids, n_stale = node_store.stale_runs(engine, limit)
    done = 0
    for rid in ids:
        run = run_store.get_run(engine, rid, pending=False)
        if run is None:
            continue
        run_network(engine, run, stragglers(engine, rid))
        done += 1
    return done, max(n_stale - len(ids), 0)


def _microbench(engine: Engine) -> dict[str, dict[str, Any]]:
    """{node: {bench name without "node_": latest figure}}; each figure is compared with the median of
    the same benchmark (name, cluster, params but the node) over the nodes that ran it."""
    rows = node_store.node_microbench(engine)
    latest: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for node, name, cluster, params, unit, ts, value in rows:
        latest.setdefault((node, name), []).append((ts, value, cluster, params, unit))
    peers: dict[tuple[str, str, str], list[float]] = {}

    def peer_key(name: str, cluster: str, params: dict[str, Any]) -> tuple[str, str, str]:
        return name, cluster, repr(sorted((k, str(v)) for k, v in params.items() if k != "node"))

    for _node, name, cluster, params, _unit, _ts, value in rows:
        peers.setdefault(peer_key(name, cluster, params), []).append(value)

    def vs_median(name: str, cluster: str, params: dict[str, Any], value: float) -> float | None:
        vals = peers.get(peer_key(name, cluster, params), [])
        if len(vals) < _VS_MEDIAN_MIN_NODES:
            return None
        med = statistics.median(vals)
        return round(value / med, 4) if med > 0 else None

    out: dict[str, dict[str, Any]] = {}
    for (node, name), pts in latest.items():
        short = name.removeprefix("node_")
        sizes = [p for p in pts if "size_bytes" in p[3]]
        if sizes:  # one series per message size: the latest value of each, headlined by the largest size
            by_size: dict[int, tuple[Any, ...]] = {}
            for p in sizes:
                sz = int(p[3]["size_bytes"])
                if sz not in by_size or p[0] > by_size[sz][0]:
                    by_size[sz] = p
            top = by_size[max(by_size)]
            fig = {"value": top[1], "unit": top[4], "ts": max(p[0] for p in by_size.values()).isoformat(),
                   "params": top[3], "vs_median": vs_median(name, top[2], top[3], top[1]),
                   "by_size": {str(sz): p[1] for sz, p in sorted(by_size.items())}}
        else:
            top = max(pts, key=lambda p: (p[0], p[3].get("device") == "cuda"))  # latest; the GPU's on a GPU node
            fig = {"value": top[1], "unit": top[4], "ts": top[0].isoformat(), "params": top[3],
                   "vs_median": vs_median(name, top[2], top[3], top[1])}
        out.setdefault(node, {})[short] = fig
    return out


def _row(h: node_store.NodeHistoryRow | None, node: str, micro: dict[str, Any]) -> dict[str, Any]:
    runs = h.runs if h else 0
    slowed = h.slowed_runs if h else 0
    return {
        "node": node,
        "runs": runs,
        "straggler_runs": h.straggler_runs if h else 0,
        "slow_network_runs": h.slow_network_runs if h else 0,
        "slowed_runs": slowed,
        "slowed_share": round(slowed / runs, 4) if runs else None,
        "busbw_ratio_median": None if h is None or h.busbw_ratio_median is None else round(h.busbw_ratio_median, 4),
        "latency_ratio_median": None if h is None or h.latency_ratio_median is None else round(h.latency_ratio_median, 4),
        "last_seen": h.last_seen.isoformat() if h and h.last_seen else None,
        "microbench": micro,
    }


def _rank_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """Most runs slowed first; then the larger share of its runs, the lower busbw ratio, the name."""
    b = r["busbw_ratio_median"]
    return (-r["slowed_runs"], -(r["slowed_share"] or 0.0), b if b is not None else float("inf"), r["node"])


def node_list(engine: Engine, *, limit: int = 500, refresh: int = REFRESH_RUNS) -> dict[str, Any]:
    """``{"nodes": [...], "refreshed_runs", "pending_runs"}``: every node seen in a run or a per-node
    microbenchmark, ranked by how often it slowed a job (``_rank_key``)."""
    done, pending = refresh_node_health(engine, refresh) if refresh > 0 else (0, 0)
    hist = {h.node: h for h in node_store.node_history(engine)}
    micro = _microbench(engine)
    rows = [_row(hist.get(n), n, micro.get(n, {})) for n in sorted(set(hist) | set(micro))]
    rows.sort(key=_rank_key)
    return {"nodes": rows[:limit], "total": len(rows), "refreshed_runs": done, "pending_runs": pending}


def node_detail(engine: Engine, node: str, *, runs: int = 50) -> dict[str, Any] | None:
    """One node: its history row and its runs (newest first, the node's figures in each); None when
    the node was never seen."""
    refresh_node_health(engine)
    hist = node_store.node_history(engine, node=node)
    micro = _microbench(engine).get(node, {})
    if not hist and not micro:
        return None
    return {**_row(hist[0] if hist else None, node, micro), "run_history": node_store.node_runs(engine, node, runs)}
