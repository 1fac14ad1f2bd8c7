"""Goodput (docs/metrics.md): the share of a run's wall time spent in productive steps.

Wall time runs from the run's start to its end (``finished_at``, else the last step's end).
Productive time is the sum over steps of the median rank's step time minus its data wait. Badput:

- ``init_s``: start of the run to the first step;
- ``checkpoint_s`` / ``eval_s``: ``checkpoint``, ``checkpoint_save``, ``checkpoint_load`` and ``eval``
  run events, each with ``data.duration_s`` (the agent's ``run.event(kind, step, duration_s=...)``);
- ``restart_s``: for each ``restart`` event, the time since the last checkpoint before it completed
  (event ts + duration: the work lost and the downtime); steps run in that span count here, not as
  productive;
- ``data_stall_s``: the median rank's data wait, summed over steps;
- ``compile_steps_s`` / ``warmup_outlier_steps_s``: what the steps set apart from the steady-state
  basis (``analysis.steady``) as compile, warm-up or outlier steps took beyond a steady step, outside
  their data wait (``steady.set_apart_excess``) — moved from productive time, never dropped;
- ``unaccounted_s``: the rest (gaps between steps, host work outside steps).

Events are taken to block training (a synchronous checkpoint); where their durations overlap the
steps (asynchronous checkpointing) the overlap is reported as ``overlap_s`` and not charged twice.

Event-based parts are as good as what the job reports; the result says which parts it had.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..store.rows import StepFrame

__all__ = ["goodput", "with_set_apart", "SET_APART_CATEGORIES", "CHECKPOINT_KINDS", "EVAL_KINDS", "RESTART_KINDS"]

CHECKPOINT_KINDS = ("checkpoint", "checkpoint_save", "checkpoint_load")
EVAL_KINDS = ("eval", "evaluation")
RESTART_KINDS = ("restart",)
#: ``steady.set_apart_excess`` key -> the lost-time category it is reported as
SET_APART_CATEGORIES = {"compile": "compile_steps", "warmup_outlier": "warmup_outlier_steps"}


def _dur(data: dict[str, Any]) -> float:
    v = data.get("duration_s")
    return float(v) if isinstance(v, (int, float)) and v > 0 else 0.0


def goodput(run_id: int, started: float, finished: float | None, steps: StepFrame,
            events: list[tuple[str, float | None, int | None, dict[str, Any] | None]],
            set_apart_s: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Goodput and badput breakdown of a run from its start/end (unix times), its steps (frame columns
    ``ts``, ``step_s``, ``data_s``), the job's events (kind, ts, step, data) in time order and the
    set-apart steps' excess time (``steady.set_apart_excess``)."""
    ev = events
    out: dict[str, Any] = {"run_id": run_id, "goodput": None, "wall_s": None, "productive_s": None,
                           "badput": {}, "events": {}, "estimated": True}
    if not len(steps):
        return out
    ts = steps["ts"]
    step_s = np.nan_to_num(steps["step_s"])
    data_s = np.nan_to_num(steps["data_s"])
    have_ts = np.isfinite(ts)
    first_ts = float(ts[have_ts].min()) if have_ts.any() else started
    last_end = float(np.nanmax(ts + step_s)) if have_ts.any() else started + float(step_s.sum())
    end = finished if finished is not None and finished >= last_end else last_end
    start = min(started, first_ts)
    wall = max(end - start, float(step_s.sum()))
    ckpt = sum(_dur(d or {}) for k, _, _, d in ev if k in CHECKPOINT_KINDS)
    evl = sum(_dur(d or {}) for k, _, _, d in ev if k in EVAL_KINDS)
    restart = 0.0
    lost_steps = np.zeros(len(ts), dtype=bool)
    ckpt_ts = [t + _dur(d or {}) for k, t, _, d in ev if k in CHECKPOINT_KINDS and t is not None]
    for k, t, _, _ in ev:
        if k in RESTART_KINDS and t is not None:
            prev = max([c for c in ckpt_ts if c <= t], default=first_ts)
            restart += max(t - prev, 0.0)
            lost_steps |= have_ts & (ts >= prev) & (ts < t)
    productive = float(np.sum((step_s - data_s)[~lost_steps]))
    data_stall = float(np.sum(data_s[~lost_steps]))
    init = max(first_ts - start, 0.0)
    badput = {"init_s": init, "checkpoint_s": ckpt, "eval_s": evl, "restart_s": restart, "data_stall_s": data_stall}
    for key, cat in SET_APART_CATEGORIES.items():
        moved = min(max(float((set_apart_s or {}).get(key, 0.0)), 0.0), productive)
        badput[f"{cat}_s"] = moved
        productive -= moved
    rest = wall - productive - sum(badput.values())
    badput["unaccounted_s"] = max(rest, 0.0)
    out.update(
        goodput=productive / wall if wall > 0 else None,
        wall_s=wall,
        productive_s=productive,
        badput=badput,
        overlap_s=max(-rest, 0.0),
        badput_share={k: (v / wall if wall > 0 else None) for k, v in badput.items()},
        events={k: sum(1 for e in ev if e[0] in kinds) for k, kinds in
                (("checkpoint", CHECKPOINT_KINDS), ("eval", EVAL_KINDS), ("restart", RESTART_KINDS))},
        estimated=not ev,
    )
    return out


def with_set_apart(g: dict[str, Any] | None, excess: Mapping[str, float]) -> dict[str, Any] | None:
    """The summary's goodput (``{"wall_s", "productive_s", "fraction", "lost": {category: s}}``) with the
    set-apart steps' excess time (``steady.set_apart_excess``) moved from productive to ``lost`` as
    ``compile_steps`` and ``warmup_outlier_steps`` (0 when none); wall time is unchanged."""
    if g is None:
        return None
    out = dict(g)
    lost = dict(out.get("lost") or {})
    productive = float(out.get("productive_s") or 0.0)
    for key, cat in SET_APART_CATEGORIES.items():
        moved = min(max(float(excess.get(key, 0.0)), 0.0), productive)
        lost[cat] = lost.get(cat, 0.0) + moved
        productive -= moved
    wall = out.get("wall_s")
    out.update(productive_s=productive, lost=lost,
               fraction=productive / wall if isinstance(wall, (int, float)) and wall > 0 else out.get("fraction"))
    return out
