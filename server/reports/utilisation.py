"""Fleet utilisation (docs/metrics.md "Fleet utilisation", docs/api.md ``GET /fleet/utilisation``): GPU-hours
per team, model family and UTC day over a window, the allocated-but-idle share, failed and redone work, and
MFU-weighted GPU-hours — of the runs the reader sees. One statement (``store.utilisation``)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from ..store import utilisation as store
from . import scope

__all__ = ["fleet_utilisation", "parse_time", "parse_by", "MAX_WINDOW_DAYS", "MAX_RUNS", "DEFAULT_DAYS",
           "GROUPINGS", "UtilisationError"]

#: the longest window one request may cover
MAX_WINDOW_DAYS = 92
#: runs one request may add up (a wider fleet: a shorter window)
MAX_RUNS = 50_000
#: the window when ``since`` is not given: this many days before ``until``
DEFAULT_DAYS = 7
GROUPINGS = store.GROUPINGS
_HOURS = (("gpu_hours", "gpu_s"), ("busy_gpu_hours", "busy_gpu_s"), ("failed_gpu_hours", "failed_gpu_s"),
          ("redone_gpu_hours", "redone_gpu_s"), ("mfu_gpu_hours", "mfu_gpu_s"), ("mfu_known_gpu_hours", "mfu_known_gpu_s"))


class UtilisationError(ValueError):
    """A request the report cannot answer (a bad time, a window too long, too many runs): a 4xx."""


def parse_time(v: str | float | None, what: str) -> dt.datetime | None:
    """A Unix time (seconds) or an ISO 8601 date/time (UTC unless it says otherwise); None for None/''."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
        try:
            t = dt.datetime.fromisoformat(str(v).strip().replace("Z", "+00:00"))
        except ValueError:
            raise UtilisationError(f"{what} must be a Unix time in seconds or an ISO 8601 date, got {str(v)[:40]!r}") \
                from None
        return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)
    if not math.isfinite(x) or not 0 <= x <= 4e9:
        raise UtilisationError(f"{what} must be a Unix time between 0 and 4e9 seconds, got {str(v)[:40]!r}")
    return dt.datetime.fromtimestamp(x, dt.timezone.utc)


def parse_by(v: str | Sequence[str] | None) -> list[str]:
    """``team,family,day`` (any of them; default all three), in that order."""
    names = [s.strip() for s in (v.split(",") if isinstance(v, str) else list(v or GROUPINGS)) if s.strip()]
    bad = [n for n in names if n not in GROUPINGS]
    if bad:
        raise UtilisationError(f"by must name some of {', '.join(GROUPINGS)} (comma-separated), got {bad[0][:40]!r}")
    return [g for g in GROUPINGS if g in names] or list(GROUPINGS)


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": int(row["runs"])}
    for k, src in _HOURS:
        out[k] = round(float(row[src]) / 3600.0, 6)
    gpu, busy = float(row["gpu_s"]), float(row["busy_gpu_s"])
    out["idle_gpu_hours"] = round(max(gpu - busy, 0.0) / 3600.0, 6)
    out["idle_share"] = round(max(gpu - busy, 0.0) / gpu, 4) if gpu > 0 else None
    known = float(row["mfu_known_gpu_s"])
    out["mfu"] = round(float(row["mfu_gpu_s"]) / known, 4) if known > 0 else None
    out["mfu_unknown_gpu_hours"] = round(max(gpu - known, 0.0) / 3600.0, 6)
    out["mfu_unknown_share"] = round(max(gpu - known, 0.0) / gpu, 4) if gpu > 0 else None
    return out


def fleet_utilisation(engine: Engine, *, since: dt.datetime | None = None, until: dt.datetime | None = None,
                      by: Sequence[str] = GROUPINGS, now: dt.datetime | None = None) -> dict[str, Any]:
    """``{"since", "until", "by", "total": {...}, "team": [...], "family": [...], "day": [...]}`` (the groupings
    asked for, largest GPU-hours first; days in order). Raises :class:`UtilisationError` for a window that is
    empty, longer than ``MAX_WINDOW_DAYS`` or holds more than ``MAX_RUNS`` runs."""
    now = now or dt.datetime.now(dt.timezone.utc)
    until = until or now
    since = since or (until - dt.timedelta(days=DEFAULT_DAYS))
    if since >= until:
        raise UtilisationError(f"since ({since.isoformat()}) must be before until ({until.isoformat()})")
    if until - since > dt.timedelta(days=MAX_WINDOW_DAYS):
        raise UtilisationError(f"the window is longer than {MAX_WINDOW_DAYS} days (the cap of one request): ask for "
                               "a shorter since/until")
    keys = scope.visible_keys()
    rows = store.utilisation_rows(engine, since, until, by, max_runs=MAX_RUNS,
                                  owner_keys=None if keys is None else sorted(keys))
    out: dict[str, Any] = {"since": since.isoformat(), "until": until.isoformat(), "by": list(by),
                           "total": _figures({"runs": 0, **dict.fromkeys(store.FIELDS, 0.0)})}
    for g in by:
        out[g] = []
    for row in rows:
        if row["group"] is None:
            out["total"] = _figures(row)
        else:
            name = "date" if row["group"] == "day" else row["group"]
            out[row["group"]].append({name: row["key"], **_figures(row)})
    if out["total"]["runs"] > MAX_RUNS:
        raise UtilisationError(f"the window holds more than {MAX_RUNS:,} runs (the cap of one request): ask for a "
                               "shorter since/until")
    for g in by:
        if g == "day":
            out[g].sort(key=lambda r: r["date"])
        else:
            out[g].sort(key=lambda r: (-r["gpu_hours"], r[g]))
    return out
