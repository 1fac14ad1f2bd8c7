"""Fleet utilisation on ``/metrics`` (group ``utilisation`` of ``prom.scrape_groups``): GPU-hours over the last
24 hours per team and per model family — bounded labels: at most ``MAX_LABELS`` teams and families each (the
largest; the rest summed under ``_other``), never a run or a rank. Computed at most once per ``CACHE_S`` per
process (one statement, ``reports.utilisation``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import Engine

from .reports.utilisation import fleet_utilisation

__all__ = ["utilisation_gauges", "MAX_LABELS", "CACHE_S", "WINDOW_H", "OTHER"]

MAX_LABELS = 50
CACHE_S = 60.0
WINDOW_H = 24
OTHER = "_other"
_FIGS = (("gpu_hours", "GPU-hours"), ("idle_gpu_hours", "allocated-but-idle GPU-hours (no step running)"),
         ("failed_gpu_hours", "GPU-hours of runs that failed"), ("mfu_gpu_hours", "MFU-weighted GPU-hours"))
_cache: dict[int, tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()


def _series(rows: list[dict[str, Any]], key: str, fig: str) -> list[tuple[tuple[str, ...], float]]:
    out: list[tuple[tuple[str, ...], float]] = [((str(r[key] or ""),), float(r[fig])) for r in rows[:MAX_LABELS]]
    rest = rows[MAX_LABELS:]
    if rest:
        out.append(((OTHER,), float(sum(float(r[fig]) for r in rest))))
    return out


def utilisation_gauges(engine: Engine, now: float | None = None) -> dict[str, Any]:
    """``fleetscope_team_<figure>_24h{team}`` and ``fleetscope_family_<figure>_24h{family}`` gauge families."""
    t = time.monotonic()
    with _lock:
        hit = _cache.get(id(engine))
        if hit is not None and t - hit[0] < CACHE_S and now is None:
            return hit[1]
    import datetime as dt

    until = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc)
    u = fleet_utilisation(engine, since=until - dt.timedelta(hours=WINDOW_H), until=until, by=("team", "family"))
    out: dict[str, Any] = {}
    for group in ("team", "family"):
        for fig, doc in _FIGS:
            out[f"fleetscope_{group}_{fig}_24h"] = (f"{doc} per {group} over the last {WINDOW_H} h (runs clipped to it)",
                                                    _series(u[group], group, fig), (group,))
    with _lock:
        _cache[id(engine)] = (t, out)
    return out
