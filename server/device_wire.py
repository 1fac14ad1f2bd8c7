"""The ``device`` event (device telemetry, agent/device_telemetry.py): ``{"rank", "seq", "kind": "device",
"ts": window start, "step", "data": {...}}``, checked at ingest (``validate._KIND_CHECKS``) and stored by
``store/devices.py`` in ``run_devices`` (one row per rank and window), not in ``run_events``.

``data``: ``window_s``, ``samples``; per figure (``sm_clock_mhz``, ``mem_clock_mhz``, ``power_w``,
``power_limit_w``, ``temp_c``, ``util`` (0..1), ``mem_used_bytes``) ``{"min", "mean", "max"}``;
``throttle`` (reason names), ``throttle_s`` ({reason: seconds active in the window}), ``ecc_errors``
(uncorrected, new in the window), ``xid`` (codes), optional ``xid_count``, ``pcie_tx_bytes_s``,
``pcie_rx_bytes_s``, ``processes``, ``device_index``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["DEVICE_KIND", "FIGURES", "REASONS", "THROTTLING", "MAX_DEVICE_XIDS", "kind_checks", "check_device",
           "reason_mask", "mask_reasons"]

DEVICE_KIND = "device"
FIGURES = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "power_limit_w", "temp_c", "util", "mem_used_bytes")
REASONS = ("idle", "applications_clocks", "power", "hw_slowdown", "sync_boost", "thermal", "power_brake",
           "display_clocks")
"""Throttle reason names (NVML clocksEventReasons, named as agent/device_telemetry.THROTTLE_REASONS); the
bit of a name in ``run_devices.throttle`` is its index here."""
THROTTLING = frozenset({"power", "thermal", "hw_slowdown", "power_brake", "sync_boost"})
"""Reasons that slow a busy GPU down (``idle`` and the clock settings do not count as throttled)."""
MAX_DEVICE_XIDS = 16
_MAX_FIGURE = 1e18


def reason_mask(names: Any) -> int:
    """The bit mask of these reason names (unknown names are left out)."""
    return sum(1 << REASONS.index(n) for n in set(names or ()) if n in REASONS)


def mask_reasons(mask: int) -> list[str]:
    """The reason names of a bit mask, in ``REASONS`` order."""
    return [n for i, n in enumerate(REASONS) if int(mask) >> i & 1]


def _num(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= _MAX_FIGURE


def check_device(data: dict[str, Any], where: str, error: Callable[..., Exception]) -> bool:
    """Refuse a ``device`` event whose figures are not what the agent sends (``error(where, message,
    got=...)`` naming the first bad field); unknown extra keys are kept as they are."""
    for k in ("window_s", "samples"):
        if not _num(data.get(k)):
            raise error(f"{where}.{k}", "must be a finite number >= 0", got=data.get(k))
    for k in FIGURES:
        v = data.get(k)
        if v is None:
            continue
        if not isinstance(v, dict) or set(v) - {"min", "mean", "max"}:
            raise error(f"{where}.{k}", 'must be {"min", "mean", "max"}', got=str(v)[:64])
        for s, x in v.items():
            if not _num(x):
                raise error(f"{where}.{k}.{s}", "must be a finite number >= 0", got=x)
    thr = data.get("throttle", [])
    if not isinstance(thr, list) or any(n not in REASONS for n in thr):
        raise error(f"{where}.throttle", f"must be a list of reason names ({', '.join(REASONS)})", got=str(thr)[:64])
    ts = data.get("throttle_s", {})
    if not isinstance(ts, dict) or any(n not in REASONS or not _num(v) for n, v in ts.items()):
        raise error(f"{where}.throttle_s", "must be {reason name: seconds >= 0}", got=str(ts)[:64])
    ecc = data.get("ecc_errors")
    if ecc is not None and (type(ecc) is not int or not 0 <= ecc < 2**31):
        raise error(f"{where}.ecc_errors", "must be a count (an integer >= 0) or null", got=ecc)
    xid = data.get("xid", [])
    if not isinstance(xid, list) or len(xid) > MAX_DEVICE_XIDS or any(type(x) is not int or not 0 <= x < 2**31 for x in xid):
        raise error(f"{where}.xid", f"must be a list of at most {MAX_DEVICE_XIDS} XID codes (integers >= 0)",
                    got=str(xid)[:64])
    return False


def kind_checks(error: Callable[..., Exception]) -> dict[str, Callable[[dict[str, Any], str], bool]]:
    """{kind: check(data, where)} for ``validate._KIND_CHECKS``."""
    return {DEVICE_KIND: lambda data, where: check_device(data, where, error)}
