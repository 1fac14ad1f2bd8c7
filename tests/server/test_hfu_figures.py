"""MFU and HFU through ingest, compaction and the summary, with known answers: hardware FLOPs per step
(``hw_flops``, the optional rank-step field added last) give ``hfu`` and ``recompute_overhead``; an old
client that does not send the field, and fragments landed by a server from before the field, leave
them unmeasured (NULL, not 0) while MFU stays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fleetscope.server.codec import FRAG_STEP_FIELDS, encode_block
from fleetscope.server.db import make_engine
from sqlalchemy import text

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
PEAK = 1e12


def _row(rank: int, step: int, step_s: float, flops: float, hw: float | None, tokens: int, padded: int,
         *, old: bool = False) -> tuple:
    v: dict[str, Any] = {"rank": rank, "step": step, "step_s": step_s, "ts": 1.7e9 + step, "compute_s": step_s,
                         "other_s": 0.0, "tokens": tokens, "padded_tokens": padded, "flops": flops, "hw_flops": hw}
    row = tuple(v.get(n) for n in NAMES)
    return row[:-1] if old else row  # an old client's row ends before hw_flops


def test_hfu_and_recompute_overhead_have_known_answers(live_server: Any) -> None:
    rng = np.random.default_rng(5)
    rows, per_step = [], []
    r_true = 0.25  # hardware = model × padding × 1.25
    for s in range(6):
        st = rng.uniform(0.5, 1.5, size=2)
        tokens = [int(t) for t in rng.integers(600, 1000, size=2)]
        padded = 1024
        flops = [4e11 * t / 1000 for t in tokens]
        hw = [4e11 * padded / 1000 * (1 + r_true) for _ in tokens] if s < 4 else [None, None]
        for r in range(2):
            rows.append(_row(r, s, float(st[r]), flops[r], hw[r], tokens[r], padded, old=s >= 4))
        per_step.append((float(np.median(st)), sum(flops), None if hw[0] is None else sum(hw), sum(tokens), 2 * padded))
    with live_server.client() as c:
        rid = c.register_run({"name": "hfu", "model_family": "f", "world_size": 2, "peak_flops": PEAK})
        c.ingest_rows(rid, rows[:8])  # steps 0-3: a current client
        c.ingest_rows(rid, rows[8:])  # steps 4-5: an old client (rows without hw_flops)
        live_server.compact()
        s = c.summary(rid)
    mfu = np.median([f / (2 * st) for st, f, _, _, _ in per_step]) / PEAK
    hfu = np.median([h / (2 * st) for st, _, h, _, _ in per_step if h is not None]) / PEAK
    assert s["mfu"] == pytest.approx(mfu, rel=1e-5)
    assert s["hfu"] == pytest.approx(hfu, rel=1e-5)
    with_hw = [p for p in per_step if p[2] is not None]
    padding = sum(p[4] for p in with_hw) / sum(p[3] for p in with_hw)
    expected_r = sum(p[2] for p in with_hw) / (sum(p[1] for p in with_hw) * padding) - 1  # type: ignore[misc]
    assert s["recompute_overhead"] == pytest.approx(expected_r, rel=1e-4)
    assert s["recompute_overhead"] == pytest.approx(r_true, rel=1e-4)  # by construction of the rows
    eng = make_engine(live_server.db_url, pool_size=1)
    try:
        with eng.connect() as conn:
            hw_col = [v for (v,) in conn.execute(text("SELECT hw_flops FROM steps WHERE run_id = :r ORDER BY step"),
                                                 {"r": rid})]
    finally:
        eng.dispose()
    assert [v is None for v in hw_col] == [False] * 4 + [True] * 2  # the old client's steps: not measured


def test_no_recomputation_means_no_recompute_overhead(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "no-ckpt", "model_family": "f", "world_size": 1, "peak_flops": PEAK})
        # hardware = model × padding exactly: padding only, no recomputation
        c.ingest_rows(rid, [_row(0, s, 1.0, 3e11 * 0.75, 3e11, 750, 1000) for s in range(3)])
        live_server.compact()
        s = c.summary(rid)
    assert s["hfu"] == pytest.approx(0.3, rel=1e-5) and s["mfu"] == pytest.approx(0.225, rel=1e-5)
    assert s["recompute_overhead"] is None


def test_fragments_landed_before_hw_flops_existed_read_as_not_measured(live_server: Any) -> None:
    """A fragment written by a server from before the field (its block ends at alloc_retries) decodes
    hw_flops as 0; compaction stores NULL, so HFU is absent rather than 0."""
    old_fields = FRAG_STEP_FIELDS[:-1]
    assert FRAG_STEP_FIELDS[-1][0] == "hw_flops"
    with live_server.client() as c:
        rid = c.register_run({"name": "old-frag", "model_family": "f", "world_size": 2, "peak_flops": PEAK})
    cols = {n: np.full(2, np.nan) for n, _ in old_fields}
    cols.update(step=np.zeros(2), rank=np.arange(2), flags=np.zeros(2), ts=np.full(2, 1.7e9), step_s=np.ones(2),
                compute_s=np.ones(2), other_s=np.zeros(2), flops=np.full(2, 2e11), tokens=np.full(2, 100.0))
    eng = make_engine(live_server.db_url, pool_size=1)
    try:
        with eng.begin() as conn:
            conn.execute(text("INSERT INTO ingest_fragments (run_id, n_rank_steps, n_collectives, step_min, step_max, "
                              "rank_steps) VALUES (:r, 2, 0, 0, 0, :b)"),
                         {"r": rid, "b": encode_block(old_fields, cols)})
        live_server.compact()
        with eng.connect() as conn:
            n_ranks, flops, hw = conn.execute(text("SELECT n_ranks, flops, hw_flops FROM steps WHERE run_id = :r"),
                                              {"r": rid}).one()
    finally:
        eng.dispose()
    assert (n_ranks, flops, hw) == (2, pytest.approx(4e11, rel=1e-6), None)
    with live_server.client() as c:
        s = c.summary(rid)
    assert s["mfu"] == pytest.approx(0.2, rel=1e-5) and s["hfu"] is None and s["recompute_overhead"] is None
