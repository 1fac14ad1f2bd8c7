"""Per-rank tables: ``ranks`` (host, node), and the straggler rollups ``rank_rollups`` / ``rank_windows``
(read here; written by ``compaction.RollupWriter`` in the compaction transaction)."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from .rows import RankRollups

__all__ = [
    "RankRollups",
    "ROLLUP_COLUMNS",
    "hosts",
    "node_of_rank",
    "gpus_per_node",
    "rank_rollups",
    "rank_detail",
]

#: the per-rank scalars of ``rank_rollups`` a report reads (sums over the rank's compacted steps)
ROLLUP_COLUMNS = ("rank", "steps", "above", "slowdown", "excess_s", "data_excess_s", "compute_excess_s",
                  "other_excess_s", "lost_s", "slowest_steps", "late_s", "late_n", "last_arrivals", "step_s", "data_s")


def hosts(engine: Engine, run_id: int) -> dict[int, tuple[str | None, str | None]]:
    """{rank: (host, node)}; the node defaults to the host."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT rank, host, node FROM ranks WHERE run_id = :id"), {"id": run_id}).fetchall()
    return {int(r): (h, n or h) for r, h, n in rows}


def node_of_rank(engine: Engine, run_id: int) -> dict[int, str | None]:
    """{rank: node, else host} of the ranks that reported one."""
    with engine.connect() as c:
        return dict(c.execute(text("SELECT rank, coalesce(node, host) FROM ranks WHERE run_id = :id"),
                              {"id": run_id}).fetchall())


def gpus_per_node(engine: Engine, run_id: int) -> int | None:
    """The most ranks seen on one node (None when no rank reported its node)."""
    with engine.connect() as c:
        v = c.execute(
            text("SELECT max(k) FROM (SELECT count(*) AS k FROM ranks WHERE run_id = :id AND node IS NOT NULL "
                 "GROUP BY node) t"),
            {"id": run_id},
        ).scalar()
    return int(v) if v else None


def rank_rollups(engine: Engine, run_id: int, *, min_window_steps: int) -> RankRollups | None:
    """The run's per-rank rollups (None when it has none: compacted before the fold existed, or the fold
    failed); windows count when they hold at least ``min_window_steps`` steps of the rank."""
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT {', '.join(ROLLUP_COLUMNS)} FROM rank_rollups WHERE run_id = :id AND steps > 0 ORDER BY rank"),
            {"id": run_id},
        ).fetchall()
        if not rows:
            return None
        wins = c.execute(
            text("SELECT rank, win, steps, above, ratio_sum FROM rank_windows WHERE run_id = :id AND steps >= :m "
                 "AND above * 2 > steps ORDER BY rank, win"),
            {"id": run_id, "m": min_window_steps},
        ).fetchall()
        n_wins = c.execute(
            text("SELECT rank, count(*) FROM rank_windows WHERE run_id = :id AND steps >= :m GROUP BY rank"),
            {"id": run_id, "m": min_window_steps},
        ).fetchall()
    # one row per rank, scalars only: the median ratio was taken from the histogram at fold time
    mat = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64)
    flagged: dict[int, list[tuple[int, float]]] = {}
    for rank, w, steps, _above, ratio_sum in wins:
        flagged.setdefault(int(rank), []).append((int(w), float(ratio_sum) / max(int(steps), 1)))
    return RankRollups({k: mat[:, i] for i, k in enumerate(ROLLUP_COLUMNS)}, flagged,
                       {int(k): int(v) for k, v in n_wins})


#: ``rank_rollups`` columns of one rank's detail (``rank_detail``)
_DETAIL_ROLLUPS = ("steps", "slowdown", "excess_s", "data_excess_s", "compute_excess_s", "other_excess_s", "lost_s",
                   "slowest_steps", "late_s", "late_n", "last_arrivals")


def rank_detail(engine: Engine, run_id: int, rank: int) -> dict[str, Any]:
    """One rank's row of ``ranks`` (``host``, ``node`` — the host when none —, ``local_rank``, ``device``;
    None each when the rank never reported them) and of ``rank_rollups`` (``rollups``: the sums over its
    compacted steps, None when the run has none for it): two primary-key reads, whatever the run's width."""
    with engine.connect() as c:
        who = c.execute(text("SELECT host, coalesce(node, host), local_rank, device FROM ranks "
                             "WHERE run_id = :id AND rank = :r"), {"id": run_id, "r": rank}).fetchone()
        roll = c.execute(text(f"SELECT {', '.join(_DETAIL_ROLLUPS)} FROM rank_rollups WHERE run_id = :id AND rank = :r"),
                         {"id": run_id, "r": rank}).fetchone()
    out: dict[str, Any] = dict(zip(("host", "node", "local_rank", "device"), who or (None,) * 4, strict=True))
    out["rollups"] = None if roll is None else {k: (None if v is None else float(v)) for k, v in zip(_DETAIL_ROLLUPS, roll,
                                                                                                    strict=True)}
    return out
