"""Network health (server/analysis/network.py) on hand-made collective blocks with known answers — no
database: one slow rank, one slow node, the threshold and the majority rule, classes kept apart, the
time-weighted ratio, too few peers, latency-only slowness, noise, and the per-node health rows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from fleetscope.server.analysis.network import (
    BUSBW_THRESHOLD,
    empty_network,
    network_health,
    node_health_rows,
    summary_network,
)

from fleetscope.wire import COLLECTIVE_OPS

MIB = 1 << 20
OP = {n: i for i, n in enumerate(COLLECTIVE_OPS)}
# (op, bytes per call, calls, seconds at normal speed, dim code): a large all-reduce (bandwidth) and a barrier (latency)
DEFAULT = (("all_reduce", 64 * MIB, 4, 0.8, 7), ("barrier", 0, 1, 0.01, 9))


def hosts(world: int, per_node: int) -> dict[int, tuple[str | None, str | None]]:
    return {r: (f"h{r // per_node}", f"node{r // per_node}") for r in range(world)}


def blocks(world: int, steps: int, *, records: tuple = DEFAULT, slow: Callable[[int, int, str], float] | None = None,
           noise: float = 0.0, seed: int = 0, group_size: int | None = None) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Per step, every rank issues ``records``; ``slow(step, rank, op)`` multiplies its seconds."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        cols: dict[str, list] = {k: [] for k in ("rank", "seq", "op", "group_size", "bytes", "calls", "total_s",
                                                 "exposed_s", "start_ts", "dim")}
        for r in range(world):
            for seq, (op, per_call, calls, secs, dim) in enumerate(records):
                f = slow(s, r, op) if slow else 1.0
                t = secs * f * (float(rng.lognormal(0, noise)) if noise else 1.0)
                for k, v in (("rank", r), ("seq", seq), ("op", OP[op]), ("group_size", group_size or world),
                             ("bytes", float(per_call * calls)), ("calls", calls), ("total_s", t),
                             ("exposed_s", t / 2), ("start_ts", 0.0), ("dim", dim)):
                    cols[k].append(v)
        out.append((s, {k: np.array(v) for k, v in cols.items()}))
    return out


def test_one_slow_rank_is_named_with_its_exact_ratios_and_its_node_is_not() -> None:
    h = hosts(16, 4)
    net = summary_network(network_health(blocks(16, 10, slow=lambda s, r, op: 2.0 if r == 5 else 1.0), h))
    (it,) = net["slow_ranks"]
    assert (it["rank"], it["node"], it["host"]) == (5, "node1", "h1")
    assert it["busbw_ratio"] == pytest.approx(0.5) and it["latency_ratio"] == pytest.approx(2.0)
    assert it["slow_by"] == ["busbw", "latency"] and it["busbw_slow_share"] == 1.0 and not it["node_flagged"]
    assert net["slow_nodes"] == []
    assert (net["ranks_measured"], net["nodes_measured"], net["steps_sampled"], net["classes"]) == (16, 4, 10, 2)
    assert net["busbw_ratio_min"] == pytest.approx(0.5)


def test_a_slow_node_is_named_once_with_every_rank_of_it() -> None:
    h = hosts(16, 4)
    slow = {4: 2.0, 5: 2.0, 6: 2.0, 7: 2.0}
    net = summary_network(network_health(blocks(16, 10, slow=lambda s, r, op: slow.get(r, 1.0)), h))
    assert net["slow_nodes"] == [{"node": "node1", "busbw_ratio": 0.5, "latency_ratio": 2.0, "ranks": 4, "slow_ranks": 4}]
    assert [it["rank"] for it in net["slow_ranks"]] == [4, 5, 6, 7]
    assert all(it["node_flagged"] for it in net["slow_ranks"])


def test_a_node_with_one_slow_gpu_of_four_is_not_slow_but_three_of_four_is() -> None:
    h = hosts(16, 4)
    one = summary_network(network_health(blocks(16, 8, slow=lambda s, r, op: 3.0 if r == 8 else 1.0), h))
    assert one["slow_nodes"] == [] and [it["rank"] for it in one["slow_ranks"]] == [8]
    three = summary_network(network_health(blocks(16, 8, slow=lambda s, r, op: 3.0 if r in (8, 9, 10) else 1.0), h))
    assert [n["node"] for n in three["slow_nodes"]] == ["node2"] and three["slow_nodes"][0]["slow_ranks"] == 3
    # the node's ratio is the median of its ranks': three at 1/3, one at 1
    assert three["slow_nodes"][0]["busbw_ratio"] == pytest.approx(1 / 3, abs=1e-4)


def test_the_threshold_and_the_majority_of_steps() -> None:
    h = hosts(16, 4)
    mild = network_health(blocks(16, 10, slow=lambda s, r, op: 1.25 if r == 3 else 1.0), h)  # ratio 0.8 > 0.7
    assert not mild.slow.any() and mild.busbw_ratio[3] == pytest.approx(0.8)
    edge = network_health(blocks(16, 10, slow=lambda s, r, op: 1.000001 / BUSBW_THRESHOLD if r == 3 else 1.0), h)
    assert list(np.flatnonzero(edge.slow)) == [3]  # just under 0.7 is slow
    few = network_health(blocks(16, 10, slow=lambda s, r, op: 2.0 if r == 3 and s < 5 else 1.0), h)  # 5 of 10
    assert not few.slow.any()
    most = network_health(blocks(16, 10, slow=lambda s, r, op: 2.0 if r == 3 and s < 6 else 1.0), h)  # 6 of 10
    assert list(np.flatnonzero(most.slow)) == [3]
    assert most.busbw_slow_steps[3] == 6 and most.busbw_steps[3] == 10


def test_classes_are_kept_apart() -> None:
    """Ranks 0-7 all-gather in dim 1 at 1 s, ranks 8-15 in dim 2 at 3 s: each is its class's median
    rank, so nobody is slow — mixed together, half the ranks would look 3x slower."""
    recs_a = (("all_gather", 16 * MIB, 1, 1.0, 1),)
    recs_b = (("all_gather", 16 * MIB, 1, 3.0, 2),)
    a, b = blocks(16, 6, records=recs_a), blocks(16, 6, records=recs_b)
    mixed = [(s, {k: np.where(da["rank"] < 8, da[k], db[k]) for k, _ in da.items()}) for (s, da), (_, db) in zip(a, b, strict=True)]
    h = network_health(mixed, hosts(16, 4))
    assert h.classes == 2 and not h.slow.any() and np.allclose(h.busbw_ratio, 1.0)
    # the group size is part of the class too
    c = blocks(16, 6, records=recs_b, group_size=8)
    mixed_n = [(s, {k: np.where(da["rank"] < 8, da[k], dc[k]) for k, _ in da.items()}) for (s, da), (_, dc) in zip(a, c, strict=True)]
    assert not network_health(mixed_n, hosts(16, 4)).slow.any()


def test_the_ratio_is_time_weighted_over_the_classes_of_a_rank() -> None:
    """Rank 2: 1 s in one class at normal speed, 0.3 s in another at 3x: (1 + 0.1) / (1 + 0.3)."""
    recs = (("all_reduce", 64 * MIB, 1, 1.0, 1), ("reduce_scatter", 8 * MIB, 1, 0.1, 1))
    h = network_health(blocks(8, 5, records=recs, slow=lambda s, r, op: 3.0 if r == 2 and op == "reduce_scatter" else 1.0),
                       hosts(8, 8))
    assert h.busbw_ratio[2] == pytest.approx(1.1 / 1.3) and not h.slow[2]


def test_a_class_with_too_few_peers_is_not_compared() -> None:
    h = network_health(blocks(2, 10, slow=lambda s, r, op: 3.0 if r == 1 else 1.0), hosts(2, 1))
    assert len(h.ranks) == 0
    assert summary_network(h) == {**empty_network(), "steps_sampled": 10}


def test_latency_only_slowness_and_ignored_records() -> None:
    recs = DEFAULT + (("other", 64 * MIB, 1, 9.0, 3),)  # 'other' has no busbw: never compared
    net = summary_network(network_health(
        blocks(16, 6, records=recs, slow=lambda s, r, op: 4.0 if r == 11 and op == "barrier" else 1.0), hosts(16, 4)))
    (it,) = net["slow_ranks"]
    assert it["rank"] == 11 and it["slow_by"] == ["latency"] and it["busbw_ratio"] == 1.0 and it["latency_ratio"] == 4.0
    assert net["classes"] == 2
    # zero / NaN durations are dropped, not divided by
    bad = blocks(16, 6)
    bad[0][1]["total_s"][:] = 0.0
    bad[1][1]["total_s"][:] = np.nan
    assert network_health(bad, hosts(16, 4)).busbw_steps.max() == 4


def test_noise_flags_nothing_and_a_slow_node_still_stands_out() -> None:
    h = hosts(128, 8)
    quiet = network_health(blocks(128, 30, noise=0.15, seed=1), h)
    assert not quiet.slow.any()
    noisy = summary_network(network_health(blocks(128, 30, noise=0.15, seed=2,
                                                   slow=lambda s, r, op: 1.6 if 40 <= r < 48 else 1.0), h))
    assert [n["node"] for n in noisy["slow_nodes"]] == ["node5"]


def test_no_collectives_give_the_empty_network() -> None:
    for bl in ([], [(0, None), (1, None)]):
        net = summary_network(network_health(bl, hosts(4, 2)))
        assert net["slow_ranks"] == [] and net["slow_nodes"] == [] and net["ranks_measured"] == 0
        assert set(empty_network()) == set(net)


def test_node_health_rows_count_stragglers_and_slow_network() -> None:
    h = {**hosts(12, 4), 12: (None, None)}  # a rank without a node is left out
    health = network_health(blocks(12, 6, slow=lambda s, r, op: 2.0 if r < 4 else 1.0), h)
    rows = node_health_rows(health, h, straggler_ranks=[9, 10, 12])
    assert [(r["node"], r["ranks"], r["straggler_ranks"], r["slow_ranks"], r["slow_network"]) for r in rows] == [
        ("node0", 4, 0, 4, True), ("node1", 4, 0, 0, False), ("node2", 4, 2, 0, False)]
    assert rows[0]["busbw_ratio"] == pytest.approx(0.5) and rows[1]["busbw_ratio"] == pytest.approx(1.0)
    unmeasured = node_health_rows(network_health([], h), h, [])
    assert all(r["busbw_ratio"] is None and not r["slow_network"] for r in unmeasured) and len(unmeasured) == 3
