"""Retention, automated: a policy in the settings, applied by the server in bounded batches.

Three limits, each in days since a run last changed (``None``: keep forever), per model family
overridable (``FLEETSCOPE_RETENTION_OVERRIDES='{"vla-7b": {"blocks_days": 7}}'``):

* ``blocks_days`` — drop the per-rank blocks of the run's steps (rank × step heatmaps, per-rank
  collectives). The per-step rollups, the summary, stragglers and collective totals stay.
* ``rollups_days`` — drop the per-step rows too. The run, its figures (cached in ``run_stats``,
  computed before anything is dropped), straggler rollups and collective totals stay.
* ``runs_days`` — delete the run entirely.

What was removed is recorded in ``runs.thinned`` and shown by the API (``run.thinned``) and the run
page. ``fleetscope retention`` previews a pass (default) or applies it (``--apply``); the server
applies it every ``retention_interval_s`` when any limit is set, at most ``retention_batch_runs``
runs per pass.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from . import reports
from .settings import Settings
from .store import retention as store
from .store import runs as run_store

__all__ = ["Policy", "Action", "policy_for", "plan", "apply", "RetentionWorker"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    blocks_days: float | None = None
    rollups_days: float | None = None
    runs_days: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.blocks_days, self.rollups_days, self.runs_days))

    def youngest(self) -> float | None:
        vals = [v for v in (self.blocks_days, self.rollups_days, self.runs_days) if v is not None]
        return min(vals) if vals else None


@dataclass(frozen=True)
class Action:
    run_id: int
    name: str
    family: str | None
    age_days: float
    action: str  # "blocks" | "rollups" | "delete"

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "name": self.name, "family": self.family,
                "age_days": round(self.age_days, 2), "action": self.action}


def policy_for(settings: Settings, family: str | None) -> Policy:
    base = Policy(settings.retention_blocks_days, settings.retention_rollups_days, settings.retention_runs_days)
    over = (settings.retention_overrides or {}).get(family or "")
    if not over:
        return base
    return Policy(over.get("blocks_days", base.blocks_days), over.get("rollups_days", base.rollups_days),
                  over.get("runs_days", base.runs_days))


def _policies(settings: Settings) -> list[Policy]:
    base = policy_for(settings, None)
    return [base, *(policy_for(settings, f) for f in (settings.retention_overrides or {}))]


def plan(engine: Engine, settings: Settings, *, limit: int | None = None) -> list[Action]:
    """What a pass would do now, oldest runs first: at most one action per run (the strongest due)."""
    ages = [a for a in (p.youngest() for p in _policies(settings)) if a is not None]
    if not ages:
        return []
    out: list[Action] = []
    for run_id, name, family, age, thinned in store.candidates(engine, min(ages)):
        p = policy_for(settings, family)
        done = thinned or {}
        if p.runs_days is not None and age >= p.runs_days:
            act = "delete"
        elif p.rollups_days is not None and age >= p.rollups_days and "rollups" not in done:
            act = "rollups"
        elif p.blocks_days is not None and age >= p.blocks_days and "blocks" not in done and "rollups" not in done:
            act = "blocks"
        else:
            continue
        out.append(Action(run_id, name, family, age, act))
        if limit is not None and len(out) >= limit:
            break
    return out


def apply(engine: Engine, settings: Settings, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Carry out ``plan``: each action in its own bounded transactions; returns what was done."""
    done = []
    for a in plan(engine, settings, limit=limit):
        if a.action == "delete":
            counts = run_store.delete_run(engine, a.run_id) or {}
            reports.forget_run(a.run_id)  # no memory stays cached for a deleted run
            done.append({**a.as_dict(), "rows": sum(counts.values())})
            continue
        run = run_store.get_run(engine, a.run_id, pending=False)
        if run is None:
            continue
        reports.figures(engine, [run])  # the summary's figures, cached in run_stats before rows go
        n = store.thin_blocks(engine, a.run_id) if a.action == "blocks" else store.drop_rollups(engine, a.run_id)
        store.mark_thinned(engine, a.run_id, a.action)
        done.append({**a.as_dict(), "steps": n})
        log.info("retention: %s of run %s (%s, %.1f days old): %d steps", a.action, a.run_id, a.name, a.age_days, n)
    return done


class RetentionWorker:
    """Applies the policy every ``interval_s`` (at most ``batch_runs`` runs a pass) on a thread."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.applied = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetscope-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.retention_interval_s):
            try:
                self.applied += len(apply(self.engine, self.settings, limit=self.settings.retention_batch_runs))
            except Exception:  # noqa: BLE001 - retention must never take the server down
                self.errors += 1
                log.exception("retention pass failed (will retry)")
