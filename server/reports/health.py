"""Run health for the API and the pages: ``GET /runs/{id}/health`` (state, finding, wavefront, failures,
attempts, the open pause) and the summary's ``goodput`` (per run and per job).

Both are bounded whatever the world size: the wavefront is computed in SQL (``store.health.wave_summary``:
counts, the first ``MAX_HEALTH_RANKS_LISTED`` ranks and nodes with their totals, the stacks of the first
``MAX_HEALTH_STACKS`` missing ranks), and goodput needs no wavefront at all (stalled or hung: the same
lost time), so it never computes one."""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
from sqlalchemy import Engine

from ..analysis.goodput import CHECKPOINT_KINDS, EVAL_KINDS
from ..analysis.health import HealthParams, goodput_split, pause_category, rank_ranges
from ..health_pass import assess, params_from
from ..limits import MAX_HEALTH_RANKS_LISTED, MAX_HEALTH_STACKS
from ..store import events as event_store
from ..store import health as store
from ..store import steps as step_store

# ``params_from`` and ``rank_ranges`` are passed on for the pages, which read only through this façade
__all__ = ["run_health", "run_goodput", "job_attempts", "fleet_health", "fleet_goodput", "params_from", "rank_ranges"]


def _iso(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(float(t), dt.timezone.utc).isoformat()


def job_attempts(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """The attempts of the run's job in order, each with ``redone_steps`` (its steps whose index is ≤ the
    previous attempt's last step: work redone after the restore) and ``gap_s`` (time since the previous
    attempt ended)."""
    rows = store.attempts(engine, run_id)
    out = []
    prev: dict[str, Any] | None = None
    for a in rows:
        redone = 0
        if prev is not None and prev["last_step"] is not None and a["steps"]:
            redone = store.steps_at_or_below(engine, a["run_id"], int(prev["last_step"]))[0]
        gap = None
        if prev is not None and prev["ended_at"] is not None and a["started_at"] is not None:
            gap = max(float(a["started_at"]) - float(prev["ended_at"]), 0.0)
        out.append({"run_id": a["run_id"], "attempt": a["attempt"], "job_id": a["job_id"],
                    "started_at": _iso(a["started_at"]), "ended_at": _iso(a["ended_at"]) if a["finished"] else None,
                    "last_seen_at": _iso(a["ended_at"]), "status": a["status"], "steps": a["steps"],
                    "first_step": a["first_step"], "last_step": a["last_step"], "redone_steps": redone, "gap_s": gap})
        prev = a
    return out


def run_health(engine: Engine, run_id: int, params: HealthParams) -> dict[str, Any] | None:
    """The run's health now (docs/api.md ``/health``); None for no such run."""
    rps = store.progress(engine, [run_id], active_only=False)
    if not rps:
        return None
    a = assess(engine, rps[0], params, full=True)
    v = a.verdict
    fails = a.failures or (store.failures(engine, run_id) if a.n_failures else [])
    n_fail, n_failed_ranks = store.failure_count(engine, run_id) if a.n_failures else (0, 0)
    attempts = job_attempts(engine, run_id)
    return {
        "run_id": run_id,
        "state": v.state,
        "since": _iso(v.since),
        "finding": v.finding,
        "cause": v.cause,
        "lost_nodes": v.lost_nodes,
        "settling": v.settle_until is not None,
        "waiting": v.waiting,
        "missing_ranks": v.missing_ranks,
        "missing_count": v.missing_count,
        "missing_nodes": v.missing_nodes,
        "missing_nodes_count": v.missing_nodes_count,
        "collective": v.collective,
        "stacks": v.stacks,
        "stuck": v.stuck,
        "failures": [f.as_dict() for f in fails],
        "failures_count": n_fail,
        "failed_ranks": n_failed_ranks,
        "attempts": attempts,
        "pause": v.pause,
        "threshold_s": v.threshold_s,
        "hang_s": a.hang_s,
        "limits": {"ranks_listed": MAX_HEALTH_RANKS_LISTED, "stacks": MAX_HEALTH_STACKS},
    }


def _run_goodput(engine: Engine, run_id: int, params: HealthParams, prev_last_step: int | None) -> dict[str, Any] | None:
    rps = store.progress(engine, [run_id], active_only=False)
    if not rps:
        return None
    rp = rps[0]
    a = assess(engine, rp, params, full=True, wavefront=False)  # stalled or hung: the same lost time
    frame = step_store.load_steps(engine, run_id, ("step", "ts", "step_s", "data_s"))
    start = rp.started_at
    if len(frame):
        step_idx = frame["step"]
        ts = frame["ts"]
        step_s = np.nan_to_num(frame["step_s"])
        data_s = np.nan_to_num(frame["data_s"])
        have = np.isfinite(ts)
        first_ts = float(ts[have].min()) if have.any() else start
        last_end = float(np.nanmax(ts + step_s)) if have.any() else start + float(step_s.sum())
        redone_mask = step_idx <= prev_last_step if prev_last_step is not None else np.zeros(len(step_idx), bool)
        redone_s = float(step_s[redone_mask].sum())
        total_step_s = float(step_s.sum())
        total_data_s = float(data_s[~redone_mask].sum())
    else:
        first_ts, last_end, redone_s, total_step_s, total_data_s = None, start, 0.0, 0.0, 0.0
    start = min(start, first_ts) if first_ts is not None else start
    if rp.finished_at is not None:
        end = max(rp.finished_at, last_end)
    elif a.verdict.state in ("stalled", "hung"):
        end = max(rp.now, last_end)
    else:
        end = last_end
    init_s = (first_ts - start) if first_ts is not None else None
    pause_s = dict(store.pause_totals(engine, [run_id]).get(run_id, {}))
    cats = {pause_category(r) for r in pause_s}
    for kind, _ts, _step, data in event_store.job_events(engine, run_id, (*CHECKPOINT_KINDS, *EVAL_KINDS)):
        cat = "checkpoint" if kind in CHECKPOINT_KINDS else "eval"
        d = (data or {}).get("duration_s")
        if cat not in cats and isinstance(d, (int, float)) and d > 0:
            pause_s[f"{cat}_event"] = pause_s.get(f"{cat}_event", 0.0) + float(d)
    failure_s = 0.0
    root = a.failures[0] if a.failures else None
    if root is None and a.n_failures:
        fl = store.failures(engine, run_id, limit=1)
        root = fl[0] if fl else None
    if root is not None and root.ts is not None:
        failure_s = max(end - float(root.ts), 0.0)
    hang_s = min(a.hang_s, max(end - start, 0.0))
    if init_s is None:  # no step yet: the time not spent hanging or failed went to initialisation
        init_s = max(end - start - hang_s - failure_s, 0.0)
    out = goodput_split(wall_s=max(end - start, 0.0), step_s=total_step_s, data_s=total_data_s, init_s=init_s,
                        pause_s=pause_s, hang_s=hang_s, failure_s=failure_s, redone_s=redone_s)
    out["run_id"] = run_id
    out["start"] = start
    out["end"] = end
    return out


def run_goodput(engine: Engine, run_id: int, params: HealthParams | None = None) -> dict[str, Any] | None:
    """``summary.goodput``: ``{"wall_s", "productive_s", "fraction", "lost": {category: s}, "job": {...}}``
    (docs/metrics.md "Goodput"); ``job`` sums the attempts of the run's job (the time between attempts
    counted as ``restart``), present when the job has more than one attempt."""
    params = params or HealthParams()
    attempts = store.attempts(engine, run_id)
    prev_last: int | None = None
    per: dict[int, dict[str, Any]] = {}
    for at in attempts:
        g = _run_goodput(engine, at["run_id"], params, prev_last)
        if g is not None:
            per[at["run_id"]] = g
        if at["last_step"] is not None:
            prev_last = max(prev_last or 0, int(at["last_step"]))
    mine = per.get(run_id) or _run_goodput(engine, run_id, params, None)
    if mine is None:
        return None
    out = {k: mine[k] for k in ("wall_s", "productive_s", "fraction", "lost")}
    if len(per) > 1:
        gs = [per[a["run_id"]] for a in attempts if a["run_id"] in per]
        lost: dict[str, float] = {}
        for g in gs:
            for k, s in g["lost"].items():
                lost[k] = lost.get(k, 0.0) + s
        restart = sum(max(b["start"] - a["end"], 0.0) for a, b in zip(gs, gs[1:], strict=False))
        lost["restart"] = restart
        productive = sum(g["productive_s"] for g in gs)
        wall = sum(g["wall_s"] for g in gs) + restart
        out["job"] = {"attempts": len(gs), "wall_s": wall, "productive_s": productive,
                      "fraction": productive / wall if wall > 0 else None, "lost": lost}
    return out


def fleet_health(engine: Engine, run_ids: list[int]) -> dict[int, dict[str, Any]]:
    """{run: {"state", "finding", "since"}} from the health pass's last conclusions (the fleet page)."""
    return {rid: {"state": st, "finding": f, "since": _iso(since)}
            for rid, (st, since, f) in store.health_rows(engine, run_ids).items()}


def fleet_goodput(engine: Engine, days: int = 14) -> list[dict[str, Any]]:
    """Fleet goodput over time: per day (UTC) of the runs started in the last ``days`` days, the median
    rank's productive step time (``step_s − data_s``) summed over their steps, over their wall time
    (start to finish, else to the last time seen). Redone steps and declared pauses are not separated
    here (the per-run ``summary.goodput`` does); one query."""
    rows = store.fleet_goodput_rows(engine, days)
    return [{"day": d.date().isoformat(), "runs": int(n), "productive_s": float(prod), "wall_s": float(wall),
             "fraction": (float(prod) / float(wall)) if wall else None} for d, n, prod, wall in rows]
