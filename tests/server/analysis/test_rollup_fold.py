"""The straggler rollup fold (``analysis.rollups``) as pure numpy: no database, a recording sink."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from fleetscope.server.analysis import rollups
from fleetscope.server.analysis.rollups import (
    HIST_NB,
    ROLLUP_SUMS,
    WINDOW_SUMS,
    fold_rank_rollups,
    hist_median,
)


def test_fold_ignores_unmeasurable_rows() -> None:
    """NaN or non-positive work (not measured, or a timing error) is left out of the ratios."""
    n = 4
    S = {"run_id": np.full(2 * n, 7), "step": np.repeat([0, 1], n), "rank": np.tile(np.arange(n), 2),
         "is_old": np.zeros(2 * n, dtype=bool), "step_s": np.array([1.0, np.nan, 1.1, 0.9, 1.0, 1.0, 1.0, 1.0]),
         "comm_exposed_s": np.array([0.1, 0.1, np.nan, 0.1, 0.1, 2.0, 0.1, 0.1]),
         "data_s": np.full(2 * n, np.nan), "compute_s": np.full(2 * n, 0.8), "other_s": np.full(2 * n, 0.05)}
    gid = S["step"].copy()
    roll, win = rollups._contribution(S, gid, 2, np.ones(2 * n, dtype=bool))
    steps = {int(k[1]): int(v) for k, v in zip(roll["keys"], roll["steps"], strict=True)}
    assert steps == {0: 2, 2: 2, 3: 2}  # rank 1: a NaN step, then work < 0 (exposed > step)
    assert roll["hist"].sum() == 6 and np.isfinite(roll["excess_s"]).all() and np.isfinite(roll["data_excess_s"]).all()


def test_fold_of_only_unmeasurable_rows_is_empty() -> None:
    """A pass whose every row has zero work (0-duration steps) folds nothing instead of failing
    (it used to raise IndexError, and the compaction pass skipped its rollups)."""
    n = 3
    S = {"run_id": np.full(n, 7), "step": np.zeros(n, dtype=np.int64), "rank": np.arange(n),
         "is_old": np.zeros(n, dtype=bool), "step_s": np.zeros(n), "comm_exposed_s": np.zeros(n),
         "data_s": np.zeros(n), "compute_s": np.zeros(n), "other_s": np.zeros(n)}
    assert rollups._contribution(S, S["step"].copy(), 1, np.ones(n, dtype=bool)) == ({}, {})
    before = rollups.fold_errors
    sink = _Sink()
    C = {k: np.empty(0) for k in ("run_id", "rank", "seq", "start_ts", "is_old")}
    fold_rank_rollups(sink, S=S, C=C, gid=S["step"].copy(), cgid=np.empty(0, dtype=np.int64), gkeys=np.zeros((1, 2)))
    assert rollups.fold_errors == before and sink.rollups == [] and sink.windows == []



class _Sink:
    """Records what the fold writes; holds histograms like ``rank_rollups`` does."""

    def __init__(self) -> None:
        self.hists: dict[tuple[int, int], bytes] = {}
        self.rollups: list[tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]] = []
        self.windows: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []

    @contextmanager
    def savepoint(self) -> Any:
        yield

    def rank_hists(self, run_id: int, ranks: Any) -> list[tuple[int, bytes]]:
        return [(r, self.hists[(run_id, r)]) for r in ranks if (run_id, r) in self.hists]

    def add_rank_rollups(self, keys: np.ndarray, hist: np.ndarray, slowdown: np.ndarray, sums: dict[str, np.ndarray]) -> None:
        self.rollups.append((keys, hist, slowdown, sums))
        for (run, rank), h in zip(keys.tolist(), hist, strict=True):
            self.hists[(run, rank)] = h.astype("<i4").tobytes()

    def add_rank_windows(self, keys: np.ndarray, sums: dict[str, np.ndarray]) -> None:
        self.windows.append((keys, sums))


def _pass(ranks: int, steps: range, slow: dict[int, float], rng: np.random.Generator) -> dict[str, Any]:
    n = ranks * len(steps)
    S = {"run_id": np.full(n, 3), "step": np.repeat(np.array(list(steps)), ranks), "rank": np.tile(np.arange(ranks), len(steps)),
         "is_old": np.zeros(n, dtype=bool)}
    work = rng.lognormal(0, 0.01, n) * np.array([slow.get(r, 1.0) for r in S["rank"]])
    S.update(step_s=work + 0.1, comm_exposed_s=np.full(n, 0.1), data_s=np.full(n, 0.01), compute_s=work - 0.02,
             other_s=np.full(n, 0.01))
    gkeys = np.unique(S["run_id"] * (1 << 32) + S["step"])
    gid = np.searchsorted(gkeys, S["run_id"] * (1 << 32) + S["step"])
    C = {k: np.zeros(0, dtype=np.int64) for k in ("run_id", "step", "rank", "seq")} | {
        "start_ts": np.zeros(0), "is_old": np.zeros(0, dtype=bool)}
    return {"S": S, "C": C, "gid": gid, "cgid": np.zeros(0, dtype=np.int64), "gkeys": gkeys}


def test_fold_writes_every_sum_and_merges_histograms_across_passes() -> None:
    rng = np.random.default_rng(0)
    sink = _Sink()
    fold_rank_rollups(sink, **_pass(8, range(0, 20), {5: 1.3}, rng))
    fold_rank_rollups(sink, **_pass(8, range(20, 40), {5: 1.3}, rng))
    keys, hist, slowdown, sums = sink.rollups[-1]
    assert list(sums) == list(ROLLUP_SUMS) and hist.shape == (8, HIST_NB)
    assert (hist.sum(axis=1) == 40).all()  # the second pass merged the first pass's histograms
    j = int(np.flatnonzero(keys[:, 1] == 5)[0])
    assert slowdown[j] == pytest.approx(1.3, rel=0.02) and hist_median(hist[j]) == pytest.approx(slowdown[j])
    assert sums["steps"][j] == 20 and sums["slowest_steps"][j] == 20  # sums are per pass; the store adds them
    wkeys, wsums = sink.windows[-1]
    assert list(wsums) == list(WINDOW_SUMS) and wkeys.shape[1] == 3


def test_a_failing_fold_is_counted_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected")

    before = rollups.fold_errors
    monkeypatch.setattr(rollups, "_fold", boom)
    fold_rank_rollups(_Sink(), **_pass(2, range(3), {}, np.random.default_rng(1)))
    assert rollups.fold_errors == before + 1
