"""Colours, units and number formatting shared by every page (one look, one set of units)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from typing import Any

__all__ = [
    "COMPONENT_COLORS",
    "COMPONENT_LABELS",
    "SERIES_COLORS",
    "FONT",
    "time_unit",
    "fmt_s",
    "fmt_bw",
    "fmt_pct",
    "fmt_num",
    "fmt_bytes",
    "fmt_rate",
    "fmt_time",
    "to_utc",
]

#: the step-time components, everywhere in this order and these colours (Okabe–Ito, colour-blind safe)
COMPONENT_COLORS = {
    "data_s": "#E69F00",
    "compute_s": "#0072B2",
    "comm_exposed_s": "#D55E00",
    "other_s": "#9A9A9A",
    "straggler_wait_s": "#CC79A7",
}
COMPONENT_LABELS = {
    "data_s": "data",
    "compute_s": "compute",
    "comm_exposed_s": "exposed comm",
    "other_s": "other",
    "straggler_wait_s": "straggler wait",
}
#: categorical colours for runs / configurations / ops (distinct from nothing in particular)
SERIES_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
                 "#8c564b", "#7f7f7f")
FONT = "Inter, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def time_unit(values: Iterable[float | None]) -> tuple[float, str]:
    """(multiplier, unit) to show durations given in seconds: ms below one second, else s."""
    vals = [abs(v) for v in values if _finite(v)]
    if not vals:
        return 1e3, "ms"
    vals.sort()
    med = vals[len(vals) // 2]
    if med < 1e-3:
        return 1e6, "µs"
    return (1e3, "ms") if med < 1.0 else (1.0, "s")


def fmt_s(v: float | None) -> str:
    """A duration in seconds, in the most readable unit."""
    if not _finite(v):
        return "–"
    a = abs(v)  # type: ignore[arg-type]
    if a == 0:
        return "0 s"
    if a >= 100:
        return f"{v:,.0f} s"
    if a >= 1:
        return f"{v:.2f} s"
    if a >= 1e-3:
        return f"{v * 1e3:.1f} ms"
    return f"{v * 1e6:.0f} µs"


def fmt_pct(v: float | None, digits: int = 1) -> str:
    """A fraction as a percentage."""
    return f"{v * 100:.{digits}f} %" if _finite(v) else "–"


def fmt_num(v: float | None, digits: int = 3) -> str:
    """A number with k/M/G suffix and ``digits`` significant digits."""
    if not _finite(v):
        return "–"
    a = abs(v)  # type: ignore[arg-type]
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.{digits}g}{suf}"
    return f"{v:.{digits}g}"


def fmt_bytes(v: float | None) -> str:
    """Bytes in binary-free SI units (GB = 1e9 B, as GPU datasheets and NCCL-tests use)."""
    if not _finite(v):
        return "–"
    a = abs(v)  # type: ignore[arg-type]
    for div, suf in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if a >= div:
            return f"{v / div:.3g} {suf}"
    return f"{v:.0f} B"


def fmt_bw(v: float | None) -> str:
    """A bandwidth (bytes/s) in the unit that keeps three significant digits (B/s … TB/s, SI as NCCL-tests):
    a real small value is never "0.0 GB/s" (the format alerts and Slack use too)."""
    from fleetscope.server.reports import format_bandwidth

    return format_bandwidth(v) if _finite(v) else "–"  # type: ignore[arg-type]


def fmt_rate(v: float | None, unit: str) -> str:
    """A rate such as tokens/s or B/s with a k/M/G prefix."""
    return f"{fmt_num(v)} {unit}" if _finite(v) else "–"


def to_utc(v: Any) -> dt.datetime | None:
    """An ISO string, datetime or unix time as an aware UTC datetime (naive input is taken as UTC)."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return dt.datetime.fromtimestamp(float(v), tz=dt.timezone.utc)
    if isinstance(v, str):
        try:
            v = dt.datetime.fromisoformat(v)
        except ValueError:
            return None
    if isinstance(v, dt.datetime):
        return (v if v.tzinfo else v.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
    return None


def fmt_time(v: Any) -> str:
    """A timestamp as ``YYYY-MM-DD HH:MM UTC`` (always with its zone)."""
    t = to_utc(v)
    return t.strftime("%Y-%m-%d %H:%M UTC") if t else "–"
