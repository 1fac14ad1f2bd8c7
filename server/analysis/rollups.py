"""Straggler rollups maintained at compaction: one row per (run, rank) and per (run, rank, window).

Registered as a ``Compactor.folds`` hook, so it runs in the compaction transaction over the
deduplicated rows of the steps that pass touched; it reads and writes through a :class:`RollupSink`
(``store.compaction.RollupWriter``), so everything here is numpy. A step compacted again (a late rank, a retry)
is handled exactly: the contribution of its previously folded rows (``is_old``) is subtracted and
the contribution of all its rows added, so the rollups always equal a fold over the final blocks.

Why rollups: the straggler slowdown is a median over steps of a per-step ratio; recomputing it for
1,024 ranks × 5,000 steps means decoding 5 M rank-steps (~1 s), over the summary's 300 ms budget.
The median is kept exact enough by a histogram of log-ratios (1 % bins); the threshold decision
("median above 1.05") is exact, from counts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from ..grouped import grouped_argmax, grouped_medians, unique_rows

__all__ = [
    "RollupSink",
    "fold_rank_rollups",
    "THRESHOLD",
    "WINDOW_STEPS",
    "HIST_LO",
    "HIST_BW",
    "HIST_NB",
    "hist_median",
    "hist_medians",
    "work_ratio_stats",
    "ROLLUP_SUMS",
    "WINDOW_SUMS",
]

THRESHOLD = 1.05  # docs/metrics.md: default straggler threshold on the work ratio
WINDOW_STEPS = 100  # steps per window for persistence (a few minutes at 1 step/s)
HIST_LO = -0.2  # ln ratio of the first bin's lower edge (ratio 0.82)
HIST_BW = 0.01  # bin width in ln ratio (1 %)
HIST_NB = 120  # up to ln ratio 1.0 (ratio 2.72); outside values land in the end bins

log = logging.getLogger(__name__)

ROLLUP_SUMS = ("steps", "above", "work_s", "step_s", "data_s", "excess_s", "data_excess_s", "compute_excess_s",
                "other_excess_s", "lost_s", "slowest_steps", "late_s", "late_n", "last_arrivals")
WINDOW_SUMS = ("steps", "above", "ratio_sum", "excess_s")


class RollupSink(Protocol):
    """Where the fold reads stored histograms and adds its sums (the compaction transaction)."""

    def savepoint(self) -> AbstractContextManager[None]: ...

    def rank_hists(self, run_id: int, ranks: Sequence[int]) -> list[tuple[int, bytes]]: ...

    def add_rank_rollups(self, keys: np.ndarray, hist: np.ndarray, slowdown: np.ndarray,
                         sums: dict[str, np.ndarray]) -> None: ...

    def add_rank_windows(self, keys: np.ndarray, sums: dict[str, np.ndarray]) -> None: ...


def hist_median(hist: np.ndarray) -> float | None:
    """Median ratio from a log-ratio histogram (linear interpolation inside the bin)."""
    m = hist_medians(np.asarray(hist).reshape(1, -1))[0]
    return None if np.isnan(m) else float(m)


def hist_medians(hist: np.ndarray) -> np.ndarray:
    """Median ratio of each row of a (ranks × bins) histogram; NaN for empty rows."""
    h = hist.astype(np.float64)
    total = h.sum(axis=1)
    cum = np.cumsum(h, axis=1)
    half = total / 2.0
    i = np.minimum(np.argmax(cum >= half[:, None], axis=1), h.shape[1] - 1)
    rows = np.arange(len(h))
    prev = np.where(i > 0, cum[rows, np.maximum(i - 1, 0)], 0.0)
    cnt = h[rows, i]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(cnt > 0, (half - prev) / cnt, 0.5)
    return np.where(total > 0, np.exp(HIST_LO + (i + frac) * HIST_BW), np.nan)


def _nan0(x: np.ndarray) -> np.ndarray:
    return np.nan_to_num(x, nan=0.0)


def work_ratio_stats(S: dict[str, np.ndarray], gid: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """Per-row work ratio against the step's median work, and each row's excess per component.

    Rows must be sorted by ``gid`` (the compactor sorts them so)."""
    work = S["step_s"] - _nan0(S["comm_exposed_s"])
    ug, g = unique_rows(gid)
    counts = np.bincount(g, minlength=len(ug))
    med, md, mc, mo = grouped_medians([work, S["data_s"], S["compute_s"], S["other_s"]], g, counts)
    out: dict[str, np.ndarray] = {"work": work, "med": med}
    with np.errstate(invalid="ignore", divide="ignore"):
        out["ratio"] = work / med[g]
    out["excess"] = work - med[g]
    for c, m in (("data_s", md), ("compute_s", mc), ("other_s", mo)):
        out[c] = _nan0(S[c] - m[g])
    return out


def _contribution(S: dict[str, np.ndarray], gid: np.ndarray, n_groups: int, sel: np.ndarray) -> tuple[dict, dict]:
    """Rollup sums of the selected rows: ({(run, rank): sums}, {(run, win, rank): sums}) as arrays."""
    s = {k: v[sel] for k, v in S.items()}
    g = gid[sel]
    if len(g) == 0:
        return {}, {}
    st = work_ratio_stats(s, g, n_groups)
    ratio = st["ratio"]
    ok = np.isfinite(ratio) & (ratio > 0)
    if not ok.any():  # no rank with measurable work (0-duration steps): nothing to fold
        return {}, {}
    run, rank, step = s["run_id"][ok], s["rank"][ok], s["step"][ok]
    r = ratio[ok]
    gg = g[ok]
    lr = np.log(r)
    b = np.clip(np.floor((lr - HIST_LO) / HIST_BW), 0, HIST_NB - 1).astype(np.int64)
    above = (r > THRESHOLD).astype(np.int64)
    work = st["work"][ok]
    excess = st["excess"][ok]
    # the slowest rank of each step carries that step's "max - median" (fleet time lost waiting for it)
    slow_rows = grouped_argmax(work, gg)
    lost = np.zeros(len(r))
    lost[slow_rows] = excess[slow_rows]
    slowest = np.zeros(len(r), dtype=np.int64)
    slowest[slow_rows] = 1
    vals = {
        "steps": np.ones(len(r), dtype=np.int64),
        "above": above,
        "work_s": work,
        "step_s": _nan0(s["step_s"][ok]),
        "data_s": _nan0(s["data_s"][ok]),
        "excess_s": excess,
        "data_excess_s": st["data_s"][ok],
        "compute_excess_s": st["compute_s"][ok],
        "other_excess_s": st["other_s"][ok],
        "lost_s": lost,
        "slowest_steps": slowest,
    }
    uk, inv = _unique_rows(run, rank)
    m = len(uk)
    per = {k: np.bincount(inv, weights=v, minlength=m) for k, v in vals.items()}
    per["hist"] = np.bincount(inv * HIST_NB + b, minlength=m * HIST_NB).reshape(m, HIST_NB)
    wk, winv = _unique_rows(run, step // WINDOW_STEPS, rank)
    wvals = {"steps": vals["steps"], "above": above, "ratio_sum": np.minimum(r, 3.0), "excess_s": excess}
    wper = {k: np.bincount(winv, weights=v, minlength=len(wk)) for k, v in wvals.items()}
    return ({"keys": uk, **per}, {"keys": wk, **wper})


def _unique_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(stack(cols), axis=0, return_inverse=True) for int columns (``grouped.unique_rows``)."""
    return unique_rows(*cols)


