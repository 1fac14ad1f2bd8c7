"""Token balance across ranks (docs/metrics.md, "Token balance"): how unevenly tokens — in total and per
modality — are spread over the ranks of each step, whether work time follows them, and the finding
("rank 37 gets 1.40× the vision tokens of the median rank; it is the slowest rank on 80 % of steps:
balance by tokens, not samples").

Pure: per-rank tokens and work come from the recent steps' rank blocks (``store.steps.recent_blocks``),
per-rank modality tokens from ``run_rank_modalities`` (``store.token_balance``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["token_balance", "IMBALANCE_MIN", "CORRELATION_MIN", "SLOWEST_MIN"]

#: a rank's tokens over the median rank's worth a finding
IMBALANCE_MIN = 1.1
#: work time "follows tokens" from this Pearson correlation up
CORRELATION_MIN = 0.3
#: "it is the straggler": the slowest rank on at least this share of the steps
SLOWEST_MIN = 0.5


def _per_step(block: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ranks, tokens, work) of one step's ranks with tokens > 0 and a finite work time; None when fewer
    than two ranks have both."""
    t = np.asarray(block["tokens"], dtype=np.float64)
    w = np.asarray(block["step_s"], dtype=np.float64) - np.nan_to_num(np.asarray(block["comm_exposed_s"], dtype=np.float64))
    ok = np.isfinite(t) & (t > 0) & np.isfinite(w)
    if ok.sum() < 2:
        return None
    return np.asarray(block["rank"])[ok].astype(np.int64), t[ok], w[ok]


def token_balance(blocks: Sequence[tuple[int, Mapping[str, np.ndarray]]],
                  rank_modalities: Sequence[tuple[int, str, int, int]]) -> dict[str, Any] | None:
    """Token balance of a run from ``blocks`` [(step, rank block)] and ``rank_modalities`` [(rank,
    modality, tokens summed over steps, steps with that modality)]; None without per-rank tokens.

    Per step, over the ranks that reported tokens: ``imbalance`` = max / median tokens. Pooled over the
    rank-steps: each rank's tokens and work (step − exposed comm) relative to the step's median rank,
    their Pearson correlation (``work_correlation``) and the slope of relative work on relative tokens
    (``work_elasticity``: 1 = work proportional to tokens). Per rank: the mean of its relative tokens
    (``tokens_ratio``) and the share of steps it was the slowest (``slowest_share``). Per modality: each
    rank's tokens per step it reported (0 where it had none of that modality) over the median rank's."""
    steps = []
    rel_t: list[np.ndarray] = []
    rel_w: list[np.ndarray] = []
    ranks_all: list[np.ndarray] = []
    slowest: list[int] = []
    imb: list[float] = []
    for step, block in blocks:
        got = _per_step(block)
        if got is None:
            continue
        ranks, t, w = got
        mt, mw = float(np.median(t)), float(np.median(w))
        if mt <= 0 or mw <= 0:
            continue
        steps.append(step)
        rel_t.append(t / mt)
        rel_w.append(w / mw)
        ranks_all.append(ranks)
        slowest.append(int(ranks[int(np.argmax(w))]))
        imb.append(float(t.max() / mt))
    if not steps:
        return None
    rt, rw, rk = np.concatenate(rel_t), np.concatenate(rel_w), np.concatenate(ranks_all)
    corr = slope = None
    if rt.std() > 0 and rw.std() > 0:
        corr = float(np.corrcoef(rt, rw)[0, 1])
        slope = float(np.cov(rt, rw, bias=True)[0, 1] / rt.var())
    uniq, inv = np.unique(rk, return_inverse=True)
    mean_rel = np.bincount(inv, weights=rt) / np.bincount(inv)
    present = np.bincount(inv)
    slow_counts = dict(zip(*np.unique(np.array(slowest), return_counts=True), strict=True))
    per_rank = {int(r): {"tokens_ratio": float(mean_rel[i]), "steps": int(present[i]),
                         "slowest_share": float(slow_counts.get(r, 0)) / int(present[i])}
                for i, r in enumerate(uniq)}
    heavy = int(uniq[int(np.argmax(mean_rel))])
    top_slow = max(per_rank, key=lambda r: (per_rank[r]["slowest_share"], -r))

    modalities: dict[str, dict[str, Any]] = {}
    by_rank_steps: dict[int, int] = {}
    for r, _m, _tok, n in rank_modalities:
        by_rank_steps[r] = max(by_rank_steps.get(r, 0), int(n))
    mod_ranks = sorted(by_rank_steps)
    for m in sorted({m for _, m, _, _ in rank_modalities}):
        per = np.zeros(len(mod_ranks))
        pos = {r: i for i, r in enumerate(mod_ranks)}
        for r, mm, tok, _n in rank_modalities:
            if mm == m and by_rank_steps[r] > 0:
                per[pos[r]] = tok / by_rank_steps[r]
        med = float(np.median(per))
        hi = int(np.argmax(per))
        modalities[m] = {"tokens_per_step_median": med, "max_rank": mod_ranks[hi],
                         "ratio": float(per[hi]) / med if med > 0 else None}

    # the finding: the largest imbalance of a modality or of all tokens, and what it costs
    cands: list[tuple[float, int, str | None]] = [(per_rank[heavy]["tokens_ratio"], heavy, None)]
    cands += [(v["ratio"], v["max_rank"], m) for m, v in modalities.items() if v["ratio"] is not None]
    ratio, rank, mod = max(cands, key=lambda c: (c[0], c[2] is not None))
    finding = None
    if ratio >= IMBALANCE_MIN:
        what = f"the {mod} tokens" if mod else "the tokens"
        share = per_rank.get(rank, {}).get("slowest_share")
        head = f"rank {rank} gets {ratio:.2f}× {what} of the median rank"
        if corr is not None and corr >= CORRELATION_MIN:
            slow = (f"; it is the slowest rank on {share * 100:.0f} % of steps" if share is not None and share >= SLOWEST_MIN
                    else "")
            finding = f"{head}{slow} and work time follows tokens (r = {corr:.2f}): balance by tokens, not samples"
        else:
            finding = (f"{head}, but work time does not follow tokens (r = {corr:.2f}): the imbalance costs little"
                       if corr is not None else f"{head}")
    return {
        "steps": len(steps),
        "first_step": int(min(steps)),
        "last_step": int(max(steps)),
        "ranks": len(uniq),
        "imbalance": float(np.median(imb)),
        "imbalance_p95": float(np.percentile(imb, 95)),
        "work_correlation": corr,
        "work_elasticity": slope,
        "heaviest_rank": {"rank": heavy, **per_rank[heavy]},
        "slowest_rank": {"rank": top_slow, **per_rank[top_slow]},
        "modalities": modalities,
        "finding": finding,
    }
