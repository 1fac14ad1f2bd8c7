"""Device telemetry read from outside the job (``server/dcgm.py``): the ranks it may be joined to, and its
windows landed in ``run_devices`` with ``source = 'dcgm'`` (migration 0024) — the same rows as the agent's, so
``/devices``, straggler causes and the run page read them alike.

Bounds: the same per-run cap as the agent's windows (``MAX_DEVICE_WINDOWS_PER_RUN``, counted in
``run_event_counts`` kind ``device``); one row per (rank, window start), the first kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, text

from ..device_wire import DEVICE_KIND
from ..limits import MAX_DEVICE_WINDOWS_PER_RUN

__all__ = ["DCGM_SOURCE", "ranks_without_agent_telemetry", "land_dcgm_windows", "rank_sources", "WINDOW_COLUMNS"]

DCGM_SOURCE = "dcgm"
#: the ``run_devices`` columns a dcgm window fills (the rest stay NULL / their defaults)
WINDOW_COLUMNS = ("rank", "t_ms", "window_s", "samples", "sm_clock_min", "sm_clock_mean", "sm_clock_max",
                  "mem_clock_mean", "power_mean", "power_max", "power_limit", "temp_mean", "temp_max", "util_mean",
                  "mem_used_max", "throttle", "throttled_s", "throttle_s", "ecc_errors", "xid")


def ranks_without_agent_telemetry(engine: Engine, *, max_ranks: int, since_ms: int) -> list[tuple[int, int, str, int | None]]:
    """(run id, rank, node — else host —, local rank) of the ranks of running runs that reported their node and
    have no agent telemetry since ``since_ms`` (the newest runs first, at most ``max_ranks``)."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT k.run_id, k.rank, coalesce(k.node, k.host), k.local_rank FROM runs r "
            "JOIN ranks k ON k.run_id = r.id WHERE r.status = 'running' AND coalesce(k.node, k.host) IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM run_devices d WHERE d.run_id = k.run_id AND d.rank = k.rank "
            "AND d.source = 'agent' AND d.t_ms >= :t) "
            "ORDER BY r.id DESC, k.rank LIMIT :n"), {"n": int(max_ranks), "t": int(since_ms)}).fetchall()
    return [(int(a), int(b), str(n), None if lr is None else int(lr)) for a, b, n, lr in rows]


def land_dcgm_windows(engine: Engine, windows: Mapping[int, Sequence[dict[str, Any]]]) -> int:
    """Store these windows ({run id: [{column: value}]}, ``WINDOW_COLUMNS``) with source ``dcgm``, within the
    per-run cap; returns the rows stored. One transaction per run."""
    stored_all = 0
    cols = ", ".join(WINDOW_COLUMNS)
    vals = ", ".join(f"CAST(:{c} AS jsonb)" if c == "throttle_s" else (f"CAST(:{c} AS int[])" if c == "xid" else f":{c}")
                     for c in WINDOW_COLUMNS)
    for run_id, rows in windows.items():
        if not rows:
            continue
        with engine.begin() as c:
            got = c.execute(text("SELECT stored FROM run_event_counts WHERE run_id = :r AND kind = :k"),
                            {"r": run_id, "k": DEVICE_KIND}).fetchone()
            room = max(MAX_DEVICE_WINDOWS_PER_RUN - (int(got[0]) if got else 0), 0)
            keep, dropped = list(rows)[:room], max(len(rows) - room, 0)
            stored = 0
            if keep:
                params = []
                for w in keep:
                    p = {k: w.get(k) for k in WINDOW_COLUMNS}
                    p["throttle_s"] = json.dumps(w["throttle_s"]) if w.get("throttle_s") else None
                    p["xid"] = list(w["xid"]) if w.get("xid") else None
                    params.append({"run_id": run_id, **p})
                res = c.execute(text(f"INSERT INTO run_devices (run_id, {cols}, source) VALUES (:run_id, {vals}, "
                                     "'dcgm') ON CONFLICT DO NOTHING"), params)
                stored = int(res.rowcount) if res.rowcount is not None and res.rowcount >= 0 else len(keep)
            if stored or dropped:
                c.execute(text(
                    "INSERT INTO run_event_counts (run_id, kind, stored, dropped) VALUES (:r, :k, :s, :d) "
                    "ON CONFLICT (run_id, kind) DO UPDATE SET stored = run_event_counts.stored + excluded.stored, "
                    "dropped = run_event_counts.dropped + excluded.dropped"),
                    {"r": run_id, "k": DEVICE_KIND, "s": stored, "d": dropped})
        stored_all += stored
    return stored_all


def rank_sources(engine: Engine, run_id: int) -> dict[int, list[str]]:
    """{rank: the sources of its device windows} ('agent', 'dcgm')."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, array_agg(DISTINCT source ORDER BY source) FROM run_devices "
                              "WHERE run_id = :r GROUP BY rank"), {"r": run_id}).fetchall()
    return {int(r): [str(s) for s in srcs] for r, srcs in rows}
