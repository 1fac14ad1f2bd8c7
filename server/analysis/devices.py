"""Device telemetry per rank (docs/metrics.md, "Device telemetry"): which ranks' GPUs throttled, why, for
what share of the time, with what clocks against their peers', and which logged XID or ECC errors — and
the device condition that explains a straggler (:func:`device_cause`), joined into its ``cause``.

Input: the per-rank figures of ``store.devices.rank_device_figures`` (medians over the rank's windows,
extremes, seconds per throttle reason). Pure functions: no store, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median
from typing import Any

from ..device_wire import THROTTLING, mask_reasons
from .regressions import Regression, series_key

__all__ = ["device_report", "device_cause", "attach_device_causes", "device_finding", "THROTTLED_SHARE", "REASON_TEXT",
           "ALERT_REASONS", "rank_device_nodes"]

THROTTLED_SHARE = 0.10
"""A rank counts as throttled when a slowing reason was active for at least this share of its telemetry time."""
REASON_TEXT = {
    "power": "sat at its power cap",
    "thermal": "was slowed down by heat (thermal slowdown)",
    "hw_slowdown": "was slowed down by the hardware (HW slowdown: temperature, power supply or brake)",
    "power_brake": "was held down by an external power brake",
    "sync_boost": "was held to the slowest GPU of its sync-boost group",
}


def _r(v: Any, nd: int = 3) -> float | None:
    return round(float(v), nd) if v is not None else None


def device_report(run_id: int, figures: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``GET /api/v1/runs/{id}/devices``: per rank its figures, its throttle reasons with the share of
    time each was active, whether it counts as throttled (and by what, ``reason``), XID codes and ECC errors;
    ``peers``: the medians over ranks; ``throttled_ranks`` / ``error_ranks`` name the ranks to look at."""
    ranks: list[dict[str, Any]] = []
    for f in figures:
        secs = float(f.get("seconds") or 0.0)
        reason_s = {str(k): float(v) for k, v in (f.get("reason_s") or {}).items()}
        names = sorted(set(mask_reasons(int(f.get("throttle_mask") or 0))) | set(reason_s))
        shares = {n: (reason_s.get(n, 0.0) / secs if secs > 0 else 0.0) for n in names}
        slowing = {n: s for n, s in shares.items() if n in THROTTLING}
        top = max(slowing, key=lambda n: (slowing[n], n)) if slowing else None
        throttled_share = min(1.0, float(f.get("throttled_s") or 0.0) / secs) if secs > 0 else 0.0
        throttled = top is not None and throttled_share >= THROTTLED_SHARE
        ranks.append({
            "rank": int(f["rank"]), "host": f.get("host"), "node": f.get("node") or f.get("host"),
            "windows": int(f.get("windows") or 0), "seconds": _r(secs),
            "sm_clock_mhz": _r(f.get("sm_clock_mhz_median"), 1), "sm_clock_mhz_min": _r(f.get("sm_clock_mhz_min"), 1),
            "mem_clock_mhz": _r(f.get("mem_clock_mhz_median"), 1),
            "power_w": _r(f.get("power_w_median"), 1), "power_w_max": _r(f.get("power_w_max"), 1),
            "power_limit_w": _r(f.get("power_limit_w"), 1),
            "temp_c": _r(f.get("temp_c_median"), 1), "temp_c_max": _r(f.get("temp_c_max"), 1),
            "util": _r(f.get("util_median")), "mem_used_bytes": int(f["mem_used_bytes_max"])
            if f.get("mem_used_bytes_max") is not None else None,
            "throttle": names, "throttle_share": {n: round(s, 4) for n, s in shares.items()},
            "throttled_share": round(throttled_share, 4), "throttled": throttled, "reason": top if throttled else None,
            "xid": [int(x) for x in f.get("xid") or []], "ecc_errors": int(f.get("ecc_errors") or 0),
        })
    def med(key: str) -> float | None:
        vals = [float(r[key]) for r in ranks if r.get(key) is not None]
        return round(median(vals), 1) if vals else None

    peers = {k: med(k) for k in ("sm_clock_mhz", "mem_clock_mhz", "power_w", "temp_c")}
    peers["util"] = (round(median([float(r["util"]) for r in ranks if r["util"] is not None]), 3)
                     if any(r["util"] is not None for r in ranks) else None)
    for r in ranks:  # each rank against the others (the median of every rank but itself)
        others = [float(o["sm_clock_mhz"]) for o in ranks if o["rank"] != r["rank"] and o["sm_clock_mhz"] is not None]
        r["peers_sm_clock_mhz"] = round(median(others), 1) if others else None
    return {
        "run_id": run_id, "ranks": ranks, "peers": peers,
        "throttled_ranks": [r["rank"] for r in ranks if r["throttled"]],
        "error_ranks": [r["rank"] for r in ranks if r["xid"] or r["ecc_errors"]],
        "throttled_share_min": THROTTLED_SHARE,
    }


