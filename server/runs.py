"""Run registration and lifecycle (write side)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Engine

from .jsonsafe import MAX_DEPTH, valid_json, valid_text
from .store import runs as run_store

__all__ = ["RunRegistration", "register_run", "finish_run", "delete_run", "NotOwner", "config_signature",
           "RUN_STATUSES", "MAX_WORLD_SIZE"]

RUN_STATUSES = ("running", "finished", "failed", "aborted")
#: the largest world size a run may declare (a fleet of product scale is 4,096-16,384 ranks)
MAX_WORLD_SIZE = 262_144


class RunRegistration(BaseModel):
    """Body of ``POST /api/v1/runs``: idempotent by ``name`` (every rank of a job sends it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    model_family: str | None = Field(default=None, max_length=128)
    config: dict[str, Any] = Field(default_factory=dict, description=f"at most {MAX_DEPTH} levels deep")
    world_size: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE, strict=True)
    mp_size: int | None = Field(default=None, ge=1, le=MAX_WORLD_SIZE, strict=True,
                                description="TP×PP ranks per data-parallel replica")
    device_type: str | None = Field(default=None, max_length=64)
    device_count: int | None = Field(default=None, ge=0, le=1_000_000, strict=True)
    peak_flops: float | None = Field(default=None, gt=0, le=1e21, description="peak dense FLOP/s per device")
    git_commit: str | None = Field(default=None, max_length=64)
    started_at: float | None = Field(default=None, ge=0, le=1e11, description="unix time the job started")
    meta: dict[str, Any] = Field(default_factory=dict, description=f"at most {MAX_DEPTH} levels deep")
    job_id: str | None = Field(default=None, min_length=1, max_length=128,
                               description="the job this run is an attempt of (launcher / torchrun / SLURM id)")
    attempt: int = Field(default=0, ge=0, le=10_000, strict=True,
                         description="0 = the job's first attempt, k = its k-th restart: a run of its own")

    @field_validator("peak_flops", "started_at", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if v is not None and type(v) not in (int, float):  # strict: no "1e15" or true
            raise ValueError(f"must be a number, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("name", "model_family", "device_type", "git_commit", "job_id")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        return valid_text(v)

    @field_validator("config", "meta")
    @classmethod
    def _json(cls, v: dict[str, Any]) -> dict[str, Any]:
        return valid_json(v)


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


def register_run(engine: Engine, reg: RunRegistration, *, owner_token_id: int | None = None,
                 owner_key: str = "") -> dict[str, Any]:
    """Create the run or join the existing one of that name in the caller's namespace (``owner_key``,
    :attr:`Principal.owner_key`: its team, else its token; '' without auth). Joining fills in fields,
    may raise the world size, reopens the run and merges meta; a name that another owner holds gives
    the caller a run of its own and never touches the other's."""
    return run_store.upsert_run(
        engine, name=reg.name, family=reg.model_family, config_json=json.dumps(reg.config, allow_nan=False),
        signature=config_signature(reg.config), world_size=reg.world_size, mp_size=_mp_size(reg),
        device_type=reg.device_type, device_count=reg.device_count, peak_flops=reg.peak_flops, git_commit=reg.git_commit,
        meta_json=json.dumps(reg.meta, allow_nan=False, default=str), started_at=reg.started_at,
        owner_token_id=owner_token_id, owner_key=owner_key, job_id=reg.job_id, attempt=reg.attempt,
    )


class NotOwner(PermissionError):
    """A token that neither owns the run nor is admin tried to change it."""


def finish_run(engine: Engine, run_id: int, status: str = "finished", finished_at: float | None = None, *,
               owner_key: str = "", admin: bool = True) -> bool:
    """Mark a run ended (at ``finished_at``, unix time, or now); False when there is no such run.
    Raises ``NotOwner`` when a non-admin caller (namespace ``owner_key``) finishes another owner's run
    (a run without owner, '', may be finished by any ingest token)."""
    if status not in RUN_STATUSES[1:]:
        raise ValueError(f"status must be one of {RUN_STATUSES[1:]}, got {status!r}")
    if not admin:
        exists, owner = run_store.owner_key_of(engine, run_id)
        if exists and owner and owner != owner_key:
            raise NotOwner(f"run {run_id} belongs to another owner; finishing it needs a token of that owner "
                           "(the same token or team) or an admin token")
    return run_store.finish_run(engine, run_id, status, finished_at)


def delete_run(engine: Engine, run_id: int) -> dict[str, int] | None:
    """Remove a run and everything that hangs off it (admin); rows deleted per table, None if absent."""
    return run_store.delete_run(engine, run_id)
