"""Collective efficiency (docs/metrics.md): busbw per op × group size × message size against the link peak.

busbw follows NCCL-tests (``fleetscope.wire.busbw_factor``). The peak is the group's slowest link,
taken from the topology the run declares in its ``meta`` or ``config`` under ``"topology"``::

    {"gpus_per_node": 8, "intra_node_bytes_per_s": 450e9, "inter_node_bytes_per_s": 50e9}
    # also accepted: "nvlink_GBps", "nic_GBps" (gigabytes/s), "nic_Gbps" (gigabits/s)

A group larger than a node must cross the NIC. A group that fits in a node is taken to be placed
within one (tensor-parallel groups are innermost by convention) unless the topology says
``"groups_span_nodes": true``. Without a declared peak, efficiency is ``None`` and ``link`` says
"unknown" — never a guess.
"""

from __future__ import annotations

from typing import Any

from fleetscope.wire import busbw_factor

from ..store.rows import CollectiveRow, RunRow

__all__ = ["collective_rows", "collective_efficiency", "link_peaks"]

_MIB = 1 << 20


def _get(d: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return None


def collective_rows(rows: list[CollectiveRow]) -> list[dict[str, Any]]:
    """The run's collective rollup with algbw = bytes / time and busbw = algbw × the NCCL-tests factor
    of the op and group size (docs/metrics.md), in the order given."""
    out = []
    for r in rows:
        algbw = r.bytes / r.total_s if r.total_s > 0 else None
        out.append({"op": r.op, "group_size": r.group_size, "size_bucket_bytes": 2**r.size_bucket, "records": r.records,
                    "calls": r.calls, "bytes": r.bytes, "total_s": r.total_s, "exposed_s": r.exposed_s,
                    "algbw_bytes_per_s": algbw,
                    "busbw_bytes_per_s": algbw * busbw_factor(r.op, r.group_size) if algbw is not None else None})
    return out


def link_peaks(run: RunRow, gpus_per_node: int | None = None) -> dict[str, Any]:
    """Declared link peaks of a run: {"gpus_per_node", "intra", "inter", "span_nodes", "declared"}."""
    topo: dict[str, Any] = {}
    for src in (run.config or {}, run.meta or {}):
        t = src.get("topology")
        if isinstance(t, dict):
            topo.update(t)
    intra = _get(topo, "intra_node_bytes_per_s")
    if intra is None and (g := _get(topo, "nvlink_GBps")):
        intra = g * 1e9
    inter = _get(topo, "inter_node_bytes_per_s")
    if inter is None and (g := _get(topo, "nic_GBps")):
        inter = g * 1e9
    if inter is None and (g := _get(topo, "nic_Gbps")):
        inter = g * 1e9 / 8
    gpn = topo.get("gpus_per_node") or gpus_per_node
    return {"gpus_per_node": int(gpn) if gpn else None, "intra": intra, "inter": inter,
            "span_nodes": bool(topo.get("groups_span_nodes", False)), "declared": bool(intra or inter)}


def _link_for(n: int, world: int, peaks: dict[str, Any]) -> tuple[str, float | None]:
    gpn = peaks["gpus_per_node"]
    if gpn is None:
        return "unknown", None
    crosses = n > gpn or (peaks["span_nodes"] and world > gpn)
    if crosses:
        return ("nic", peaks["inter"]) if peaks["inter"] else ("unknown", None)
    return ("nvlink", peaks["intra"]) if peaks["intra"] else ("unknown", None)


def collective_efficiency(run: RunRow, rows: list[CollectiveRow], gpus_per_node_seen: int | None) -> dict[str, Any]:
    """busbw and efficiency by op × group size × message-size bucket, plus a time-weighted summary
    over messages ≥ 1 MiB (small messages are latency-bound: their busbw is not a bandwidth figure).
    ``gpus_per_node_seen``: the most ranks reported on one node (when the topology does not say)."""
    peaks = link_peaks(run, gpus_per_node_seen)
    world = int(run.world_size or 1)
    out_rows = []
    w_eff = w_t = 0.0
    for r in collective_rows(rows):
        if r["op"] == "barrier" or r["bytes"] <= 0:
            continue
        link, peak = _link_for(int(r["group_size"]), world, peaks)
        busbw = r["busbw_bytes_per_s"]
        eff = busbw / peak if busbw is not None and peak else None
        out_rows.append({**r, "link": link, "link_peak_bytes_per_s": peak, "efficiency": eff})
        if eff is not None and r["size_bucket_bytes"] >= _MIB:
            w_eff += eff * r["total_s"]
            w_t += r["total_s"]
    out_rows.sort(key=lambda x: (x["op"], x["group_size"], x["size_bucket_bytes"]))
    return {
        "run_id": run.id,
        "topology": peaks,
        "collectives": out_rows,
        "efficiency_large_messages": (w_eff / w_t) if w_t > 0 else None,
        "note": None if peaks["declared"] else "link peak unknown: declare meta.topology to get efficiency",
    }
