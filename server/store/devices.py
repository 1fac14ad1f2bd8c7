"""Device telemetry: ``run_devices``, one row per (run, rank, window) of the agent's ``device`` events —
written at ingest (:func:`land_devices`, called by ``events.land_events`` under the run's event lock) and
read per run: per-rank figures (:func:`rank_device_figures`), windows (:func:`device_windows`), and per
node across runs (:func:`node_device_trouble`). Kept general (run, rank, window) so that other sources
(a dcgm-exporter scrape joined to a run's ranks) can land the same rows.

Bounds: at most MAX_DEVICE_WINDOWS_PER_RUN rows per run; further windows are dropped and counted in
``run_event_counts`` kind ``device`` (``stored`` = rows kept). One row per (rank, window start): the first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, text

from ..device_wire import DEVICE_KIND, THROTTLING, reason_mask
from ..limits import MAX_DEVICE_WINDOWS_PER_RUN, MAX_PAGE_ROWS

__all__ = ["land_devices", "rank_device_figures", "device_windows", "reason_seconds", "node_device_trouble",
           "DEVICE_KIND", "COLUMNS"]

COLUMNS = ("rank", "t_ms", "window_s", "samples", "sm_clock_min", "sm_clock_mean", "sm_clock_max", "mem_clock_mean",
           "power_mean", "power_max", "power_limit", "temp_mean", "temp_max", "util_mean", "mem_used_max",
           "throttle", "throttled_s", "throttle_s", "ecc_errors", "xid", "step")
_TYPES = ("int", "bigint", "real", "int", "real", "real", "real", "real", "real", "real", "real", "real", "real",
          "real", "bigint", "int", "real", "text", "int", "text", "bigint")


def _fig(d: dict[str, Any], name: str, stat: str) -> float | None:
    v = d.get(name)
    return float(v[stat]) if isinstance(v, dict) and v.get(stat) is not None else None


def _row(e: dict[str, Any]) -> tuple[Any, ...]:
    d = e["data"]
    ts = dict(d.get("throttle_s") or {})
    slowed = max((float(v) for n, v in ts.items() if n in THROTTLING), default=0.0)
    mem = _fig(d, "mem_used_bytes", "max")
    xid = [int(x) for x in d.get("xid") or []]
    return (int(e["rank"]), int(round(float(e["ts"]) * 1000)), float(d["window_s"]), int(d["samples"]),
            _fig(d, "sm_clock_mhz", "min"), _fig(d, "sm_clock_mhz", "mean"), _fig(d, "sm_clock_mhz", "max"),
            _fig(d, "mem_clock_mhz", "mean"), _fig(d, "power_w", "mean"), _fig(d, "power_w", "max"),
            _fig(d, "power_limit_w", "mean"), _fig(d, "temp_c", "mean"), _fig(d, "temp_c", "max"),
            _fig(d, "util", "mean"), int(mem) if mem is not None else None, reason_mask(d.get("throttle")),
            min(slowed, float(d["window_s"]) or slowed), json.dumps(ts) if ts else None,
            d.get("ecc_errors"), "{" + ",".join(map(str, xid)) + "}" if xid else None,
            int(e["step"]) if e.get("step") is not None else None)


def land_devices(cur: Any, run_id: int, events: Sequence[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """Store these ``device`` events (under the run's event lock, within the batch's transaction).
    Returns (events stored or already stored, {"device": windows dropped beyond the cap})."""
    if not events:
        return 0, {}
    rows: dict[tuple[int, int], tuple[Any, ...]] = {}
    for e in events:
        r = _row(e)
        rows.setdefault((r[0], r[1]), r)
    # windows already stored (a batch re-sent after a lost answer) are neither stored nor counted again;
    # found first, not from the INSERT's row count (on Citus an INSERT … SELECT reports the rows it tried)
    ranks, times = zip(*rows, strict=True)
    present = {(int(r), int(t)) for r, t in cur.execute(
        "SELECT rank, t_ms FROM run_devices WHERE run_id = %s AND (rank, t_ms) IN "
        "(SELECT * FROM unnest(%s::int[], %s::bigint[]))", (run_id, list(ranks), list(times))).fetchall()}
    for k in present:
        rows.pop(k, None)
    row = cur.execute("SELECT stored FROM run_event_counts WHERE run_id = %s AND kind = %s",
                      (run_id, DEVICE_KIND)).fetchone()
    room = max(MAX_DEVICE_WINDOWS_PER_RUN - (int(row[0]) if row else 0), 0)
    keep = list(rows.values())[:room]
    dropped = len(rows) - len(keep)
    stored = 0
    if keep:
        cols = list(zip(*keep, strict=True))
        unnest = ", ".join(f"%s::{t}[]" for t in _TYPES)
        select = ", ".join(f"u.{c}::jsonb" if c == "throttle_s" else (f"u.{c}::int[]" if c == "xid" else f"u.{c}")
                           for c in COLUMNS)
        cur.execute(
            f"INSERT INTO run_devices (run_id, {', '.join(COLUMNS)}) SELECT %s, {select} "
            f"FROM unnest({unnest}) AS u({', '.join(COLUMNS)}) ON CONFLICT DO NOTHING",
            (run_id, *[list(c) for c in cols]))
        stored = len(keep)  # the run's event lock is held: no other batch of this run lands meanwhile
    if stored or dropped:
        cur.execute(
            "INSERT INTO run_event_counts (run_id, kind, stored, dropped) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (run_id, kind) DO UPDATE SET stored = run_event_counts.stored + excluded.stored, "
            "dropped = run_event_counts.dropped + excluded.dropped",
            (run_id, DEVICE_KIND, stored, dropped))
    return len(events) - dropped, ({DEVICE_KIND: dropped} if dropped else {})


_FIGURES_SQL = """
SELECT d.rank, max(k.host), max(k.node), count(*), sum(d.window_s),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.sm_clock_mean), min(d.sm_clock_min), max(d.sm_clock_max),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.mem_clock_mean),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.power_mean), max(d.power_max), max(d.power_limit),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.temp_mean), max(d.temp_max),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.util_mean), max(d.mem_used_max),
       bit_or(d.throttle), sum(d.throttled_s), sum(d.ecc_errors), min(d.t_ms), max(d.t_ms)