def _lateness(C: dict[str, np.ndarray], cgid: np.ndarray, sel: np.ndarray) -> dict[str, np.ndarray]:
    """Per (run, rank): Σ lateness at collectives (own enqueue - earliest rank's, same step and seq)."""
    c = {k: C[k][sel] for k in ("run_id", "rank", "seq", "start_ts")}
    g = cgid[sel]
    ok = np.isfinite(c["start_ts"])
    if not ok.any():
        return {}
    run, rank, seq, ts, g = c["run_id"][ok], c["rank"][ok], c["seq"][ok], c["start_ts"][ok], g[ok]
    uk, inv = _unique_rows(g, seq)
    n_per = np.bincount(inv, minlength=len(uk))
    tmin = np.full(len(uk), np.inf)
    np.minimum.at(tmin, inv, ts)
    tmax = np.full(len(uk), -np.inf)
    np.maximum.at(tmax, inv, ts)
    late = ts - tmin[inv]
    multi = n_per[inv] > 1
    # the last arrival of each (step, seq): its latest rank (the first such row on a tie)
    cand = np.flatnonzero(ts == tmax[inv])
    first_at = np.full(len(uk), len(ts), dtype=np.int64)
    np.minimum.at(first_at, inv[cand], cand)
    last = np.zeros(len(ts), dtype=np.int64)
    last[first_at[first_at < len(ts)]] = 1
    last &= multi.astype(np.int64)
    if not multi.any():
        return {}
    rk, rinv = _unique_rows(run[multi], rank[multi])
    return {
        "keys": rk,
        "late_s": np.bincount(rinv, weights=late[multi], minlength=len(rk)),
        "late_n": np.bincount(rinv, minlength=len(rk)).astype(np.float64),
        "last_arrivals": np.bincount(rinv, weights=last[multi], minlength=len(rk)),
    }


