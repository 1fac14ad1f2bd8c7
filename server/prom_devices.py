"""GPU device trouble per node on ``/metrics`` (group ``devices`` of ``prom.scrape_groups``), from the agents'
device telemetry over the last 24 hours (``run_devices`` joined to the ranks' nodes). Bounded labels: ``node``
only — never a run, a rank or a GPU — for at most ``MAX_NODES`` nodes, the worst first (XID windows, ECC
errors, share of time throttled: ``analysis.devices.rank_device_nodes``); the rest are folded into one series
labelled ``_other``. Computed at most once per ``CACHE_S`` per process (one statement)."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import Engine

from .analysis.devices import rank_device_nodes
from .limits import MAX_PAGE_ROWS
from .store.devices import node_device_trouble

__all__ = ["device_gauges", "MAX_NODES", "CACHE_S", "WINDOW_H", "OTHER"]

MAX_NODES = 50
CACHE_S = 60.0
WINDOW_H = 24
OTHER = "_other"
_cache: dict[int, tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()


def device_gauges(engine: Engine, now: float | None = None) -> dict[str, Any]:
    """``fleetscope_node_gpu_throttled_ratio{node}``, ``fleetscope_node_gpu_xid_total{node}``,
    ``fleetscope_node_gpu_ecc_errors_total{node}`` and ``fleetscope_node_gpu_throttled_runs{node}``."""
    t = time.monotonic()
    with _lock:
        hit = _cache.get(id(engine))
        if hit is not None and t - hit[0] < CACHE_S and now is None:
            return hit[1]
    since = (time.time() if now is None else now) - WINDOW_H * 3600
    nodes = rank_device_nodes(node_device_trouble(engine, since_s=since, limit=MAX_PAGE_ROWS), trouble_only=False)
    shown, rest = nodes[:MAX_NODES], nodes[MAX_NODES:]
    rows = [(str(n["node"]), float(n["throttled_share"]), float(n["xid_windows"]), float(n["ecc_errors"]),
             float(n["runs_throttled"])) for n in shown]
    if rest:
        secs = sum(float(n["seconds"]) for n in rest)
        rows.append((OTHER, sum(float(n["throttled_s"]) for n in rest) / secs if secs > 0 else 0.0,
                     float(sum(n["xid_windows"] for n in rest)), float(sum(n["ecc_errors"] for n in rest)),
                     float(sum(n["runs_throttled"] for n in rest))))
    span = f"over the last {WINDOW_H} h of device telemetry; at most {MAX_NODES} nodes, the worst, the rest as {OTHER}"
    out: dict[str, Any] = {
        "fleetscope_node_gpu_throttled_ratio": (f"Share of the node's GPU time throttled by a slowing reason (0-1), {span}",
                                                [((r[0],), r[1]) for r in rows], ("node",)),
        "fleetscope_node_gpu_xid_total": (f"Telemetry windows of the node's GPUs with XID events, {span}",
                                          [((r[0],), r[2]) for r in rows], ("node",)),
        "fleetscope_node_gpu_ecc_errors_total": (f"Uncorrected ECC errors on the node's GPUs, {span}",
                                                 [((r[0],), r[3]) for r in rows], ("node",)),
        "fleetscope_node_gpu_throttled_runs": (f"Runs with a throttled GPU window on the node, {span}",
                                               [((r[0],), r[4]) for r in rows], ("node",)),
    }
    with _lock:
        _cache[id(engine)] = (t, out)
    return out
