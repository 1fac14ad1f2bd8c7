"""One rank's step-time breakdown against the median rank (``GET /api/v1/runs/{id}/ranks/{rank}/steps``,
the notebook client's ``rank_steps``, the run page's rank drill-down).

Every rank's records are stored, one compressed block per step holding all ranks (docs/architecture.md,
"Data model"). A rank's rows are read from the blocks of the requested steps only, picking the rank's
record out of each (``rank_matrix.RankPicker``); the cross-rank medians it is set against are the
step's rollups (``steps`` columns: the numbers ``/steps`` returns). What one request reads is bounded
by cells (steps read × ranks per block), so a rank of a 262,144-rank run costs a few blocks per page,
never the whole run:

- a page holds at most ``PAGE_CELLS`` // width steps (and ``MAX_PAGE_ROWS``): the answer's ``limit``
  says what was used;
- with ``max_points`` the whole run (after ``after``) is one series: every k-th step is read when the
  run is larger than ``SERIES_CELLS`` (or ``MAX_SERIES_STEPS`` steps; ``sampled_every_steps`` = k), and
  more than ``max_points`` rows are reduced to, per bucket of consecutive steps, the steps holding
  each component's minimum and maximum, plus the first and the last (``reduced``): every row is a
  real step.

Per step (seconds; ``null`` = not measured, or the rank has no record in the step: ``present``):
the rank's ``step_s``, ``data_s``, ``compute_s``, ``comm_exposed_s``, ``other_s``, ``straggler_wait_s``
(the slowest rank's work − this rank's, ≥ 0), ``work_s`` (step − exposed comm), ``work_ratio`` (its
work ÷ the median rank's), ``comm_total_s``, ``forward_s``, ``backward_s``, ``optimizer_s``; and
``median_<the same>`` — the step's cross-rank median of each (``median_straggler_wait_s`` = slowest
work − median work, as ``/steps`` has it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sqlalchemy import Engine

from ..limits import MAX_PAGE_ROWS
from ..rank_matrix import MAX_CELLS, RankPicker
from ..store import ranks as rank_store
from ..store import runs as run_store
from ..store import step_rows
from ..store import steps as step_store
from . import _cache, scope

__all__ = ["rank_steps", "RankOutsideRun", "RANK_STEP_FIELDS", "COMPONENTS", "PAGE_CELLS", "SERIES_CELLS",
           "MAX_SERIES_STEPS", "MAX_SERIES_POINTS"]

#: rank-step cells (steps × ranks per block) one page reads at most: 2,048 steps of 1,024 ranks, 8 of 262,144
PAGE_CELLS = 2 * 1024 * 1024
#: cells the downsampled series (``max_points``) reads at most: the heatmap's bound (``rank_matrix.MAX_CELLS``)
SERIES_CELLS = MAX_CELLS
#: steps the downsampled series reads at most, however narrow the run
MAX_SERIES_STEPS = 50_000
#: the most points a downsampled series may ask for (``max_points``)
MAX_SERIES_POINTS = 20_000
_CHUNK_CELLS = 1024 * 1024  # cells per block query: what one query's result holds stays ~40 MB compressed

#: the decomposition, drawn against the median rank (the run page's small multiples)
COMPONENTS = ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", "straggler_wait_s")
_PHASES = ("comm_total_s", "forward_s", "backward_s", "optimizer_s")
_BLOCK_FIELDS = ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s", *_PHASES)
_OWN = (*COMPONENTS, "work_s", "work_ratio", *_PHASES)
#: the fields of one row, in order
RANK_STEP_FIELDS: tuple[str, ...] = ("step", "ts", "n_ranks", "present", *_OWN,
                                     *(f"median_{k}" for k in (*COMPONENTS, "work_s", *_PHASES)))


class RankOutsideRun(LookupError):
    """A rank the run does not have (≥ its world size)."""

    def __init__(self, run_id: int, rank: int, world_size: int) -> None:
        self.rank = rank
        super().__init__(f"rank {rank} is outside run {run_id} (world size {world_size}: ranks 0–{world_size - 1})")


def rank_steps(engine: Engine, run_id: int, rank: int, *, offset: int = 0, limit: int = MAX_PAGE_ROWS,
               after: int | None = None, max_points: int | None = None) -> dict[str, Any] | None:
    """``{"run_id", "rank", "world_size", "host", "node", "local_rank", "device", "rollups", "steps": [row,
    …], "total", "offset", "limit", "fields", "reduced", "points", "sampled_every_steps", "max_points"}``;
    None for no such run (or one the reader may not see); :class:`RankOutsideRun` for a rank outside it.
    The downsampled series (``max_points``) is cached per run version."""
    if not scope.is_visible(engine, run_id):
        return None
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    world = max(1, int(run.world_size or 1))
    if not 0 <= int(rank) < world:
        raise RankOutsideRun(run_id, int(rank), world)
    if max_points is None:
        return _page(engine, run_id, int(rank), world, offset=offset, limit=limit, after=after)
    pts = max(2, min(int(max_points), MAX_SERIES_POINTS))
    return _cache.cached_by_id(("rank_steps", int(rank), after, pts), engine, run_id,
                               lambda: _series(engine, run_id, int(rank), world, after=after, max_points=pts))


def _width(engine: Engine, run_id: int, world: int) -> int:
    """Ranks per block to expect: the ranks really seen (a declared world size costs nothing)."""
    return max(1, min(world, step_store.rank_span(engine, run_id) or world))


def _head(engine: Engine, run_id: int, rank: int, world: int) -> dict[str, Any]:
    who = rank_store.rank_detail(engine, run_id, rank)
    roll = who.pop("rollups")
    if roll is not None:
        late_n = roll.pop("late_n") or 0.0
        late_s = roll.pop("late_s") or 0.0
        roll["late_collectives"] = int(late_n)
        # where collectives carry start times: the mean of its enqueue time − the earliest rank's (docs/metrics.md)
        roll["lateness_s"] = late_s / late_n if late_n > 0 else None
        for k in ("steps", "slowest_steps", "last_arrivals"):
            roll[k] = int(roll[k] or 0)
    return {"run_id": run_id, "rank": rank, "world_size": world, **who, "rollups": roll}


def _page(engine: Engine, run_id: int, rank: int, world: int, *, offset: int, limit: int,
          after: int | None) -> dict[str, Any]:
    width = _width(engine, run_id, world)
    lim = max(1, min(int(limit), MAX_PAGE_ROWS, PAGE_CELLS // width))
    total = step_rows.count_steps(engine, run_id)
    roll = step_rows.rollup_rows(engine, run_id, offset=offset, limit=lim, after=after)
    rows = _rows(engine, run_id, rank, width, roll)
    return {**_head(engine, run_id, rank, world), "steps": rows, "total": total, "offset": offset,
            "limit": lim, "fields": list(RANK_STEP_FIELDS), "reduced": False, "points": len(rows),
            "sampled_every_steps": 1, "max_points": None}


def _series(engine: Engine, run_id: int, rank: int, world: int, *, after: int | None, max_points: int) -> dict[str, Any]:
    width = _width(engine, run_id, world)
    total = step_rows.count_steps(engine, run_id)
    n = step_rows.count_steps(engine, run_id, after=after) if after is not None else total
    stride = max(1, -(-n * width // SERIES_CELLS), -(-n // MAX_SERIES_STEPS))
    roll = step_rows.rollup_rows(engine, run_id, after=after, stride=stride, limit=-(-n // stride) if n else 0)
    rows = _rows(engine, run_id, rank, width, roll)
    keep = _minmax_rows(rows, max_points)
    out = [rows[i] for i in keep]
    return {**_head(engine, run_id, rank, world), "steps": out, "total": total, "offset": 0, "limit": len(out),
            "fields": list(RANK_STEP_FIELDS), "reduced": len(out) < len(rows), "points": len(rows),
            "sampled_every_steps": stride, "max_points": max_points}


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _rows(engine: Engine, run_id: int, rank: int, width: int, roll: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Rows of the steps in ``roll`` (``step_rows.RANK_ROLLUP_COLUMNS``): the rank's record from each
    step's block, against the step's medians."""
    if not roll:
        return []
    cols = step_rows.RANK_ROLLUP_COLUMNS
    steps = [int(r[0]) for r in roll]
    mine: dict[int, dict[str, float]] = {}
    picker = RankPicker(_BLOCK_FIELDS)
    chunk = max(1, _CHUNK_CELLS // width)
    for blocks in step_store.blocks_of_steps(engine, run_id, steps, chunk=chunk):
        for step, blob in blocks:
            got = picker.pick(blob, rank)
            if got is not None:
                mine[step] = got
    out = []
    for r in roll:
        med = {k: _num(v) for k, v in zip(cols, r, strict=True)}
        step = int(r[0])
        own = mine.get(step)
        row: dict[str, Any] = {"step": step, "ts": med["ts"], "n_ranks": int(r[2] or 0), "present": own is not None}
        w_max = med["work_s_max"]
        if own is not None:
            o = {k: _num(v) for k, v in own.items()}
            work = None if o["step_s"] is None else o["step_s"] - (o["comm_exposed_s"] or 0.0)
            wait = None if work is None or w_max is None else max(w_max - work, 0.0)
            ratio = work / med["work_s"] if work is not None and med["work_s"] else None
            row.update({"step_s": o["step_s"], "data_s": o["data_s"], "compute_s": o["compute_s"],
                        "comm_exposed_s": o["comm_exposed_s"], "other_s": o["other_s"], "straggler_wait_s": wait,
                        "work_s": work, "work_ratio": ratio, **{k: o[k] for k in _PHASES}})
        else:
            row.update(dict.fromkeys(_OWN))
        med_wait = max((w_max - med["work_s"]) if w_max is not None and med["work_s"] is not None else 0.0, 0.0)
        for k in (*COMPONENTS, "work_s", *_PHASES):
            row[f"median_{k}"] = med_wait if k == "straggler_wait_s" else med[k]
        out.append(row)
    return out


def _minmax_rows(rows: list[dict[str, Any]], max_points: int) -> list[int]:
    """Indices of the rows kept (in step order): all when they fit in ``max_points``, else per bucket of
    consecutive rows the ones holding each component's minimum and maximum (the rank's), plus the
    first and the last row — at most ``max_points``."""
    n = len(rows)
    if n <= max_points:
        return list(range(n))
    buckets = max(1, (max_points - 2) // (2 * len(COMPONENTS)))
    edges = np.linspace(0, n, buckets + 1).round().astype(np.int64)
    keep = {0, n - 1}
    for k in COMPONENTS:
        v = np.array([np.nan if r[k] is None else r[k] for r in rows], dtype=np.float64)
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
            seg = v[a:b]
            ok = ~np.isnan(seg)
            if not ok.any():
                continue
            idx = np.flatnonzero(ok)
            keep.add(a + int(idx[np.argmin(seg[ok])]))
            keep.add(a + int(idx[np.argmax(seg[ok])]))
    return sorted(keep)
