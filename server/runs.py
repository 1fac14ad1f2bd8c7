"""Run registration and lifecycle (write side)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine, text

__all__ = ["RunRegistration", "register_run", "finish_run", "config_signature", "RUN_STATUSES"]

RUN_STATUSES = ("running", "finished", "failed", "aborted")


class RunRegistration(BaseModel):
    """Body of ``POST /api/v1/runs``: idempotent by ``name`` (every rank of a job sends it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    model_family: str | None = Field(default=None, max_length=128)
    config: dict[str, Any] = Field(default_factory=dict)
    world_size: int = Field(default=1, ge=1, le=1_000_000)
    mp_size: int | None = Field(default=None, ge=1, description="TP×PP ranks per data-parallel replica")
    device_type: str | None = Field(default=None, max_length=64)
    device_count: int | None = Field(default=None, ge=0)
    peak_flops: float | None = Field(default=None, gt=0, description="peak dense FLOP/s per device")
    git_commit: str | None = Field(default=None, max_length=64)
    started_at: float | None = Field(default=None, ge=0, le=1e11, description="unix time the job started")
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("peak_flops", "started_at")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class RunFinish(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: str = Field(default="finished", pattern="^(finished|failed|aborted)$")
    finished_at: float | None = Field(default=None, ge=0, le=1e11, description="unix time the run ended (default: now)")

    @field_validator("finished_at")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v


def config_signature(config: dict[str, Any]) -> str:
    """Stable hash of a run's config: runs with equal signatures are comparable baselines."""
    volatile = {"seed", "run_name", "output_dir", "timestamp"}
    canon = json.dumps({k: v for k, v in config.items() if k not in volatile}, sort_keys=True, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _mp_size(reg: RunRegistration) -> int:
    if reg.mp_size:
        return reg.mp_size
    c = reg.config
    tp = c.get("tp") or c.get("tensor_parallel") or 1
    pp = c.get("pp") or c.get("pipeline_parallel") or 1
    try:
        return max(1, int(tp) * int(pp))
    except (TypeError, ValueError):
        return 1


def register_run(engine: Engine, reg: RunRegistration) -> dict[str, Any]:
    """Create the run or return the existing one of that name (missing fields are filled in)."""
    params = {
        "name": reg.name,
        "family": reg.model_family,
        "config": json.dumps(reg.config, allow_nan=False),
        "sig": config_signature(reg.config),
        "ws": reg.world_size,
        "mp": _mp_size(reg),
        "dt": reg.device_type,
        "dc": reg.device_count,
        "peak": reg.peak_flops,
        "git": reg.git_commit,
        "meta": json.dumps(reg.meta, allow_nan=False, default=str),
        "started": reg.started_at,
    }
    with engine.begin() as c:
        row = c.execute(
            text(
                """
                INSERT INTO runs (name, model_family, config, config_signature, world_size, mp_size, device_type,
                                  device_count, peak_flops, git_commit, meta, started_at, status, last_seen_at)
                VALUES (:name, :family, CAST(:config AS jsonb), :sig, :ws, :mp, :dt, :dc, :peak, :git,
                        CAST(:meta AS jsonb), coalesce(to_timestamp(:started), now()), 'running', now())
                ON CONFLICT (name) DO UPDATE SET
                    model_family = coalesce(runs.model_family, excluded.model_family),
                    config = CASE WHEN runs.config = '{}'::jsonb THEN excluded.config ELSE runs.config END,
                    config_signature = CASE WHEN runs.config = '{}'::jsonb THEN excluded.config_signature
                                            ELSE runs.config_signature END,
                    world_size = greatest(runs.world_size, excluded.world_size),
                    device_type = coalesce(runs.device_type, excluded.device_type),
                    device_count = coalesce(runs.device_count, excluded.device_count),
                    peak_flops = coalesce(runs.peak_flops, excluded.peak_flops),
                    git_commit = coalesce(runs.git_commit, excluded.git_commit),
                    meta = excluded.meta || runs.meta,
                    status = 'running',
                    finished_at = NULL,
                    last_seen_at = now()
                RETURNING id, name, world_size, (xmax = 0) AS created
                """
            ),
            params,
        ).one()
    return {"id": row.id, "name": row.name, "world_size": row.world_size, "created": bool(row.created)}


def finish_run(engine: Engine, run_id: int, status: str = "finished", finished_at: float | None = None) -> bool:
    """Mark a run ended (at ``finished_at``, unix time, or now); False when there is no such run."""
    if status not in RUN_STATUSES[1:]:
        raise ValueError(f"status must be one of {RUN_STATUSES[1:]}, got {status!r}")
    with engine.begin() as c:
        r = c.execute(
            text("UPDATE runs SET status = :s, finished_at = coalesce(to_timestamp(CAST(:at AS float8)), now()) "
                 "WHERE id = :id"),
            {"s": status, "id": run_id, "at": finished_at},
        )
    return r.rowcount > 0
