"""What the regression detector and the alert explanation read besides the run figures: per-run
collective sums (busbw per op, exposed seconds per dimension and op) and the nodes each run used."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sqlalchemy import Engine, text

from fleetscope.wire import COLLECTIVE_OPS

__all__ = ["CollectiveSum", "collective_sums", "run_nodes", "rank_placement", "step_components_tail"]

#: (op, group size, dimension name or None, bytes, total seconds, exposed seconds), summed over the
#: run's records (every rank and step) of that op, group size and dimension
CollectiveSum = tuple[str, int, str | None, float, float, float]


def collective_sums(engine: Engine, run_ids: Sequence[int]) -> dict[int, list[CollectiveSum]]:
    """{run id: its collective sums by (op, group size, dimension)} in one query over ``run_collectives``."""
    if not run_ids:
        return {}
    with engine.connect() as c:
        rows = c.execute(
            text(
                "SELECT c.run_id, c.op, c.group_size, d.name, sum(c.bytes), sum(c.total_s), sum(c.exposed_s) "
                "FROM run_collectives c LEFT JOIN run_dims d ON d.run_id = c.run_id AND d.code = c.dim "
                "WHERE c.run_id = ANY(:ids) GROUP BY c.run_id, c.op, c.group_size, d.name"
            ),
            {"ids": list(run_ids)},
        ).fetchall()
    out: dict[int, list[CollectiveSum]] = {}
    for rid, op, n, dim, nbytes, tot, exp in rows:
        name = COLLECTIVE_OPS[op] if 0 <= op < len(COLLECTIVE_OPS) else "other"
        out.setdefault(int(rid), []).append((name, int(n), dim, float(nbytes or 0), float(tot or 0), float(exp or 0)))
    return out


def run_nodes(engine: Engine, run_ids: Sequence[int]) -> dict[int, list[str]]:
    """{run id: the distinct nodes (else hosts) its ranks reported, sorted}; runs without any are absent."""
    if not run_ids:
        return {}
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT run_id, array_agg(DISTINCT coalesce(node, host) ORDER BY coalesce(node, host)) FROM ranks "
                 "WHERE run_id = ANY(:ids) AND coalesce(node, host) IS NOT NULL GROUP BY run_id"),
            {"ids": list(run_ids)},
        ).fetchall()
    return {int(rid): list(nodes) for rid, nodes in rows}


def rank_placement(engine: Engine, run_id: int) -> dict[int, tuple[str | None, str | None, int | None, str | None]]:
    """{rank: (host, node else host, local_rank, device)} of the run's ranks that reported where they run
    (what a straggler alert's diff compares the straggler with its peers on)."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, host, node, local_rank, device FROM ranks WHERE run_id = :id"),
                         {"id": run_id}).fetchall()
    return {int(r): (h, n or h, int(lr) if lr is not None else None, d) for r, h, n, lr, d in rows}


STEP_COMPONENTS = ("step_s", "data_s", "compute_s", "comm_exposed_s", "other_s")


def step_components_tail(engine: Engine, run_id: int, limit: int) -> dict[str, np.ndarray]:
    """Step time and its components (cross-rank medians) of the run's most recent ``limit`` measured steps,
    in step order — the same steps as ``steps.step_tail`` (NaN = not measured)."""
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT step, step_s, data_s, compute_s, comm_exposed_s, other_s FROM steps "
                 "WHERE run_id = :id AND n_ranks > 0 AND step_s IS NOT NULL ORDER BY step DESC LIMIT :k"),
            {"id": run_id, "k": limit},
        ).fetchall()
    arr = np.array([[np.nan if v is None else float(v) for v in r] for r in rows[::-1]], dtype=np.float64).reshape(-1, 6)
    return {"step": arr[:, 0], **{k: arr[:, i + 1] for i, k in enumerate(STEP_COMPONENTS)}}
