"""Fleet utilisation (docs/metrics.md "Fleet utilisation"): GPU-hours of the runs that overlap a time window,
clipped to it, split per UTC day, and grouped per team, model family and day — one statement per request.

Per run: its wall span is ``started_at`` to ``finished_at`` (else the last time seen); each UTC day piece of
it inside ``[since, until)`` counts ``world_size × piece seconds``. Within a piece, the run's compacted steps
that started in it (``steps.ts``, grouped per run and day in one pass over the runs' steps joined on
``run_id`` — no correlated subquery, so Citus plans it: the runs are an intermediate result) give the busy time (the median rank's step time), the model FLOPs done
(``steps.flops``, summed over ranks) and the steps redone after a restart (a step of attempt k whose index is
at most the last step of the job's earlier attempts). MFU is known for a run with a peak FLOP/s and model
FLOPs in its steps within the window: all of its GPU-hours in the window count as known. Caps: at most ``max_runs`` runs (one more is read to
tell the caller it was over), the window length is the caller's to cap.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, text

__all__ = ["GROUPINGS", "FIELDS", "utilisation_rows"]

#: the groupings a request may ask for (a grouping set each, plus the total)
GROUPINGS = ("team", "family", "day")
#: the figures of each group, in the statement's column order after the group's key
FIELDS = ("runs", "gpu_s", "busy_gpu_s", "failed_gpu_s", "redone_gpu_s", "mfu_gpu_s", "mfu_known_gpu_s")

_SQL = """
WITH r AS (
  SELECT id, world_size, status, peak_flops,
         CASE WHEN owner_key LIKE 'team:%%' THEN substr(owner_key, 6) ELSE '' END AS team,
         coalesce(model_family, '') AS family,
         greatest(started_at, :t0) AS a0,
         least(greatest(coalesce(finished_at, last_seen_at, started_at), started_at), :t1) AS b0,
         CASE WHEN attempt > 0 AND job_id IS NOT NULL THEN
           (SELECT max(p.last_step) FROM runs p WHERE p.owner_key = runs.owner_key AND p.job_id = runs.job_id
              AND p.attempt < runs.attempt) END AS prev_last
  FROM runs
  WHERE started_at < :t1 AND coalesce(finished_at, last_seen_at, started_at) > :t0 {owners}
  ORDER BY id LIMIT :cap
),
d AS (
  SELECT r.*, (day AT TIME ZONE 'UTC')::date AS day, greatest(r.a0, day) AS a, least(r.b0, day + interval '1 day') AS b
  FROM r, generate_series(date_trunc('day', r.a0, 'UTC'), r.b0, interval '1 day') AS day
  WHERE r.b0 > r.a0
),
s AS (
  SELECT st.run_id, (to_timestamp(st.ts) AT TIME ZONE 'UTC')::date AS day, sum(st.step_s)::float8 AS busy_s,
         coalesce(sum(st.step_s) FILTER (WHERE st.step <= r.prev_last), 0)::float8 AS redone_s,
         sum(st.flops)::float8 AS flops
  FROM steps st JOIN r ON r.id = st.run_id
  WHERE st.n_ranks > 0 AND st.ts >= extract(epoch FROM r.a0) AND st.ts < extract(epoch FROM r.b0)
  GROUP BY 1, 2
),
p AS (
  SELECT d.id, d.day, d.team, d.family, d.status, d.world_size, d.peak_flops,
         extract(epoch FROM d.b - d.a)::float8 AS wall_s, coalesce(s.busy_s, 0) AS busy_s,
         coalesce(s.redone_s, 0) AS redone_s, s.flops, max(s.flops) OVER (PARTITION BY d.id) AS run_flops
  FROM d LEFT JOIN s ON s.run_id = d.id AND s.day = d.day
  WHERE d.b > d.a
)
SELECT {keys}, count(DISTINCT id),
       sum(world_size * wall_s),
       sum(world_size * least(busy_s, wall_s)),
       coalesce(sum(world_size * wall_s) FILTER (WHERE status = 'failed'), 0),
       sum(world_size * least(redone_s, wall_s)),
       coalesce(sum(flops / peak_flops) FILTER (WHERE peak_flops > 0 AND flops > 0), 0),
       coalesce(sum(world_size * wall_s) FILTER (WHERE peak_flops > 0 AND run_flops > 0), 0)
FROM p GROUP BY GROUPING SETS ({sets})
"""


def utilisation_rows(engine: Engine, since: dt.datetime, until: dt.datetime, by: Sequence[str], *, max_runs: int,
                     owner_keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per group of each grouping in ``by`` (``GROUPINGS``) and one total row (``group`` None):
    ``{"group": "team"|"family"|"day"|None, "key", *FIELDS}`` (seconds of GPU time; ``runs`` of the total row
    is the number of runs, at most ``max_runs + 1``). Of the runs of ``owner_keys`` only, when given."""
    asked = [g for g in GROUPINGS if g in by]
    keys = ", ".join(f"{g}, grouping({g})" for g in asked) if asked else "NULL"
    sets = ", ".join([f"({g})" for g in asked] + ["()"])
    args: dict[str, Any] = {"t0": since, "t1": until, "cap": int(max_runs) + 1}
    owners = ""
    if owner_keys is not None:
        owners = "AND owner_key = ANY(:keys)"
        args["keys"] = list(owner_keys)
    sql = _SQL.format(owners=owners, keys=keys, sets=sets).replace("%%", "%")
    with engine.connect() as c:
        rows = c.execute(text(sql), args).fetchall()
    out: list[dict[str, Any]] = []
    n = 2 * len(asked) if asked else 1
    for row in rows:
        group: str | None = None
        key: Any = None
        for i, g in enumerate(asked):
            if int(row[2 * i + 1]) == 0:  # grouping(g) = 0: this row is grouped by g
                group, key = g, row[2 * i]
        if isinstance(key, dt.date):
            key = key.isoformat()
        vals = [float(v or 0) for v in row[n:]]
        out.append({"group": group, "key": key, **dict(zip(FIELDS, vals, strict=True))})
        out[-1]["runs"] = int(out[-1]["runs"])
    return out
