"""Gradient communication against backward (``GET /api/v1/runs/{id}/overlap``, the run page's overlap
panel) and the summary's ``overlap_advice``: decoded blocks (``store``) placed and judged by
``analysis.overlap`` (docs/metrics.md, "Overlap and bucketing guidance")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine

from ..analysis import overlap as ov
from ..analysis.figures import RunFigures
from ..limits import MAX_COLLECTIVES_PER_RANK_STEP, MAX_PAGE_ROWS
from ..store import overlap as store
from ..store import runs as run_store
from ..store import steps
from ..store.rows import RunRow
from . import _cache

__all__ = ["run_overlap", "run_overlap_advice", "OVERLAP_STEPS", "ADVICE_STEPS"]

OVERLAP_STEPS = 20  # recent steps the default (representative) step is chosen from
ADVICE_STEPS = 20  # recent steps whose median-rank timelines the advice takes medians over

NOTE = ("times in seconds from the step's start (the rank-step's ts); issue, duration and exposed part of each "
        "collective are measured; backward's start is estimated (data + forward time outside the measured waits) "
        "and its end is the last gradient reduction's issue where there is one, else estimated like the start")


def _empty(run_id: int, step: int | None, why: str) -> dict[str, Any]:
    return {"run_id": run_id, "step": step, "rank": None, "step_s": None, "comm_exposed_s": None, "backward": None,
            "collectives": [], "collectives_total": 0, "collectives_folded": [], "tail_s": None, "overlap_ratio": None,
            "backward_overlap_ratio": None, "note": why}


def run_overlap(engine: Engine, run_id: int, *, step: int | None = None, rank: int | None = None,
                limit: int = MAX_PAGE_ROWS) -> dict[str, Any] | None:
    """The timeline of one rank-step (``analysis.overlap.timeline``): ``step`` (default: of the last
    ``OVERLAP_STEPS`` steps, the one whose median step time is the median), ``rank`` (default: the rank
    with that step's median step time). None for no such run; ``rank: None`` when the step or rank has
    no records. Bounded whatever is stored: the rank-step's first ``MAX_COLLECTIVES_PER_RANK_STEP``
    records are placed (every figure is over them), at most ``limit`` (≤ ``MAX_PAGE_ROWS``) are listed and
    the rest summed (``analysis.overlap.bounded_collectives``)."""
    limit = max(1, min(int(limit), MAX_PAGE_ROWS))
    run = run_store.get_run(engine, run_id, pending=False)
    if run is None:
        return None
    if step is None:
        xs, st = steps.step_tail(engine, run_id, OVERLAP_STEPS)
        step = ov.representative_step(xs, st)
        if step is None:
            return _empty(run_id, None, "no compacted steps yet")
    blocks = store.step_blocks(engine, run_id, step)
    if blocks is None:
        return _empty(run_id, step, f"step {step} has no records")
    sb, cb = blocks
    if rank is None:
        rank = ov.median_rank(sb)
    rs = ov.rank_step(step, sb, rank) if rank is not None else None
    if rs is None:
        return _empty(run_id, step, f"rank {rank} has no record at step {step}")
    tl = ov.timeline(rs, ov.rank_collectives(cb, rs.rank, store.dim_names(engine, run_id), run.world_size,
                                             MAX_COLLECTIVES_PER_RANK_STEP))
    return {"run_id": run_id, **tl.as_dict(limit), "note": NOTE}


def run_overlap_advice(engine: Engine, run: RunRow, fig: RunFigures,
                       bottlenecks: Sequence[Mapping[str, Any]],
                       facts: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The summary's ``overlap_advice`` (``analysis.overlap.overlap_advice``) over the median-rank
    timelines of the last ``ADVICE_STEPS`` steps; empty unless exposed communication is a top bottleneck
    (checked before any block is read). ``facts``: the job's ``{"ddp", "fsdp"}`` facts
    (``store.job_facts``). Cached until the run changes."""
    exposed = fig.decomposition.get("comm_exposed_s")
    if not ov.comm_is_top(bottlenecks, exposed, fig.step_s):
        return []

    def compute() -> list[dict[str, Any]]:
        names = store.dim_names(engine, run.id)
        tls = []
        for step, sb, cb in steps.recent_comm_blocks(engine, run.id, ADVICE_STEPS):
            rank = ov.median_rank(sb)
            rs = ov.rank_step(step, sb, rank) if rank is not None else None
            if rs is not None and cb is not None:
                tls.append(ov.timeline(rs, ov.rank_collectives(cb, rs.rank, names, run.world_size,
                                                               MAX_COLLECTIVES_PER_RANK_STEP)))
        return ov.overlap_advice(tls, bottlenecks=bottlenecks, comm_exposed_s=exposed, step_s=fig.step_s,
                                 mem_peak_bytes=fig.mem_peak_bytes, ddp=(facts or {}).get("ddp"),
                                 fsdp=(facts or {}).get("fsdp"),
                                 device_total_bytes=((facts or {}).get("memory") or {}).get("device_total_bytes"))

    return _cache.cached("overlap_advice", engine, run, compute)
