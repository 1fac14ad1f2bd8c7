"""The steady-state basis of a run (docs/metrics.md "Steady-state basis"): which steps every figure of
the run summary is computed on, and which are set apart, why, and how much time they took.

A run's first steps pay for allocations, the caching allocator's growth, cuDNN autotuning and the data
loader's workers starting; a compiled model pays for its compilation inside the steps that compiled;
checkpoints and evals run inside a step when the job calls them there. Summing such steps with the
others lets two compile steps (8.1 s + 3.4 s) outweigh hundreds of ordinary ones, so shares, KPIs and
the diagnosis would describe the compiler instead of the job. The rule, in order:

1. **Marked steps** — a step in which the job reported a ``compile`` event is set apart as "compile";
   a ``checkpoint`` / ``checkpoint_save`` / ``checkpoint_load`` event as "checkpoint"; an ``eval`` /
   ``evaluation`` event as "eval"; the first step after each ``restart`` event as "warm-up". An event
   names its step (the step in progress, else the next one); an event without a step falls on the step
   whose time span holds its timestamp (a restart: the first step that starts after it).
2. **Warm-up** — the run's first steps, and those right after a restart's first step, while each is
   still slow: step time above ``WARMUP_FACTOR`` × the median and above median + ``MAD_K`` · σ (σ =
   1.4826 · MAD; median and MAD over the steps not set apart by 1.), up to ``MAX_WARMUP_SHARE`` of the
   run. A first step at the steady pace is kept.
3. **Outliers** — of the steps left, one whose step time exceeds max(``OUTLIER_FACTOR`` × median,
   median + ``MAD_K`` · σ) is an outlier — provided such steps are rare: at most
   ``MAX_OUTLIER_SHARE`` of the steps (at least one). Slow steps that recur more often are part of the
   job's steady state (a loader that stalls every fourth step) and stay in.

Nothing is set apart from a run of fewer than ``MIN_STEPS`` steps. Step time is the step's cross-rank
median (the ``steps`` rollup). When the rule would set apart more
than ``MAX_SET_APART_SHARE`` of the steps (a job that recompiles every step) there is no steady state to
speak of and every step is kept; the basis says so. Set-apart time is never dropped: its seconds are
reported per reason, and :func:`set_apart_excess` gives the goodput accounting what those steps took
beyond a steady step.

Pure: arrays and event tuples in, a :class:`SteadyBasis` out (no SQL, no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "SteadyBasis",
    "steady_basis",
    "set_apart_excess",
    "MARK_KINDS",
    "REASONS",
    "RULE",
    "MIN_STEPS",
    "WARMUP_FACTOR",
    "OUTLIER_FACTOR",
    "MAD_K",
    "MAX_OUTLIER_SHARE",
    "MAX_WARMUP_SHARE",
    "MAX_SET_APART_SHARE",
    "MAX_LISTED_STEPS",
]

#: event kind -> the reason its step is set apart ("restart": the first step after it is warm-up)
MARK_KINDS: dict[str, str] = {
    "compile": "compile",
    "checkpoint": "checkpoint", "checkpoint_save": "checkpoint", "checkpoint_load": "checkpoint",
    "eval": "eval", "evaluation": "eval",
    "restart": "warm-up",
}
#: reasons in the order they take precedence (a step that compiled in the first step is "compile")
REASONS: tuple[str, ...] = ("compile", "checkpoint", "eval", "warm-up", "outlier")

MIN_STEPS = 3  # below it nothing is set apart: there is no steady state to compare with
WARMUP_FACTOR = 1.5
OUTLIER_FACTOR = 3.0
MAD_K = 5.0
MAX_OUTLIER_SHARE = 0.05
MAX_WARMUP_SHARE = 0.25
MAX_SET_APART_SHARE = 0.5
MAX_LISTED_STEPS = 100  # step numbers listed per reason (``n`` counts them all)
_SIGMA_PER_MAD = 1.4826  # MAD → standard deviation of a normal distribution

RULE = (f"set apart: steps with a compile, checkpoint or eval event; the first step after a restart (warm-up); the "
        f"first steps of the run and after a restart while above {WARMUP_FACTOR:g}× the median step time (warm-up); then steps "
        f"above max({OUTLIER_FACTOR:g}× median, median + {MAD_K:g}·1.4826·MAD) when at most "
        f"{MAX_OUTLIER_SHARE:.0%} of the steps are (outliers). Step time: the cross-rank median.")

Event = tuple[str, float | None, int | None, Mapping[str, Any] | None]


@dataclass(frozen=True)
class SteadyBasis:
    """The steps a run's figures are computed on. ``kept``: step numbers of the basis, ascending;
    ``set_apart``: {reason: (step numbers, seconds of step time)}; ``fallback``: why every step was
    kept although some were marked (None otherwise)."""

    kept: np.ndarray
    of: int
    set_apart: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    fallback: str | None = None

    @property
    def excluded(self) -> list[int]:
        """Every set-apart step number, ascending."""
        return sorted(s for steps, _ in self.set_apart.values() for s in steps)

    @property
    def reason_of(self) -> dict[int, str]:
        """{step: reason} of the set-apart steps."""
        return {s: r for r, (steps, _) in self.set_apart.items() for s in steps}

    def as_dict(self) -> dict[str, Any]:
        """The summary's ``basis``: ``{"steps", "of", "set_apart": [{"reason", "steps", "n", "seconds"}],
        "rule", "fallback"}`` (at most ``MAX_LISTED_STEPS`` step numbers listed per reason)."""
        return {
            "steps": int(self.kept.size),
            "of": int(self.of),
            "set_apart": [{"reason": r, "steps": list(self.set_apart[r][0][:MAX_LISTED_STEPS]),
                           "n": len(self.set_apart[r][0]), "seconds": self.set_apart[r][1]}
                          for r in REASONS if r in self.set_apart],
            "rule": RULE,
            "fallback": self.fallback,
        }


def _median_mad(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan, math.nan
    m = float(np.median(x))
    return m, float(np.median(np.abs(x - m)))


def _step_at(steps: np.ndarray, ts: np.ndarray | None, step_s: np.ndarray, kind: str, ev_ts: float | None,
             ev_step: int | None, index: Mapping[int, int]) -> int | None:
    """Position of the step an event falls on (None: none)."""
    if kind == "restart":
        if ev_step is not None:
            after = np.nonzero(steps >= ev_step)[0]
            return int(after[0]) if after.size else None
        if ev_ts is not None and ts is not None:
            after = np.nonzero(np.isfinite(ts) & (ts >= ev_ts))[0]
            return int(after[0]) if after.size else None
        return None
    if ev_step is not None:
        return index.get(int(ev_step))
    if ev_ts is not None and ts is not None:
        end = ts + np.nan_to_num(step_s)
        hit = np.nonzero(np.isfinite(ts) & (ts <= ev_ts) & (ev_ts < end))[0]
        return int(hit[0]) if hit.size else None
    return None


def steady_basis(steps: np.ndarray, step_s: np.ndarray, *, ts: np.ndarray | None = None,
                 events: Iterable[Event] = ()) -> SteadyBasis:
    """The steady-state basis of a run from its steps (step numbers, cross-rank median step time and
    start times, in step order) and the job's events ``(kind, ts, step, data)`` (module docstring)."""
    steps = np.asarray(steps, dtype=np.int64)
    step_s = np.asarray(step_s, dtype=np.float64)
    n = int(steps.size)
    if n < MIN_STEPS:
        return SteadyBasis(kept=steps.copy(), of=n)
    ts_arr = np.asarray(ts, dtype=np.float64) if ts is not None else None
    index = {int(s): i for i, s in enumerate(steps.tolist())}
    reason: list[str | None] = [None] * n
    rank = {r: i for i, r in enumerate(REASONS)}

    def mark(i: int, why: str) -> None:
        cur = reason[i]
        if cur is None or rank[why] < rank[cur]:
            reason[i] = why

    warm_starts = [-1]  # the run's first step is warm-up only while slow
    for kind, ev_ts, ev_step, _data in events:
        why = MARK_KINDS.get(kind)
        if why is None:
            continue
        i = _step_at(steps, ts_arr, step_s, kind, ev_ts, ev_step, index)
        if i is None:
            continue
        mark(i, why)
        if kind == "restart":
            warm_starts.append(i)

    rest = np.array([r is None for r in reason]) & np.isfinite(step_s)
    med, mad = _median_mad(step_s[rest])
    if math.isfinite(med) and med > 0:
        sigma = _SIGMA_PER_MAD * mad
        # 2. warm-up: the slow steps right after each warm-up start
        warm_cut = max(WARMUP_FACTOR * med, med + MAD_K * sigma)
        budget = max(1, int(MAX_WARMUP_SHARE * n))
        for start in sorted(set(warm_starts)):
            j = start + 1
            while j < n and budget > 0:  # steps marked by an event (a compile) are part of the warm-up run
                if reason[j] is None:
                    if not (np.isfinite(step_s[j]) and step_s[j] > warm_cut):
                        break
                    mark(j, "warm-up")
                    budget -= 1
                j += 1
        # 3. rare outliers among what is left
        cut = max(OUTLIER_FACTOR * med, med + MAD_K * sigma)
        cand = [i for i in range(n) if reason[i] is None and np.isfinite(step_s[i]) and step_s[i] > cut]
        if len(cand) <= max(1, math.ceil(MAX_OUTLIER_SHARE * n)):
            for i in cand:
                mark(i, "outlier")

    out_idx = [i for i in range(n) if reason[i] is not None]
    if len(out_idx) > MAX_SET_APART_SHARE * n:
        return SteadyBasis(kept=steps.copy(), of=n, fallback=(
            f"{len(out_idx)} of {n} steps are marked (compile, checkpoint, eval, warm-up or outliers): more than "
            f"{MAX_SET_APART_SHARE:.0%}, so there is no steady state to set them apart from; every step is counted"))
    by_reason: dict[str, tuple[tuple[int, ...], float]] = {}
    for r in REASONS:
        idx = [i for i in out_idx if reason[i] == r]
        if idx:
            by_reason[r] = (tuple(int(steps[i]) for i in idx), float(np.nansum(step_s[idx])))
    keep = np.array([r is None for r in reason])
    return SteadyBasis(kept=steps[keep], of=n, set_apart=by_reason)