def _ghz(mhz: float | None) -> str:
    return f"{float(mhz) / 1000:.2f} GHz" if mhz is not None else "?"


#: straggler components a GPU's clocks cannot explain: a rank late in data loading waits on its loader (CPU,
#: storage, network), so a throttle on its GPU is a bystander there, not the cause
NOT_DEVICE_BOUND = frozenset({"data"})


def device_cause(rank_fig: Mapping[str, Any] | None, slowdown: float | None = None,
                 component: str | None = None) -> dict[str, Any] | None:
    """What the rank's device says about its slowness (a ``device_report`` rank): the throttle reason with
    its share of time and the clocks against the peers', XID / ECC errors; None when the device was fine.
    ``component``: where the straggler's excess is (``analysis.stragglers``); when it is one no GPU clock
    explains (``NOT_DEVICE_BOUND``: data loading), the throttle is reported as ``throttle_reason`` but is not
    the ``reason`` — the cause stays the component."""
    if not rank_fig:
        return None
    reason = rank_fig.get("reason")
    errors = bool(rank_fig.get("xid")) or bool(rank_fig.get("ecc_errors"))
    if reason is None and not errors:
        return None
    bystander = reason is not None and component in NOT_DEVICE_BOUND
    bits = []
    if bystander and reason is not None:
        share = float(rank_fig["throttle_share"].get(reason, rank_fig.get("throttled_share") or 0.0))
        bits.append(f"its excess is in {component}, which its GPU's clocks do not explain (its GPU also "
                    f"{REASON_TEXT.get(reason, reason)} {100 * min(share, 1.0):.0f} % of the time)")
    elif reason is not None:
        share = float(rank_fig["throttle_share"].get(reason, rank_fig.get("throttled_share") or 0.0))
        bits.append(f"its GPU {REASON_TEXT.get(reason, reason)} {100 * min(share, 1.0):.0f} % of the time")
        if rank_fig.get("sm_clock_mhz") is not None and rank_fig.get("peers_sm_clock_mhz") is not None:
            bits.append(f"SM clocks {_ghz(rank_fig['sm_clock_mhz'])} vs {_ghz(rank_fig['peers_sm_clock_mhz'])} on its peers")
        if reason == "thermal" and rank_fig.get("temp_c_max") is not None:
            bits.append(f"up to {float(rank_fig['temp_c_max']):.0f} °C")
    if rank_fig.get("xid"):
        bits.append("it logged XID " + ", ".join(str(x) for x in rank_fig["xid"][:4]))
    if rank_fig.get("ecc_errors"):
        bits.append(f"{int(rank_fig['ecc_errors'])} uncorrected ECC errors")
    head = f"rank {rank_fig['rank']}" + (f" is {float(slowdown):.2f}× slower" if slowdown else "")
    return {
        "reason": None if bystander else reason, "throttle_reason": reason, "throttle": list(rank_fig.get("throttle") or []),
        "throttled_share": rank_fig.get("throttled_share"), "sm_clock_mhz": rank_fig.get("sm_clock_mhz"),
        "peers_sm_clock_mhz": rank_fig.get("peers_sm_clock_mhz"), "temp_c_max": rank_fig.get("temp_c_max"),
        "power_w": rank_fig.get("power_w"), "power_limit_w": rank_fig.get("power_limit_w"),
        "xid": list(rank_fig.get("xid") or []), "ecc_errors": int(rank_fig.get("ecc_errors") or 0),
        "text": f"{head}; " + ", ".join(bits),
    }


