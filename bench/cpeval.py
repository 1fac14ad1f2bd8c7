"""Evaluation of change-point detectors as the TCPD benchmark scores them (van den Burg & Williams,
2020): F1 with a margin of 5 points, index 0 counted as a change point in both the annotations and
the predictions; plus a labelled synthetic set of the shapes performance series take.

Used by ``bench/changepoint_eval.py`` and the detector's tests (``tests/test_changepoint.py``).
Reimplemented from the paper's definition (precision over the union of annotations, recall averaged
over annotators, each prediction matched at most once, closest first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["true_positives", "f1_margin", "LabelledSeries", "labelled_set", "stationary_set"]


def true_positives(truth: Iterable[int], pred: Iterable[int], margin: int = 5) -> set[int]:
    """Truth locations matched by a distinct prediction within ``margin`` (closest prediction first)."""
    left = set(pred)
    hit: set[int] = set()
    for tau in truth:
        near = sorted((abs(tau - x), x) for x in left if abs(tau - x) <= margin)
        if near:
            hit.add(tau)
            left.discard(near[0][1])
    return hit


def f1_margin(annotations: Mapping[object, Sequence[int]] | Sequence[int], pred: Sequence[int], margin: int = 5) -> float:
    """TCPD F1: ``annotations`` is one list of change points or a mapping annotator -> list."""
    if not isinstance(annotations, Mapping):
        annotations = {0: list(annotations)}
    tks = [set(v) | {0} for v in annotations.values()]
    x = set(pred) | {0}
    tstar = set().union(*tks)
    p = len(true_positives(tstar, x, margin)) / len(x)
    r = sum(len(true_positives(tk, x, margin)) / len(tk) for tk in tks) / len(tks)
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


@dataclass(frozen=True)
class LabelledSeries:
    name: str
    shape: str
    values: np.ndarray
    cps: tuple[int, ...]


def _levels(rng: np.random.Generator, n: int, cps: list[int], base: float, sigma: float, effects: list[float]) -> np.ndarray:
    mu = np.full(n, base)
    level = base
    for c, e in zip(cps, effects, strict=True):
        level = level + e * sigma
        mu[c:] = level
    return mu


def labelled_set(seed: int = 7, per_shape: int = 24) -> list[LabelledSeries]:
    """Synthetic performance-like series with known change points (the evaluation set of docs/analysis.md).

    Levels 50-200 (a step time in ms, a throughput), 30-500 points; noise CV 1-8 %; change sizes 1-5 noise σ,
    signs random; shapes: single step up/down, 2-4 changes, outliers (3 % spikes of 5-15 σ), a
    linear trend with a step, heavy-tailed noise (Student t, 3 d.o.f.), noise that varies along
    the series, and no-change series (stationary, trend only, outliers only)."""
    rng = np.random.default_rng(seed)
    out: list[LabelledSeries] = []

    def cps_for(n: int, k: int) -> list[int]:
        gap = max(8, n // (k + 2))
        while True:
            c = sorted(rng.choice(np.arange(gap // 2 + 5, n - 5), size=k, replace=False).tolist())
            if all(b - a >= gap // 2 for a, b in zip([0, *c], [*c, n], strict=True)):
                return c

    def eff(k: int) -> list[float]:
        return [float(rng.uniform(1.0, 5.0) * rng.choice([-1, 1])) for _ in range(k)]

    shapes = ["step_up", "step_down", "multi", "outliers", "trend_step", "heavy_tail", "varying_noise",
              "none", "none_trend", "none_outliers"]
    for shape in shapes:
        for i in range(per_shape):
            n = int(rng.integers(30, 500))
            base = float(rng.uniform(50, 200))
            cv = float(rng.uniform(0.01, 0.08))
            sigma = base * cv
            k = {"multi": int(rng.integers(2, 5))}.get(shape, 0 if shape.startswith("none") else 1)
            cps = cps_for(n, k) if k else []
            e = eff(k)
            if shape == "step_up":
                e = [abs(v) for v in e]
            if shape == "step_down":
                e = [-abs(v) for v in e]
            mu = _levels(rng, n, cps, base, sigma, e)
            noise = rng.normal(0, sigma, n)
            if shape == "heavy_tail":
                noise = rng.standard_t(3, n) * sigma / np.sqrt(3.0)
            if shape == "varying_noise":
                noise = noise * np.exp(np.linspace(-0.5, 0.5, n) * rng.choice([-1, 1]))
            x = mu + noise
            if shape in ("trend_step", "none_trend"):
                x = x + np.linspace(0, 1, n) * rng.uniform(-4, 4) * sigma
            if shape in ("outliers", "none_outliers"):
                spikes = rng.random(n) < 0.03
                x = x + spikes * rng.uniform(5, 15, n) * sigma * rng.choice([-1, 1], n)
            out.append(LabelledSeries(f"{shape}-{i:02d}", shape, x, tuple(cps)))
    return out


def stationary_set(seed: int = 11, n_series: int = 200, length: int = 100, cv: float = 0.05) -> list[np.ndarray]:
    """Stationary Gaussian series with coefficient of variation ``cv`` (the false-alert check)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(100.0, 100.0 * cv, length) for _ in range(n_series)]
