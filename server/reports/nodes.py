"""Nodes across runs (``GET /api/v1/nodes``, the Cluster page): how often each node slowed a job —
a rank of it was a straggler, or the node was network-slow — its median busbw ratio over its runs,
and its latest per-node microbenchmarks (``fleetscope bench``: series named ``node_…`` whose params
name the node).

Read from ``run_node_health`` (one row per run and node, written when a run's network health is
computed: ``reports.network``), never from step blocks. Runs without current rows (never summarised,
or finished since) are brought up to date first, at most ``REFRESH_RUNS`` per call and about ``REFRESH_BUDGET_S`` seconds, newest first;
``pending_runs`` says how many are still behind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from ..limits import MAX_PAGE_ROWS
from ..store import nodes as node_store
from ..store import runs as run_store
from .network import run_network
from .runs import stragglers

__all__ = ["node_list", "node_detail", "refresh_node_health", "REFRESH_RUNS"]

REFRESH_RUNS = 20
#: seconds one read spends bringing runs' node health up to date (then it answers with what is current)
REFRESH_BUDGET_S = 2.0
_VS_MEDIAN_MIN_NODES = 3  # nodes needed before a microbenchmark is compared with the others'


def refresh_node_health(engine: Engine, limit: int = REFRESH_RUNS, budget_s: float = REFRESH_BUDGET_S) -> tuple[int, int]:
    """Compute the node health rows of up to ``limit`` runs that lack current ones, stopping once
    ``budget_s`` seconds are spent (a read or a page never waits on more than about one run past it:
    the rest is brought up to date by the next reads); (refreshed, still pending)."""
    ids, n_stale = node_store.stale_runs(engine, limit)
    done = 0
    t0 = time.monotonic()
    for rid in ids:
        if done and time.monotonic() - t0 > budget_s:
            break
        run = run_store.get_run(engine, rid, pending=False)
        if run is not None:
            run_network(engine, run, stragglers(engine, rid))
        done += 1
    return done, max(n_stale - done, 0)


def _microbench(engine: Engine, nodes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{node: {bench name without "node_": latest figure}} of these nodes; each figure is compared with
    the median of the same benchmark (name, cluster, params but the node) over the nodes that ran it
    (computed in the database: the peers are never loaded)."""
    if not nodes:
        return {}
    rows = node_store.node_microbench(engine, nodes=nodes)
    peers = node_store.microbench_peers(engine)
    latest: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for node, name, cluster, params, unit, ts, value, key in rows:
        latest.setdefault((node, name), []).append((ts, value, cluster, params, unit, key))

    def vs_median(name: str, cluster: str, key: str, value: float) -> float | None:
        med, n = peers.get((name, cluster, key), (0.0, 0))
        if n < _VS_MEDIAN_MIN_NODES:
            return None
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
                   "params": top[3], "vs_median": vs_median(name, top[2], top[5], top[1]),
                   "by_size": {str(sz): p[1] for sz, p in sorted(by_size.items())}}
        else:
            top = max(pts, key=lambda p: (p[0], p[3].get("device") == "cuda"))  # latest; the GPU's on a GPU node
            fig = {"value": top[1], "unit": top[4], "ts": top[0].isoformat(), "params": top[3],
                   "vs_median": vs_median(name, top[2], top[5], top[1])}
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


def node_list(engine: Engine, *, limit: int = 500, offset: int = 0, refresh: int = REFRESH_RUNS) -> dict[str, Any]:
    """``{"nodes": [...], "total", "slowed_total", "slow_network_total", "limit", "offset", "refreshed_runs",
    "pending_runs"}``: one page (at most
    ``MAX_PAGE_ROWS`` rows, ``limit`` is clamped to it) of every node seen in a run or a per-node
    microbenchmark, worst first — most runs slowed, then the larger share of its runs, the lower busbw
    ratio, the name — ordered and paged in the database (``store.nodes.node_page``); ``total`` counts them all."""
    limit = max(1, min(int(limit), MAX_PAGE_ROWS))
    offset = max(0, int(offset))
    done, pending = refresh_node_health(engine, refresh) if refresh > 0 else (0, 0)
    page, (total, slowed, slow_network) = node_store.node_page(engine, limit=limit, offset=offset)
    micro = _microbench(engine, [h.node for h in page])
    return {"nodes": [_row(h, h.node, micro.get(h.node, {})) for h in page], "total": total,
            "slowed_total": slowed, "slow_network_total": slow_network, "limit": limit, "offset": offset,
            "refreshed_runs": done, "pending_runs": pending}


def node_detail(engine: Engine, node: str, *, runs: int = 50) -> dict[str, Any] | None:
    """One node: its history row and its runs (newest first, the node's figures in each); None when
    the node was never seen."""
    refresh_node_health(engine)
    hist = node_store.node_history(engine, node=node)
    micro = _microbench(engine, [node]).get(node, {})
    if not hist and not micro:
        return None
    return {**_row(hist[0] if hist else None, node, micro), "run_history": node_store.node_runs(engine, node, runs)}
