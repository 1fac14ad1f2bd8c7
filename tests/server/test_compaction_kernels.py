"""The compactor's vectorised kernels against plain per-row / per-group reference computations:
many blocks decoded at once, many ranges encoded at once, distinct rows by counting, and the
per-(step, dimension) cross-rank medians of ``step_comm``."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.server.codec import (
    COLL_BLOCK_FIELDS,
    FRAG_COLL_FIELDS,
    FRAG_STEP_FIELDS,
    STEP_BLOCK_FIELDS,
    decode_block,
    decode_blocks,
    encode_block,
    encode_blocks,
)
from fleetscope.server.compactor import P2P_DIM, step_comm_rows
from fleetscope.server.grouped import unique_rows
from fleetscope.server.validate import OP_CODE


def _cols(fields, n, rng):
    return {name: (rng.normal(size=n) * 1e6 if np.dtype(dt).kind == "f" else rng.integers(0, 1000, n))
            for name, dt in fields}


@pytest.mark.parametrize("fields", [FRAG_STEP_FIELDS, FRAG_COLL_FIELDS, STEP_BLOCK_FIELDS, COLL_BLOCK_FIELDS])
def test_decode_blocks_equals_concatenated_decode_block(fields):
    rng = np.random.default_rng(0)
    blobs = [encode_block(fields, _cols(fields, int(rng.integers(0, 40)), rng), compress=bool(k % 2)) for k in range(7)]
    out, counts = decode_blocks(fields, blobs)
    ref = [decode_block(fields, b) for b in blobs]
    assert counts.tolist() == [len(r[fields[0][0]]) for r in ref]
    for name, _ in fields:
        want = np.concatenate([r[name] for r in ref])
        assert out[name].dtype == want.dtype
        np.testing.assert_array_equal(out[name], want)


def test_decode_blocks_fills_a_field_added_after_the_block_was_written():
    old_fields = COLL_BLOCK_FIELDS[:-1]
    blob = encode_block(old_fields, {n: np.arange(3) for n, _ in old_fields})
    out, _ = decode_blocks(COLL_BLOCK_FIELDS, [blob, encode_block(COLL_BLOCK_FIELDS, {n: np.ones(2) for n, _ in COLL_BLOCK_FIELDS})])
    last = COLL_BLOCK_FIELDS[-1][0]
    assert out[last].tolist() == [0, 0, 0, 1, 1]


def test_encode_blocks_gives_the_bytes_of_encode_block_per_range():
    rng = np.random.default_rng(1)
    cols = _cols(STEP_BLOCK_FIELDS, 120, rng)
    starts = np.array([0, 0, 17, 64, 64, 120])
    got = encode_blocks(STEP_BLOCK_FIELDS, cols, starts)
    assert len(got) == 5
    for i, blob in enumerate(got):
        a, b = starts[i], starts[i + 1]
        assert blob == encode_block(STEP_BLOCK_FIELDS, {k: v[a:b] for k, v in cols.items()})


@pytest.mark.parametrize("spread", [3, 70_000, 2**40])
def test_unique_rows_matches_numpy_unique(spread):
    rng = np.random.default_rng(spread)
    for _ in range(20):
        n = int(rng.integers(1, 2000))
        cols = [rng.integers(-5, spread, n), rng.integers(0, 7, n), rng.integers(-(2**31), 2**31, n) if spread > 3 else rng.integers(0, 3, n)]
        rows, inv = unique_rows(*cols)
        want, want_inv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
        np.testing.assert_array_equal(rows, want)
        np.testing.assert_array_equal(inv, want_inv.reshape(-1))
    rows, inv = unique_rows(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert rows.shape == (0, 2) and len(inv) == 0


def _naive_step_comm(C, cgid, gkeys, n_ranks):
    """Per (group, dim): each rank's summed calls / bytes / total / exposed (NaN exposed counts 0),
    the median over the step's ranks with ranks lacking a call in that dim counting 0; send/recv
    also under P2P_DIM."""
    p2p_codes = {OP_CODE["send"], OP_CODE["recv"]}
    per: dict[tuple[int, int], dict[int, np.ndarray]] = {}
    for i in range(len(cgid)):
        v = np.array([C["calls"][i], C["bytes"][i], C["total_s"][i], np.nan_to_num(C["exposed_s"][i])])
        dims = [int(C["dim"][i])] + ([P2P_DIM] if int(C["op"][i]) in p2p_codes else [])
        for d in dims:
            cell = per.setdefault((int(cgid[i]), d), {})
            cell[int(C["rank"][i])] = cell.get(int(C["rank"][i]), 0) + v
    out = []
    for (g, d) in sorted(per):
        vals = list(per[(g, d)].values())
        n = max(int(n_ranks[g]), len(vals))
        m = np.zeros((n, 4))
        m[: len(vals)] = vals
        key = int(gkeys[g])
        out.append((key >> 32, key & 0xFFFFFFFF, d, *np.median(m, axis=0).tolist()))
    return out


def test_step_comm_rows_matches_per_group_medians():
    rng = np.random.default_rng(3)
    ops = [OP_CODE["all_reduce"], OP_CODE["all_gather"], OP_CODE["send"], OP_CODE["recv"]]
    for _ in range(60):
        n_groups, world = int(rng.integers(1, 12)), int(rng.integers(1, 30))
        recs = [(g, r, s) for g in range(n_groups) for r in range(world) if rng.random() > 0.2
                for s in range(int(rng.integers(0, 5)))]
        if not recs:
            continue
        a = np.array(recs)
        n = len(a)
        C = {"rank": a[:, 1], "seq": a[:, 2], "dim": rng.integers(0, 3, n) * 1_000_003, "op": rng.choice(ops, n),
             "calls": rng.integers(1, 4, n).astype(float), "bytes": rng.integers(0, 10_000, n).astype(float),
             "total_s": rng.random(n), "exposed_s": np.where(rng.random(n) < 0.1, np.nan, rng.random(n))}
        gkeys = (np.arange(n_groups, dtype=np.int64) + 5) * (1 << 32) + np.arange(n_groups) * 7
        n_ranks = rng.integers(0, world + 3, n_groups)
        got = step_comm_rows(C, a[:, 0], gkeys, n_ranks)
        want = _naive_step_comm(C, a[:, 0], gkeys, n_ranks)
        assert [r[:3] for r in got] == [r[:3] for r in want]
        np.testing.assert_allclose(np.array([r[3:] for r in got]), np.array([r[3:] for r in want]), rtol=1e-12)


@pytest.mark.parametrize("uniform", [True, False])
def test_grouped_argmax_matches_a_sort(uniform):
    from fleetscope.server.grouped import grouped_argmax

    rng = np.random.default_rng(4)
    for _ in range(50):
        sizes = np.full(int(rng.integers(1, 9)), int(rng.integers(1, 6))) if uniform else rng.integers(1, 6, int(rng.integers(1, 9)))
        ids = np.sort(rng.choice(100, len(sizes), replace=False))
        gid = np.repeat(ids, sizes)
        v = rng.integers(0, 3, len(gid)).astype(float)  # many ties
        for last in (False, True):
            want = []
            for g in ids:
                rows = np.flatnonzero(gid == g)
                best = rows[v[rows] == v[rows].max()]
                want.append(best[-1] if last else best[0])
            assert grouped_argmax(v, gid, last=last).tolist() == want
