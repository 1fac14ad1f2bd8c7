"""Projection inputs and records: the fleet's collective rollups by op × group size × message size (what
the busbw table is built from), and ``run_projections`` (migration 0023), the projections asked of runs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text

from fleetscope.wire import COLLECTIVE_OPS

__all__ = ["FleetCollective", "ProjectionWrite", "ProjectionRow", "device_runs", "fleet_collectives", "record",
           "family_projections"]


@dataclass(frozen=True)
class FleetCollective:
    """One run's collectives of one op × group size × message-size bucket, summed over its rank-steps."""

    run_id: int
    op: str
    group_size: int
    bytes: float
    calls: float
    total_s: float


@dataclass(frozen=True)
class _Projection:
    """A projection of a run to a target layout, as recorded (the fields ProjectionWrite and ProjectionRow
    share, in column order)."""

    run_id: int
    world_size: int
    tp: int
    pp: int
    micro_batches: int  # 0: as the run
    bucket_bytes: int  # 0: as the run
    hold_global_batch: bool
    owner_key: str
    model_family: str | None
    signature: str
    device_type: str | None
    from_world_size: int
    from_tp: int
    from_pp: int
    step_s: float
    mfu: float | None
    tokens_per_s: float | None
    error_rel: float | None


@dataclass(frozen=True)
class ProjectionWrite(_Projection):
    at: dt.datetime


@dataclass(frozen=True)
class ProjectionRow(_Projection):
    latest_step_s: float
    requests: int
    first_at: dt.datetime
    last_at: dt.datetime


def device_runs(engine: Engine, device_type: str | None, *, limit: int = 200) -> list[tuple[int, str]]:
    """(id, owner_key) of the newest runs on ``device_type`` (nulls match nulls) that recorded collectives."""
    with engine.connect() as c:
        rows = c.execute(text("SELECT id, owner_key FROM runs WHERE device_type IS NOT DISTINCT FROM :d "
                              "AND collective_records > 0 ORDER BY id DESC LIMIT :k"),
                         {"d": device_type, "k": limit}).fetchall()
    return [(int(i), str(o or "")) for i, o in rows]


def fleet_collectives(engine: Engine, run_ids: Sequence[int]) -> list[FleetCollective]:
    """The collective rollups of these runs with bytes and time (barriers and empty records left out)."""
    if not run_ids:
        return []
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT run_id, op, group_size, sum(bytes), sum(calls), sum(total_s) FROM run_collectives "
            "WHERE run_id = ANY(:ids) AND bytes > 0 AND total_s > 0 AND calls > 0 "
            "GROUP BY run_id, op, group_size, size_bucket"), {"ids": [int(i) for i in run_ids]}).fetchall()
    return [FleetCollective(int(r), COLLECTIVE_OPS[op] if 0 <= op < len(COLLECTIVE_OPS) else "other", int(n),
                            float(b), float(k), float(t)) for r, op, n, b, k, t in rows]


_COLS = ("run_id, world_size, tp, pp, micro_batches, bucket_bytes, hold_global_batch, owner_key, model_family, "
         "signature, device_type, from_world_size, from_tp, from_pp, step_s, mfu, tokens_per_s, error_rel")


def record(engine: Engine, p: ProjectionWrite) -> None:
    """Record a projection: the first figures of a run × layout are kept (the blind projection the track
    record checks); the latest step, the time and the request count are updated."""
    names = [c.strip() for c in _COLS.split(",")]
    vals = {n: getattr(p, n) for n in names}
    with engine.begin() as c:
        c.execute(text(
            f"INSERT INTO run_projections ({_COLS}, latest_step_s, requests, first_at, last_at) VALUES ("
            + ", ".join(f":{n}" for n in names) + ", :step_s, 1, :at, :at) "
            "ON CONFLICT (run_id, world_size, tp, pp, micro_batches, bucket_bytes, hold_global_batch) DO UPDATE SET "
            "latest_step_s = excluded.latest_step_s, last_at = excluded.last_at, "
            "requests = run_projections.requests + 1"), {**vals, "at": p.at})


def family_projections(engine: Engine, family: str, *, owners: Sequence[str] | None = None,
                       limit: int = 5000) -> list[ProjectionRow]:
    """The projections recorded for runs of ``family`` (of the ``owners`` namespaces when given), oldest first."""
    own = "" if owners is None else " AND owner_key = ANY(:o)"
    params: dict[str, Any] = {"f": family, "k": limit}
    if owners is not None:
        params["o"] = sorted(owners)
    with engine.connect() as c:
        rows = c.execute(text(
            f"SELECT {_COLS}, latest_step_s, requests, first_at, last_at FROM run_projections "
            f"WHERE model_family = :f{own} ORDER BY first_at, run_id LIMIT :k"), params).fetchall()
    return [ProjectionRow(*r) for r in rows]
