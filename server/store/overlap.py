"""What the overlap timeline reads beyond the recent blocks (``steps.recent_comm_blocks``): one step's
decoded blocks, and the run's dimension names (``run_dims``)."""

from __future__ import annotations

import numpy as np
from sqlalchemy import Engine, text

from ..codec import COLL_BLOCK_FIELDS, STEP_BLOCK_FIELDS, decode_block

__all__ = ["step_blocks", "dim_names"]


def step_blocks(engine: Engine, run_id: int,
                step: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None] | None:
    """(rank-step block, collective block or None) of one compacted step, decoded; None when the step
    has no rank-step records."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT block, coll_block FROM steps WHERE run_id = :id AND step = :s AND n_ranks > 0"),
            {"id": run_id, "s": step},
        ).fetchone()
    if row is None or row[0] is None:
        return None
    return decode_block(STEP_BLOCK_FIELDS, row[0]), decode_block(COLL_BLOCK_FIELDS, row[1]) if row[1] is not None else None


def dim_names(engine: Engine, run_id: int) -> dict[int, str]:
    """{dimension code: name} of the run's collective blocks (``codec.dim_code``)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT code, name FROM run_dims WHERE run_id = :id"), {"id": run_id}).fetchall()
    return {int(code): str(name) for code, name in rows}