FROM run_devices d LEFT JOIN ranks k ON k.run_id = d.run_id AND k.rank = d.rank
WHERE d.run_id = :r GROUP BY d.rank ORDER BY d.rank LIMIT :n
"""
FIGURE_KEYS = ("rank", "host", "node", "windows", "seconds", "sm_clock_mhz_median", "sm_clock_mhz_min",
               "sm_clock_mhz_max", "mem_clock_mhz_median", "power_w_median", "power_w_max", "power_limit_w",
               "temp_c_median", "temp_c_max", "util_median", "mem_used_bytes_max", "throttle_mask", "throttled_s",
               "ecc_errors", "first_ms", "last_ms")


def rank_device_figures(engine: Engine, run_id: int, *, max_ranks: int = 65_536) -> list[dict[str, Any]]:
    """Per rank of the run (those with telemetry): its windows' figures (medians over windows, extremes),
    host and node, the throttle reasons' mask, seconds throttled, ECC errors — plus ``xid`` (codes, once
    each) and ``reason_s`` ({reason: seconds})."""
    with engine.connect() as c:
        rows = c.execute(text(_FIGURES_SQL), {"r": run_id, "n": max_ranks}).fetchall()
        out = [dict(zip(FIGURE_KEYS, row, strict=True)) for row in rows]
        xids: dict[int, list[int]] = {}
        for rank, x in c.execute(text(
                "SELECT rank, array_agg(DISTINCT x ORDER BY x) FROM run_devices, unnest(xid) AS x "
                "WHERE run_id = :r AND xid IS NOT NULL GROUP BY rank LIMIT :n"), {"r": run_id, "n": max_ranks}):
            xids[int(rank)] = [int(v) for v in x][:64]
    secs = reason_seconds(engine, run_id)
    for f in out:
        f["xid"] = xids.get(int(f["rank"]), [])
        f["reason_s"] = secs.get(int(f["rank"]), {})
    return out


def reason_seconds(engine: Engine, run_id: int) -> dict[int, dict[str, float]]:
    """{rank: {reason: seconds active}} summed over the run's windows."""
    out: dict[int, dict[str, float]] = {}
    with engine.connect() as c:
        for rank, name, s in c.execute(text(
                "SELECT rank, j.key, sum(j.value::text::float8) FROM run_devices, jsonb_each(throttle_s) AS j "
                "WHERE run_id = :r AND throttle_s IS NOT NULL GROUP BY rank, j.key LIMIT 1000000"), {"r": run_id}):
            out.setdefault(int(rank), {})[str(name)] = float(s)
    return out