def _combine(parts: list[tuple[int, dict]], cols: tuple[str, ...], hist: bool) -> dict[str, Any]:
    parts = [(sign, p) for sign, p in parts if p]
    if not parts:
        return {}
    keys = np.concatenate([p["keys"] for _, p in parts])
    uk, inv = _unique_rows(*(keys[:, j] for j in range(keys.shape[1])))
    m = len(uk)
    out: dict[str, Any] = {"keys": uk}
    for col in cols:
        v = np.concatenate([sign * np.asarray(p.get(col, np.zeros(len(p["keys"]))), dtype=np.float64) for sign, p in parts])
        out[col] = np.bincount(inv, weights=v, minlength=m)
    if hist:
        h = np.zeros((m, HIST_NB), dtype=np.int64)
        off = 0
        for sign, p in parts:
            k = len(p["keys"])
            if "hist" in p:
                np.add.at(h, inv[off : off + k], sign * p["hist"])
            off += k
        out["hist"] = h
    return out


def fold_rank_rollups(sink: RollupSink, *, S: dict[str, np.ndarray], C: dict[str, np.ndarray], gid: np.ndarray,
                      cgid: np.ndarray, gkeys: np.ndarray) -> None:
    """Compactor fold: update rank_rollups / rank_windows for the steps of this pass (exact re-folds).

    Runs in a savepoint: should it ever fail, the rollups of this pass are skipped (logged and
    counted) and compaction — hence ingest — goes on."""
    global fold_errors
    try:
        with sink.savepoint():
            _fold(sink, S=S, C=C, gid=gid, cgid=cgid, gkeys=gkeys)
    except Exception:  # noqa: BLE001 - the analysis must never stop compaction
        fold_errors += 1
        log.exception("straggler rollup fold failed for this compaction pass (rollups skipped)")


fold_errors = 0


def _fold(sink: RollupSink, *, S: dict[str, np.ndarray], C: dict[str, np.ndarray], gid: np.ndarray,
          cgid: np.ndarray, gkeys: np.ndarray) -> None:
    n_groups = len(gkeys)
    if n_groups == 0:
        return
    # steps with new rank-step rows: add all their rows, subtract the rows folded before
    new_g = np.zeros(n_groups, dtype=bool)
    new_g[gid[~S["is_old"]]] = True
    touched = new_g[gid]
    parts_r: list[tuple[int, dict]] = []
    parts_w: list[tuple[int, dict]] = []
    if touched.any():
        r_all, w_all = _contribution(S, gid, n_groups, touched)
        parts_r.append((1, r_all))
        parts_w.append((1, w_all))
        old = touched & S["is_old"]
        if old.any():
            r_old, w_old = _contribution(S, gid, n_groups, old)
            parts_r.append((-1, r_old))
            parts_w.append((-1, w_old))
    cnew_g = np.zeros(n_groups, dtype=bool)
    if len(cgid):
        cnew_g[cgid[~C["is_old"]]] = True
        ctouched = cnew_g[cgid]
        if ctouched.any():
            parts_r.append((1, _lateness(C, cgid, ctouched)))
            cold = ctouched & C["is_old"]
            if cold.any():
                parts_r.append((-1, _lateness(C, cgid, cold)))
    roll = _combine(parts_r, ROLLUP_SUMS, hist=True)
    win = _combine(parts_w, WINDOW_SUMS, hist=False)
    if roll:
        _add_rollups(sink, roll)
    if win:
        sink.add_rank_windows(win["keys"], {c: win[c] for c in WINDOW_SUMS})


def _add_rollups(sink: RollupSink, roll: dict[str, Any]) -> None:
    """Merge the pass's histograms with the stored ones (the median is taken from the merged one);
    the scalar sums are added by the sink's upsert."""
    keys = roll["keys"]
    hist = roll["hist"]
    row_of = {(int(a), int(b)): i for i, (a, b) in enumerate(keys)}
    for run_id in np.unique(keys[:, 0]):
        ranks = keys[keys[:, 0] == run_id, 1]
        for rank, blob in sink.rank_hists(int(run_id), ranks.tolist()):
            prev = np.frombuffer(blob, dtype="<i4")
            if len(prev) == HIST_NB:
                hist[row_of[(int(run_id), int(rank))]] += prev
    h = np.maximum(hist, 0).astype("<i4")
    sink.add_rank_rollups(keys, h, hist_medians(h), {c: roll[c] for c in ROLLUP_SUMS})
