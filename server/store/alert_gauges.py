"""What ``/metrics`` exports about runs that ended while an alert of theirs still fires (server/prom.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

__all__ = ["ended_runs_firing"]

#: ended runs (not live) with a firing alert, paging kinds first, then the most recently active
_ENDED_FIRING = """
SELECT a.run_id FROM alerts a JOIN runs r ON r.id = a.run_id
WHERE a.state = 'firing' AND NOT (r.status = ANY(:live))
GROUP BY a.run_id
ORDER BY bool_or(a.kind = ANY(:paging)) DESC, max(r.last_seen_at) DESC NULLS LAST, a.run_id DESC
LIMIT :n
"""
_FIRING_OF = """
SELECT run_id, kind, count(*) FROM alerts WHERE state = 'firing' AND run_id = ANY(:ids) GROUP BY run_id, kind
"""


def ended_runs_firing(engine: Any, cap: int, live: Sequence[str], paging: Sequence[str],
                      ) -> tuple[list[int], list[tuple[int, str, int]]]:
    """The ids of at most ``cap`` runs whose status is not in ``live`` with a firing alert (``paging``
    kinds first, then the most recently active) and their firing alerts as (run id, kind, count)."""
    with engine.connect() as c:
        ids = [int(r[0]) for r in c.execute(text(_ENDED_FIRING), {"live": list(live), "paging": list(paging),
                                                                   "n": int(cap)})]
        firing = c.execute(text(_FIRING_OF), {"ids": ids}).fetchall() if ids else []
    return ids, [(int(r[0]), str(r[1]), int(r[2])) for r in firing]
