"""Offline change-point detection: robust binary segmentation with a rank permutation test.

One detector, one fixed default configuration (``DEFAULT``), used by regression alerts (run series,
benchmark series, step time within a run) and by ``fleetscope detect``. Method (docs/analysis.md):

1. Candidate split of a segment: the maximum over split points t of the standardised Mann-Whitney
   (Wilcoxon rank-sum) statistic of left vs right — ranks make it immune to outliers and to the
   noise distribution's shape.
2. Significance: a permutation test of that *maximum* (so the search over t is accounted for), with
   a fixed seed per segment (deterministic) and sequential early stopping for clear nulls.
3. Practical size: the medians of the two sides must differ by at least ``min_effect`` robust
   standard deviations (pooled MAD of the residuals about each side's median).
4. Abruptness: at least half of the change must happen within ``local_window`` points of the split
   (medians just before vs just after) — a slow drift is not a change point, and a trend does not
   get cut into stairs.
5. Recursion on both sides (binary segmentation), then pruning: each change point is re-tested
   between its neighbours until every remaining one passes; its location is re-estimated there.

Indices are "first point after the change" (0 < i < n), as ``fleetscope detect`` prints them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DetectorConfig", "DEFAULT", "ChangePoint", "detect", "change_points", "segments_of"]


@dataclass(frozen=True, kw_only=True)
class DetectorConfig:
    """Configuration of the detector; ``DEFAULT`` is the one used everywhere."""

    alpha: float = 0.01
    """significance level of each split's permutation test (false alarms per tested segment)"""
    permutations: int = 499
    """permutations per test (p-value resolution 1/(B+1) = 0.002)"""
    min_size: int = 3
    """fewest points on either side of a change: 1-2 point excursions are outliers, not changes"""
    min_effect: float = 0.8
    """|median after − median before| in robust standard deviations (Cohen's "large" effect)"""
    local_window: int = 10
    """distance within which an alternative split counts as the same change (peaks, pruning)"""
    max_points: int = 4000
    """longer series are reduced to this many block medians first (locations mapped back)"""
    seed: int = 20240617

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.permutations < 19:
            raise ValueError(f"permutations must be >= 19, got {self.permutations}")
        if self.min_size < 1:
            raise ValueError(f"min_size must be >= 1, got {self.min_size}")


DEFAULT = DetectorConfig()