def set_apart_excess(basis: SteadyBasis, steps: np.ndarray, step_s: np.ndarray,
                     data_s: np.ndarray) -> dict[str, float]:
    """{reason: seconds} the set-apart steps spent beyond a steady step, outside their data wait:
    Σ max((step_s − data_s) − steady median of (step_s − data_s), 0) per reason. What goodput moves
    from productive time to lost time ("compile", and "warm-up" with "outlier" together as
    "warmup_outlier"). Checkpoint and eval steps are left out: their events' durations are already
    lost time."""
    if not basis.set_apart:
        return {}
    steps = np.asarray(steps, dtype=np.int64)
    work = np.asarray(step_s, dtype=np.float64) - np.nan_to_num(np.asarray(data_s, dtype=np.float64))
    kept = np.isin(steps, basis.kept)
    base = work[kept & np.isfinite(work)]
    ref = float(np.median(base)) if base.size else 0.0
    out: dict[str, float] = {}
    for r, (st, _sec) in basis.set_apart.items():
        if r in ("checkpoint", "eval"):
            continue
        w = work[np.isin(steps, np.asarray(st, dtype=np.int64))]
        key = "compile" if r == "compile" else "warmup_outlier"
        out[key] = out.get(key, 0.0) + float(np.sum(np.maximum(np.nan_to_num(w) - ref, 0.0)))
    return out

