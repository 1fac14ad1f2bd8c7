"""analysis.tokens without a database: token imbalance per step, its correlation with work time, the
per-modality ratio and the finding, with known answers."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.server.analysis.tokens import token_balance

RANKS = 8


def _block(tokens: np.ndarray, work: np.ndarray, exposed: float = 0.01) -> dict[str, np.ndarray]:
    return {"rank": np.arange(len(tokens)), "tokens": tokens.astype(float), "step_s": work + exposed,
            "comm_exposed_s": np.full(len(tokens), exposed)}


def test_work_that_follows_tokens_gives_the_finding() -> None:
    rng = np.random.default_rng(1)
    blocks = []
    for s in range(40):
        t = rng.uniform(900, 1100, RANKS)
        t[3] *= 1.4  # rank 3 gets more tokens
        blocks.append((s, _block(t, 1e-4 * t)))  # work proportional to tokens
    mods = [(r, "vision", int(700 * 40 * (1.4 if r == 3 else 1.0)), 40) for r in range(RANKS)]
    mods += [(r, "text", 300 * 40, 40) for r in range(RANKS)]
    tb = token_balance(blocks, mods)
    assert tb is not None and tb["steps"] == 40 and tb["ranks"] == RANKS
    imb = [b["tokens"].max() / np.median(b["tokens"]) for _, b in blocks]
    assert tb["imbalance"] == pytest.approx(float(np.median(imb)))
    assert tb["work_correlation"] == pytest.approx(1.0) and tb["work_elasticity"] == pytest.approx(1.0)
    assert tb["heaviest_rank"]["rank"] == 3 and tb["slowest_rank"]["rank"] == 3
    assert tb["heaviest_rank"]["slowest_share"] == 1.0
    rel = np.mean([b["tokens"][3] / np.median(b["tokens"]) for _, b in blocks])
    assert tb["heaviest_rank"]["tokens_ratio"] == pytest.approx(rel)
    assert tb["modalities"]["vision"] == {"tokens_per_step_median": 700.0, "max_rank": 3, "ratio": pytest.approx(1.4)}
    assert tb["modalities"]["text"]["ratio"] == pytest.approx(1.0)
    # the larger imbalance names the modality: the vision ratio (1.40) beats the total's (~1.28)
    assert tb["finding"] == ("rank 3 gets 1.40× the vision tokens of the median rank; it is the slowest rank on 100 % "
                             "of steps and work time follows tokens (r = 1.00): balance by tokens, not samples")


def test_imbalance_that_costs_nothing_says_so() -> None:
    rng = np.random.default_rng(2)
    blocks = []
    for s in range(60):
        t = np.full(RANKS, 1000.0)
        t[5] = 1500.0
        blocks.append((s, _block(t, rng.uniform(0.9, 1.1, RANKS))))  # work independent of tokens
    tb = token_balance(blocks, [])
    assert tb is not None and tb["imbalance"] == pytest.approx(1.5) and tb["heaviest_rank"]["rank"] == 5
    assert abs(tb["work_correlation"]) < 0.3
    assert tb["finding"].startswith("rank 5 gets 1.50× the tokens of the median rank, but work time does not follow")
    assert tb["modalities"] == {}


def test_balanced_or_unmeasured() -> None:
    even = [(s, _block(np.full(RANKS, 1000.0), np.full(RANKS, 1.0))) for s in range(5)]
    tb = token_balance(even, [])
    assert tb is not None and tb["imbalance"] == 1.0 and tb["finding"] is None and tb["work_correlation"] is None
    no_tokens = [(s, _block(np.full(RANKS, np.nan), np.full(RANKS, 1.0))) for s in range(5)]
    assert token_balance(no_tokens, []) is None
    assert token_balance([], []) is None
