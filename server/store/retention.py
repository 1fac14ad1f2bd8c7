"""Retention: which finished runs are past their age limits, and thinning them in bounded steps.

A run's age is measured from when it last changed (``finished_at``, else ``last_seen_at``, else
``started_at``); running runs are never touched. Every statement touches one run, and the block
rewrite goes ``chunk`` steps at a time, so a pass holds no long lock and can stop anywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from ..codec import STEP_BLOCK_FIELDS, encode_block

__all__ = ["Candidate", "candidates", "thin_blocks", "drop_rollups", "mark_thinned", "EMPTY_BLOCK"]

Candidate = tuple[int, str, str | None, float, dict[str, Any] | None]
"""(run id, name, family, age in days, thinned so far)."""

EMPTY_BLOCK = encode_block(STEP_BLOCK_FIELDS, {n: np.empty(0) for n, _ in STEP_BLOCK_FIELDS})
"""What a thinned step's ``block`` holds: no rank rows (the column is NOT NULL; readers see 0 ranks)."""


def candidates(engine: Engine, min_age_days: float, limit: int = 10_000) -> list[Candidate]:
    """Finished runs at least ``min_age_days`` old, oldest first."""
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT id, name, model_family, extract(epoch FROM now() - coalesce(finished_at, last_seen_at, "
                "started_at)) / 86400.0 AS age, thinned FROM runs WHERE status NOT IN ('running', 'stalled', 'hung') "
                "AND coalesce(finished_at, last_seen_at, started_at) < now() - make_interval(secs => :s) "
                "ORDER BY age DESC LIMIT :n"
            ),
            {"s": float(min_age_days) * 86400.0, "n": limit},
        ).fetchall()
    return [(int(i), n, f, float(a), t if isinstance(t, dict) else None) for i, n, f, a, t in rows]


def thin_blocks(engine: Engine, run_id: int, chunk: int = 500) -> int:
    """Replace the per-rank blocks of the run's steps by empty ones, ``chunk`` steps per
    transaction; returns the steps rewritten."""
    done = 0
    lo = -1
    while True:
        with engine.begin() as c:
            steps = [int(s) for (s,) in c.execute(
                text("SELECT step FROM steps WHERE run_id = :r AND step > :lo AND (coll_block IS NOT NULL "
                     "OR n_ranks > 0 AND length(block) > :e) ORDER BY step LIMIT :n"),
                {"r": run_id, "lo": lo, "n": chunk, "e": len(EMPTY_BLOCK)}).fetchall()]
            if not steps:
                return done
            c.execute(text("UPDATE steps SET block = :b, coll_block = NULL WHERE run_id = :r AND step = ANY(:s)"),
                      {"b": EMPTY_BLOCK, "r": run_id, "s": steps})
            c.execute(text("DELETE FROM rank_windows WHERE run_id = :r"), {"r": run_id})
        done += len(steps)
        lo = steps[-1]


def drop_rollups(engine: Engine, run_id: int, chunk: int = 5000) -> int:
    """Delete the run's per-step rows (steps, step_comm, run_phases, run_modalities), ``chunk`` steps
    per transaction; the run, its cached figures, rank rollups and collective totals stay."""
    done = 0
    while True:
        with engine.begin() as c:
            n = c.execute(
                text("DELETE FROM steps WHERE run_id = :r AND step IN "
                     "(SELECT step FROM steps WHERE run_id = :r ORDER BY step LIMIT :n)"),
                {"r": run_id, "n": chunk}).rowcount or 0
            if not n:
                for t in ("step_comm", "run_phases", "run_modalities", "rank_windows"):
                    c.execute(text(f"DELETE FROM {t} WHERE run_id = :r"), {"r": run_id})
                return done
        done += n


def mark_thinned(engine: Engine, run_id: int, what: str) -> None:
    """Record in ``runs.thinned`` that ``what`` ("blocks" | "rollups") was removed now."""
    with engine.begin() as c:
        c.execute(text("UPDATE runs SET thinned = coalesce(thinned, '{}'::jsonb) || jsonb_build_object(CAST(:w AS text), "
                       "now()::text) WHERE id = :r"), {"r": run_id, "w": what})