def device_windows(engine: Engine, run_id: int, *, ranks: Sequence[int] | None = None, t0_ms: int | None = None,
                   t1_ms: int | None = None, limit: int = MAX_PAGE_ROWS) -> list[dict[str, Any]]:
    """The run's windows in (rank, time) order, optionally of some ranks and within [t0_ms, t1_ms)."""
    where = ["run_id = :r"]
    args: dict[str, Any] = {"r": run_id, "n": max(1, min(int(limit), MAX_PAGE_ROWS))}
    if ranks is not None:
        where.append("rank = ANY(:ranks)")
        args["ranks"] = [int(r) for r in ranks]
    if t0_ms is not None:
        where.append("t_ms >= :t0")
        args["t0"] = int(t0_ms)
    if t1_ms is not None:
        where.append("t_ms < :t1")
        args["t1"] = int(t1_ms)
    with engine.connect() as c:
        rows = c.execute(text(f"SELECT {', '.join(COLUMNS)} FROM run_devices WHERE {' AND '.join(where)} "
                              "ORDER BY rank, t_ms LIMIT :n"), args).fetchall()
    return [dict(zip(COLUMNS, row, strict=True)) for row in rows]


def node_device_trouble(engine: Engine, *, since_s: float | None = None, limit: int = 100,
                        owner_keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Nodes by device trouble across runs (of ``owner_keys`` only, when given): runs seen, runs with a
    throttled window, seconds throttled, XID windows and ECC errors (``run_devices`` joined to ``ranks``)."""
    args: dict[str, Any] = {"n": max(1, min(int(limit), MAX_PAGE_ROWS)), "t": int((since_s or 0) * 1000)}
    owners = ""
    if owner_keys is not None:
        owners = "AND d.run_id IN (SELECT id FROM runs WHERE owner_key = ANY(:keys)) "
        args["keys"] = list(owner_keys)
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT coalesce(k.node, k.host) AS node, count(DISTINCT d.run_id), "
            "count(DISTINCT d.run_id) FILTER (WHERE d.throttled_s > 0), sum(d.throttled_s), sum(d.window_s), "
            "count(*) FILTER (WHERE d.xid IS NOT NULL), coalesce(sum(d.ecc_errors), 0) "
            "FROM run_devices d JOIN ranks k ON k.run_id = d.run_id AND k.rank = d.rank "
            f"WHERE d.t_ms >= :t {owners}AND coalesce(k.node, k.host) IS NOT NULL GROUP BY 1 "
            "ORDER BY 3 DESC, 6 DESC, 4 DESC LIMIT :n"), args).fetchall()
    return [{"node": r[0], "runs": int(r[1]), "runs_throttled": int(r[2]), "throttled_s": float(r[3] or 0),
             "seconds": float(r[4] or 0), "xid_windows": int(r[5]), "ecc_errors": int(r[6])} for r in rows]
