"""What the steady-state rule (``analysis.steady``) reads, for any number of runs in two queries: each
run's per-step times and the events that mark steps (compile, checkpoint, eval, restart)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from sqlalchemy import Engine, text

from ..limits import MAX_EVENTS_PER_RUN
from .rows import StepFrame
from .steps import PER_STEP

__all__ = ["load_step_times", "marking_events"]

MarkEvent = tuple[str, float | None, int | None, None]


def load_step_times(engine: Engine, run_ids: Iterable[int]) -> dict[int, StepFrame]:
    """{run: frame of ``step``, ``ts``, ``step_s``, ``data_s`` (cross-rank medians) and ``wait_s``
    (``steps.PER_STEP``)} of the runs' compacted steps in step order; runs without one are absent."""
    ids = [int(r) for r in run_ids]
    if not ids:
        return {}
    with engine.connect() as c:
        rows = c.execute(text(f"SELECT run_id, step, ts, step_s, data_s, {PER_STEP['wait_s']} FROM steps "
                              "WHERE run_id = ANY(:ids) AND n_ranks > 0 ORDER BY run_id, step"), {"ids": ids}).fetchall()
    if not rows:
        return {}
    arr = np.array([tuple(r) for r in rows], dtype=np.float64)  # None (not measured) becomes NaN
    cuts = np.flatnonzero(np.diff(arr[:, 0])) + 1
    out: dict[int, StepFrame] = {}
    for part in np.split(arr, cuts):
        out[int(part[0, 0])] = StepFrame({"step": part[:, 1], "ts": part[:, 2], "step_s": part[:, 3],
                                          "data_s": part[:, 4], "wait_s": part[:, 5]})
    return out


def marking_events(engine: Engine, run_ids: Iterable[int], kinds: Sequence[str],
                   limit: int = MAX_EVENTS_PER_RUN) -> dict[int, list[MarkEvent]]:
    """{run: [(kind, ts, step, None)]} of the events of these kinds: one per (kind, step) whatever the
    number of ranks that sent it (the earliest timestamp), and rank 0's events that name no step; at
    most ``limit`` per run, in step order."""
    ids = [int(r) for r in run_ids]
    if not ids:
        return {}
    args = {"ids": ids, "k": list(kinds)}
    with engine.connect() as c:  # two plain queries (no UNION): each runs as it is on Citus
        rows = list(c.execute(text(
            "SELECT run_id, kind, min(ts), step FROM run_events WHERE run_id = ANY(:ids) AND kind = ANY(:k) "
            "AND step IS NOT NULL GROUP BY run_id, kind, step ORDER BY run_id, step"), args))
        rows += list(c.execute(text(
            "SELECT run_id, kind, ts, step FROM run_events WHERE run_id = ANY(:ids) AND kind = ANY(:k) "
            "AND step IS NULL AND rank = 0 ORDER BY run_id, ts"), args))
    out: dict[int, list[MarkEvent]] = {}
    for rid, kind, ts, step in rows:
        lst = out.setdefault(int(rid), [])
        if len(lst) < limit:
            lst.append((str(kind), float(ts) if ts is not None else None, int(step) if step is not None else None, None))
    return out