@dataclass(frozen=True)
class ChangePoint:
    """A change at ``index`` (first point after it) with the sides' medians and its statistics."""

    index: int
    before: float
    after: float
    p_value: float
    effect: float  # |Δ median| / robust σ
    change: float | None = field(default=None)  # relative: (after - before) / |before|

    def as_dict(self) -> dict[str, float | int | None]:
        return {"index": self.index, "before": self.before, "after": self.after, "p_value": self.p_value,
                "effect": self.effect, "change": self.change}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank)."""
    n = len(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], n]
    avg = (starts + ends + 1) / 2.0  # 1-based mean rank of each tie group
    r = np.empty(n)
    r[order] = np.repeat(avg, ends - starts)
    return r


def _max_stat(c: np.ndarray, lo: int, hi: int, denom: np.ndarray) -> np.ndarray:
    """max over t in [lo, hi] of |cumsum(c)[t-1]| / denom, for each row of c (2-D) or for c (1-D)."""
    cs = np.cumsum(c, axis=-1)[..., lo - 1 : hi]
    return np.max(np.abs(cs) / denom, axis=-1)


def _split_test(x: np.ndarray, cfg: DetectorConfig, seed: int) -> tuple[int, float, np.ndarray, float] | None:
    """Best split t (left size) of segment x, its permutation p-value, the z profile and the critical
    value of the max statistic at ``alpha`` (inf when the test stopped early); None if too short."""
    n = len(x)
    m = cfg.min_size
    if n < 2 * m:
        return None
    r = _ranks(x)
    c = r - r.mean()
    s2 = float(np.sum(c * c))
    if s2 <= 0:
        return None  # constant segment
    t = np.arange(m, n - m + 1)
    denom = np.sqrt(t * (n - t) / (n * (n - 1)) * s2)
    z = np.abs(np.cumsum(c)[m - 1 : n - m]) / denom
    best = int(t[int(np.argmax(z))])
    obs = float(z.max())
    rng = np.random.default_rng(seed)
    B = cfg.permutations
    limit = cfg.alpha * (B + 1)  # p <= alpha  <=>  exceedances + 1 <= limit
    exceed = 0
    done = 0
    maxima = []
    chunk = max(16, min(B, 2_000_000 // n))
    while done < B:
        k = min(chunk, B - done)
        perm = rng.permuted(np.broadcast_to(c, (k, n)), axis=1)
        mx = _max_stat(perm, m, n - m, denom)
        maxima.append(mx)
        exceed += int(np.sum(mx >= obs - 1e-12))
        done += k
        if exceed + 1 > limit:  # already not significant: stop early (Besag-Clifford style)
            return best, (exceed + 1) / (done + 1), z, math.inf
    # the null distribution of the max statistic depends on the ranks only (distribution-free)
    crit = float(np.quantile(np.concatenate(maxima), 1 - cfg.alpha))
    return best, (exceed + 1) / (B + 1), z, crit


def _rank_z(x: np.ndarray, t: int) -> float:
    """Standardised rank-sum statistic of x[:t] against x[t:]."""
    n = len(x)
    c = _ranks(x)
    c = c - c.mean()
    s2 = float(np.sum(c * c))
    if s2 <= 0:
        return 0.0
    return abs(float(np.sum(c[:t]))) / math.sqrt(t * (n - t) / (n * (n - 1)) * s2)


def _robust_sigma(left: np.ndarray, right: np.ndarray) -> float:
    res = np.concatenate([left - np.median(left), right - np.median(right)])
    mad = float(np.median(np.abs(res)))
    if mad > 0:
        return 1.4826 * mad
    sd = float(np.std(res))
    return sd


def _side_slope(x: np.ndarray, t: int) -> float:
    """Robust common slope of both sides of a split, from pairs that do not straddle it."""
    slopes = []
    for side in (x[:t], x[t:]):
        h = len(side) // 4
        if h >= 1:
            slopes.append((side[h:] - side[:-h]) / h)
    if not slopes:
        return 0.0
    return float(np.median(np.concatenate(slopes)))


def _accept(x: np.ndarray, t: int, cfg: DetectorConfig, crit: float = 0.0) -> tuple[bool, float, float, float]:
    """Size and abruptness of a split at t, after allowing a common linear trend: (ok, before, after, effect).

    The jump is the difference of the sides' medians once a robust slope (estimated within each side)
    is removed: a ramp has no jump, a step in a ramp keeps its own. The detrended series must still
    separate at t beyond ``crit`` (the segment's critical value of the max rank statistic), so a
    trend does not pass as a change just because the raw ranks of a ramp differ."""
    left, right = x[:t], x[t:]
    before, after = float(np.median(left)), float(np.median(right))
    if after == before:
        return False, before, after, 0.0
    slope = _side_slope(x, t)
    d = x - slope * np.arange(len(x))
    dl, dr = d[:t], d[t:]
    jump = float(np.median(dr) - np.median(dl))
    sigma = _robust_sigma(dl, dr)
    effect = abs(jump) / sigma if sigma > 0 else (math.inf if jump != 0 else 0.0)
    ok = jump * (after - before) > 0 and effect >= cfg.min_effect
    if ok and crit > 0 and slope != 0:
        ok = _rank_z(d, t) >= crit
    return ok, before, after, effect


def _peaks(z: np.ndarray, sep: int, k: int) -> list[int]:
    """Indices of up to k highest local maxima of z, at least ``sep`` apart."""
    order = np.argsort(-z)
    taken: list[int] = []
    for i in order:
        if all(abs(int(i) - j) >= sep for j in taken):
            lo, hi = max(0, i - 1), min(len(z), i + 2)
            if z[i] >= z[lo:hi].max():
                taken.append(int(i))
        if len(taken) >= k:
            break
    return taken


def _seed(cfg: DetectorConfig, a: int, b: int) -> int:
    return (cfg.seed * 1_000_003 + a * 7919 + b) % (2**63)


def _segment(x: np.ndarray, a: int, b: int, cfg: DetectorConfig, out: dict[int, float], depth: int = 0) -> None:
    seg = x[a:b]
    res = _split_test(seg, cfg, _seed(cfg, a, b))
    if res is None:
        return
    t, p, z, crit = res
    if p > cfg.alpha:
        return
    ok, *_ = _accept(seg, t, cfg, crit)
    if not ok:
        # the best rank split fails the size/abruptness checks (e.g. a trend): try the best split
        # that passes them, in order of the rank statistic
        m = cfg.min_size
        cand = [c + m for c in _peaks(z, max(m, cfg.local_window), 5)]
        t = next((int(c) for c in cand if _accept(seg, int(c), cfg, crit)[0]), -1)
        if t < 0:
            return
    out[a + t] = p
    if depth < 64:
        _segment(x, a, a + t, cfg, out, depth + 1)
        _segment(x, a + t, b, cfg, out, depth + 1)


def _prune(x: np.ndarray, cps: list[int], cfg: DetectorConfig) -> list[tuple[int, float]]:
    """Re-test each change point between its neighbours; drop the weakest failing one, repeat."""
    cps = sorted(cps)
    while True:
        bounds = [0, *cps, len(x)]
        results: list[tuple[int, float, bool, float]] = []
        for i in range(1, len(bounds) - 1):
            a, b = bounds[i - 1], bounds[i + 1]
            seg = x[a:b]
            res = _split_test(seg, cfg, _seed(cfg, a, b))
            t0 = bounds[i] - a
            if res is None:
                results.append((bounds[i], 1.0, False, 0.0))
                continue
            t, p, z, crit = res
            # keep the location unless the neighbours' segment clearly prefers another nearby split
            m = cfg.min_size
            tt = t if abs(t - t0) <= cfg.local_window and _accept(seg, t, cfg, crit)[0] else t0
            ok, _, _, eff = _accept(seg, tt, cfg, crit)
            if not (m <= tt <= len(seg) - m):
                ok = False
            results.append((a + tt, p, ok and p <= cfg.alpha, eff))
        bad = [r for r in results if not r[2]]
        if not bad:
            return [(r[0], r[1]) for r in results]
        weakest = min(bad, key=lambda r: (r[3], -r[1]))
        cps = sorted({r[0] for r in results if r is not weakest})


def _reduce(x: np.ndarray, max_points: int) -> tuple[np.ndarray, int]:
    k = math.ceil(len(x) / max_points)
    if k <= 1:
        return x, 1
    m = len(x) // k
    head = np.median(x[: m * k].reshape(m, k), axis=1)
    if len(x) > m * k:
        head = np.r_[head, np.median(x[m * k :])]
    return head, k


def detect(values: Sequence[float] | np.ndarray, config: DetectorConfig = DEFAULT) -> list[ChangePoint]:
    """Change points of a series (NaN/inf points are ignored), earliest first."""
    x_all = np.asarray(values, dtype=np.float64)
    finite = np.flatnonzero(np.isfinite(x_all))
    x = x_all[finite]
    if len(x) < 2 * config.min_size:
        return []
    xr, k = _reduce(x, config.max_points)
    found: dict[int, float] = {}
    _segment(xr, 0, len(xr), config, found)
    kept = _prune(xr, list(found), config) if found else []
    out = []
    bounds = [0, *(c for c, _ in kept), len(xr)]
    for i, (c, p) in enumerate(kept):
        left, right = xr[bounds[i] : c], xr[c : bounds[i + 2]]
        before, after = float(np.median(left)), float(np.median(right))
        sigma = _robust_sigma(left, right)
        eff = abs(after - before) / sigma if sigma > 0 else math.inf
        idx = int(finite[min(c * k, len(x) - 1)])
        rel = (after - before) / abs(before) if before != 0 else None
        out.append(ChangePoint(idx, before, after, float(p), float(eff), rel))
    return out


def change_points(values: Sequence[float] | np.ndarray, config: DetectorConfig = DEFAULT) -> list[int]:
    """Indices (first point after each change) — what ``fleetscope detect`` prints."""
    return [c.index for c in detect(values, config)]


def segments_of(n: int, cps: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)) segments of a series of length n cut at ``cps``."""
    b = [0, *sorted(cps), n]
    return [(b[i], b[i + 1]) for i in range(len(b) - 1)]