def attach_device_causes(report: dict[str, Any], devices: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of a straggler report whose stragglers each carry ``cause``: ``{"component", "reason", "device",
    "text"}`` — ``reason`` and ``device`` from the rank's device telemetry when it throttled or logged
    errors (None otherwise; ``reason`` also None when its excess is in data loading, which a throttled GPU
    does not explain: ``device.throttle_reason`` keeps what the GPU did); the report gains
    ``devices_throttled`` (ranks)."""
    by_rank = {int(r["rank"]): r for r in (devices or {}).get("ranks", [])}
    out = dict(report)
    items = []
    for it in report.get("stragglers", []):
        it = dict(it)
        comp = it.get("component")
        dev = device_cause(by_rank.get(int(it["rank"])), it.get("slowdown"), comp)
        text = dev["text"] if dev else (f"rank {it['rank']} is {float(it['slowdown']):.2f}× slower; its excess is in "
                                        f"{comp}" if it.get("slowdown") and comp else None)
        it["cause"] = {"component": comp, "reason": dev["reason"] if dev else None, "device": dev, "text": text}
        items.append(it)
    out["stragglers"] = items
    out["devices_throttled"] = list((devices or {}).get("throttled_ranks", []))
    return out


def rank_device_nodes(nodes: Sequence[Mapping[str, Any]], *, trouble_only: bool = True) -> list[dict[str, Any]]:
    """Nodes of ``node_device_trouble`` (store rows: ``xid_windows``, ``ecc_errors``, ``throttled_s``, ``seconds``,
    ``runs_throttled``) worst first — XID windows, then ECC errors, then the share of their telemetry time
    throttled — each with ``throttled_share`` (``throttled_s / seconds``, 0–1); ``trouble_only``: leave out the
    nodes with none of the three."""
    out = []
    for n in nodes:
        secs = float(n.get("seconds") or 0.0)
        share = min(float(n.get("throttled_s") or 0.0) / secs, 1.0) if secs > 0 else 0.0
        if not trouble_only or n.get("xid_windows") or n.get("ecc_errors") or share > 0:
            out.append({**n, "throttled_share": share})
    out.sort(key=lambda n: (-int(n.get("xid_windows") or 0), -int(n.get("ecc_errors") or 0), -n["throttled_share"],
                            -int(n.get("runs_throttled") or 0), str(n.get("node"))))
    return out


ALERT_REASONS = frozenset({"thermal", "hw_slowdown", "power_brake"})
"""Throttle reasons that raise a ``device`` alert by themselves (heat, hardware): a power cap is a setting
— it shows in a straggler's cause, not as an alert of its own."""
MAX_ALERT_RANKS = 64


def device_finding(run_id: int, rep: Mapping[str, Any]) -> tuple[list[Regression], set[str]]:
    """One ``device`` finding per run whose GPUs logged XID or ECC errors or throttled for heat or hardware
    (``ALERT_REASONS``), naming the ranks and nodes; the series evaluated (one per run, so it resolves)."""
    series = series_key("device", run_id)
    bad = [r for r in rep.get("ranks", []) if r.get("xid") or r.get("ecc_errors")
           or (r.get("throttled") and r.get("reason") in ALERT_REASONS)]
    if not rep.get("ranks"):
        return [], set()
    if not bad:
        return [], {series}
    bad.sort(key=lambda r: (-len(r.get("xid") or []), -int(r.get("ecc_errors") or 0), -float(r.get("throttled_share") or 0)))
    texts = [str(c["text"]) for c in (device_cause(r) for r in bad[:3]) if c]
    nodes = sorted({str(r.get("node")) for r in bad if r.get("node")})
    top = bad[0]
    return [Regression(
        kind="device", series=series, metric="device_trouble_ranks", unit="ranks", before=0.0, after=float(len(bad)),
        change=float(len(bad)), significance=None,
        first_bad={"run_id": run_id, "rank": top["rank"], "node": top.get("node")},
        run_id=run_id, url_path=f"/runs/{run_id}",
        details={"ranks": [r["rank"] for r in bad[:MAX_ALERT_RANKS]], "trouble_ranks": len(bad), "nodes": nodes[:MAX_ALERT_RANKS],
                 "xid": sorted({int(x) for r in bad for x in r.get("xid") or []})[:16],
                 "ecc_errors": sum(int(r.get("ecc_errors") or 0) for r in bad),
                 "reasons": sorted({str(r["reason"]) for r in bad if r.get("reason")}), "text": "; ".join(texts)},
    )], {series}
