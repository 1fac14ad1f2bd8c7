"""``run_rank_modalities``: each rank's tokens per modality summed over steps (folded at compaction,
``store.compaction.upsert_rank_modalities``) — read for the token balance (``analysis.tokens``)."""

from __future__ import annotations

from sqlalchemy import Engine, text

__all__ = ["rank_modalities"]


def rank_modalities(engine: Engine, run_id: int) -> list[tuple[int, str, int, int]]:
    """(rank, modality, tokens summed over steps, steps with tokens of it) of the run, by rank."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, modality, tokens, steps FROM run_rank_modalities WHERE run_id = :r "
                              "ORDER BY rank, modality"), {"r": run_id}).fetchall()
    return [(int(r), str(m), int(t), int(s)) for r, m, t, s in rows]
