"""Overlap and bucketing guidance (server/analysis/overlap.py) on synthetic timelines with known answers:
where backward lies, which collectives are gradient reductions, the tail after backward, overlap,
the per-call overhead fit, and each suggestion with its upper-bound gain."""

from __future__ import annotations

import numpy as np
import pytest
from fleetscope.server.analysis import overlap as ov
from fleetscope.server.analysis.overlap import Collective, RankStep

TS = 1000.0
TOP = [{"component": "comm_exposed", "share": 0.3}, {"component": "compute", "share": 0.6}]


def _ddp_step(step: int, *, issues: list[float], sizes: list[float], alpha: float, beta: float, data: float,
              forward: float, backward: float, optimizer: float, other: float) -> tuple[RankStep, list[Collective]]:
    """A DDP rank-step as the agent records it: buckets issued at ``issues`` (s from the step start) run
    one after the other (service α + β·bytes); the reducer waits after the last issue, and that wait is
    split over the buckets that complete after it (collective_stats._ddp_tail). Backward's busy time
    ends at the last issue; the wait comes next, then the optimizer and other time."""
    ends, prev = [], 0.0
    for t, b in zip(issues, sizes, strict=True):
        prev = max(prev, t) + alpha + beta * b
        ends.append(prev)
    covered, exposed = issues[-1], [0.0] * len(issues)
    for i in sorted(range(len(ends)), key=lambda i: ends[i]):
        if ends[i] > covered:
            exposed[i] = min(ends[i] - issues[i], ends[i] - covered)
            covered = ends[i]
    tail = sum(exposed)
    assert issues[-1] == pytest.approx(data + forward + backward)  # the fixture is what the test thinks it is
    step_s = data + forward + backward + tail + optimizer + other
    rs = RankStep(step, 0, TS, step_s, data, forward, backward, optimizer, other, tail, sum(e - t for e, t in zip(ends, issues, strict=True)))
    colls = [Collective("all_reduce", "world", 8, b, 1, TS + t, e - t, x)
             for t, b, e, x in zip(issues, sizes, ends, exposed, strict=True)]
    return rs, colls


def test_ddp_buckets_are_placed_in_backward_with_the_tail_after_it() -> None:
    # backward 30..70 ms; buckets of 1 MB at 40, 50, 60, 70 ms, 8 ms each (the last one 15 ms)
    rs = RankStep(3, 1, TS, 0.100, 0.010, 0.020, 0.040, 0.010, 0.005, 0.015, 0.039)
    colls = [Collective("all_reduce", "dp", 2, 1e6, 1, TS + t, d, x)
             for t, d, x in ((0.040, 0.008, 0), (0.050, 0.008, 0), (0.060, 0.008, 0), (0.070, 0.015, 0.015))]
    tl = ov.timeline(rs, colls)
    d = tl.as_dict()
    assert d["step"] == 3 and d["rank"] == 1
    assert d["backward"]["start_s"] == pytest.approx(0.030)  # data + forward: no wait before it
    assert d["backward"]["end_s"] == pytest.approx(0.070)  # the last bucket's issue
    assert d["backward"]["end"] == "last gradient reduction issued" and d["backward"]["start"] == "estimated"
    assert [c["phase"] for c in d["collectives"]] == ["backward"] * 4
    assert all(c["gradient"] for c in d["collectives"])
    assert [c["start_s"] for c in d["collectives"]] == pytest.approx([0.040, 0.050, 0.060, 0.070])
    assert [c["end_s"] for c in d["collectives"]] == pytest.approx([0.048, 0.058, 0.068, 0.085])
    assert d["tail_s"] == pytest.approx(0.015)
    assert d["overlap_ratio"] == pytest.approx(1 - 0.015 / 0.039)
    assert d["backward_overlap_ratio"] == pytest.approx(1 - 0.015 / 0.039)
    assert sum(c["exposed_s"] for c in d["collectives"]) == pytest.approx(rs.comm_exposed_s)


def test_fsdp_gathers_and_reduce_scatters_are_split_by_phase() -> None:
    # forward all-gather waited for at once (0..10 ms), forward busy 30 ms → backward starts at 40 ms with
    # an exposed all-gather (40..46 ms); reduce-scatters issued at 60 ms (hidden) and at 86 ms, when
    # backward's 40 ms of compute are done, waited for whole (86..98 ms); then the optimizer
    rs = RankStep(7, 0, TS, 0.110, float("nan"), 0.030, 0.040, 0.010, 0.002, 0.028, 0.050, mem_peak_bytes=2e9)
    colls = [Collective("all_gather", "dp", 4, 8e6, 1, TS + 0.000, 0.010, 0.010),
             Collective("all_gather", "dp", 4, 8e6, 1, TS + 0.040, 0.006, 0.006),
             Collective("reduce_scatter", "dp", 4, 8e6, 1, TS + 0.060, 0.010, 0.0),
             Collective("reduce_scatter", "dp", 4, 8e6, 1, TS + 0.086, 0.012, 0.012),
             Collective("all_reduce", "tp", 2, 1e3, 1, TS + 0.102, 0.001, 0.001)]  # after backward (optimizer)
    tl = ov.timeline(rs, colls)
    assert tl.backward == pytest.approx((0.040, 0.086))
    assert [c.phase for c in tl.collectives] == ["before_backward", "backward", "backward", "backward", "after_backward"]
    assert [c.gradient for c in tl.collectives] == [False, False, True, True, False]
    assert tl.tail_s == pytest.approx(0.012)
    assert tl.overlap_ratio == pytest.approx(1 - 0.029 / 0.039)
    assert tl.backward_overlap_ratio == pytest.approx(1 - 0.018 / 0.028)

    # the device's memory unknown: keeping parameters unsharded is not advised blindly — its cost is said
    # (withheld) and backward prefetch (one more unit gathered at a time) is advised instead
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=0.028, step_s=0.110, mem_peak_bytes=2e9)
    assert [a["setting"] for a in advice] == ["fully_shard units", "set_modules_to_forward_prefetch",
                                              "set_modules_to_backward_prefetch", "reshard_after_forward"]
    assert [a["expected_gain_s"] for a in advice] == pytest.approx([0.012, 0.010, 0.006, 0.0])
    assert [a["expected_gain_share"] for a in advice] == pytest.approx([0.012 / 0.110, 0.010 / 0.110, 0.006 / 0.110, 0])
    assert all(a["bound"] == "upper" for a in advice)
    prefetch, reshard = advice[2], advice[3]
    assert "set_modules_to_backward_prefetch" in prefetch["suggestion"] and "reshard_after_forward=False" not in (
        prefetch["suggestion"])
    assert reshard["suggestion"] is None and reshard["withheld"]
    assert "~6 MB more per rank" in reshard["withheld"]  # 8 MB gathered × 3/4
    assert "the peak is 2 GB" in reshard["withheld"] and "not reported" in reshard["withheld"]


def test_other_time_before_forward_and_collectives_of_other_dimensions() -> None:
    # 3 ms of other time (a host-to-device copy) before forward: backward really runs 13..33 ms, the
    # estimate starts it 3 ms early, yet the last bucket (33 ms) is still found and ends backward
    rs = RankStep(2, 0, TS, 0.052, float("nan"), 0.010, 0.020, 0.005, 0.003, 0.014, 0.030)
    colls = [Collective("all_reduce", "dp", 2, 4e6, 1, TS + 0.020, 0.006, 0.0),
             Collective("all_reduce", "dp", 2, 4e6, 1, TS + 0.027, 0.006, 0.0),
             Collective("all_reduce", "tp", 2, 1e4, 1, TS + 0.030, 0.001, 0.0),  # a TP all-reduce in backward
             Collective("all_reduce", "dp", 2, 4e6, 1, TS + 0.033, 0.014, 0.014)]
    tl = ov.timeline(rs, colls)
    assert tl.backward == pytest.approx((0.010, 0.033)) and tl.backward_end_measured
    assert [c.gradient for c in tl.collectives] == [True, True, False, True]
    assert [c.phase for c in tl.collectives] == ["backward"] * 4
    assert tl.tail_s == pytest.approx(0.014)
    # an all-reduce issued after the optimizer is no gradient reduction, even with a lot of other time
    late = RankStep(2, 0, TS, 0.5, float("nan"), 0.010, 0.020, 0.005, 0.451, 0.015, 0.031)
    tl = ov.timeline(late, [*colls, Collective("all_reduce", "dp", 2, 4e6, 1, TS + 0.060, 0.001, 0.001)])
    assert tl.backward == pytest.approx((0.010, 0.033))
    assert [c.phase for c in tl.collectives][-1] == "after_backward" and not tl.collectives[-1].gradient
    assert tl.tail_s == pytest.approx(0.014)


def test_a_step_without_backward_or_with_calls_before_it_is_placed_honestly() -> None:
    rs = RankStep(1, 0, TS, 0.05, comm_exposed_s=0.01, comm_total_s=0.02)  # manual step: no phases
    tl = ov.timeline(rs, [Collective("all_reduce", "world", 2, 1e6, 1, TS + 0.01, 0.02, 0.01),
                          Collective("broadcast", "world", 2, 1e3, 1, TS - 0.5, 0.001, 0.001),  # before the step
                          Collective("all_reduce", "world", 2, 1e6, 1, float("nan"), 0.02, 0.0)])  # no issue time
    assert tl.backward is None and tl.tail_s is None
    assert [c.phase for c in tl.collectives] == ["unknown", "before_step"]
    assert tl.overlap_ratio == pytest.approx(0.5)  # the in-step call only
    assert ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=0.01, step_s=0.05) == []


def test_backward_estimate_without_gradient_reductions_skips_the_waits() -> None:
    # all-gathers only: backward = data + forward .. + backward busy, both ends pushed by the waits before
    rs = RankStep(0, 0, TS, 0.1, 0.005, 0.010, 0.020, 0.005)
    colls = [Collective("all_gather", "dp", 2, 1e6, 1, TS + 0.002, 0.004, 0.004),  # a wait inside data+forward
             Collective("all_gather", "dp", 2, 1e6, 1, TS + 0.025, 0.003, 0.003)]  # inside backward
    tl = ov.timeline(rs, colls)
    assert tl.backward == pytest.approx((0.019, 0.042))
    assert not tl.backward_end_measured and tl.tail_s == 0.0


def test_pickers() -> None:
    sb = {"rank": np.array([0, 1, 2, 3, 4]), "step_s": np.array([0.5, 0.1, 0.3, 0.2, np.nan])}
    assert ov.median_rank(sb) == 3  # 0.1, 0.2, 0.3, 0.5 → the lower median 0.2
    assert ov.median_rank({"rank": np.array([2]), "step_s": np.array([np.nan])}) is None
    assert ov.representative_step([10, 11, 12, 13, 14], [0.9, 0.2, 0.3, 0.1, 0.3]) == 14  # median 0.3: latest of 12, 14
    assert ov.representative_step([], []) is None


def test_latency_fit_recovers_the_alpha_beta_model() -> None:
    sizes = [1e5, 2e5, 5e5, 1e6, 4e6]
    a, b = ov.latency_fit([(x, 2e-3 + x / 5e9) for x in sizes]) or (None, None)
    assert a == pytest.approx(2e-3) and b == pytest.approx(1 / 5e9)
    assert ov.latency_fit([(1e6, 0.01)] * 5) is None  # one size: overhead and bandwidth cannot be told apart
    assert ov.latency_fit([(1e5, 0.01), (1e6, 0.01)]) is None  # too few calls
    assert ov.latency_fit([(1e5, 0.012), (1e6, 0.010), (2e6, 0.011)]) == pytest.approx((0.011, 0.0))  # size-independent


def test_many_small_buckets_get_fewer_larger_ones() -> None:
    alpha, beta = 1e-3, 1e-9  # 1 ms per call, 1 GB/s
    sizes = [1e5 * (i + 1) for i in range(10)]  # 100 kB .. 1 MB, 5.5 MB in all
    tls, tails = [], []
    for s in range(5):
        rs, colls = _ddp_step(s, issues=[0.020 + 0.002 * i for i in range(10)], sizes=sizes, alpha=alpha, beta=beta,
                              data=0.0, forward=0.011, backward=0.027, optimizer=0.004, other=0.001)
        tl = ov.timeline(rs, colls)
        tails.append(tl.tail_s)
        assert tl.tail_s == pytest.approx(rs.comm_exposed_s)  # DDP: every exposed second is after the last issue
        tls.append(tl)
    step_s = 0.08
    advice = ov.overlap_advice(tls, bottlenecks=TOP, comm_exposed_s=tails[0], step_s=step_s)
    assert [a["setting"] for a in advice] == ["bucket_cap_mb"]
    a = advice[0]
    assert a["expected_gain_s"] == pytest.approx(min(tails[0], 9 * alpha))  # (calls − 1) × overhead, ≤ exposed
    assert a["expected_gain_share"] == pytest.approx(a["expected_gain_s"] / step_s)
    assert a["suggestion"].startswith("raise bucket_cap_mb to about 5.2 ")  # 9α/β = 9 MB, capped at all 5.5 MB
    assert "per-call overhead ≈ 1 ms × 10 calls" in a["why"] and "1.75 GB/s bus bandwidth" in a["why"]  # 1 GB/s × 2·7/8


def test_a_bandwidth_bound_tail_gets_smaller_buckets_and_what_cannot_be_hidden() -> None:
    alpha, beta = 1e-4, 1e-9
    sizes = [10e6, 10e6, 10e6]  # 10 ms each
    # backward 10..40 ms, buckets issued at 20, 30 and 40 ms: 30 ms of all-reduce in a 30 ms backward
    rs, colls = _ddp_step(0, issues=[0.020, 0.030, 0.040], sizes=sizes, alpha=alpha, beta=beta, data=0.0,
                          forward=0.010, backward=0.030, optimizer=0.005, other=0.0)
    tl = ov.timeline(rs, colls)
    assert tl.backward == pytest.approx((0.010, 0.040))
    assert tl.tail_s == pytest.approx(0.0103)
    facts = {"bucket_cap_bytes": 10_000_000, "first_bucket_bytes": 10_000_000, "largest_grad_bytes": 1_000_000}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts)
    assert [a["setting"] for a in advice] == ["bucket_cap_mb"]
    assert advice[0]["suggestion"].startswith("lower bucket_cap_mb to about 4.8 ")  # half of 10 MB in MiB
    assert advice[0]["expected_gain_s"] == pytest.approx(0.0103 - 0.0003)  # 30.3 ms of comm in 30 ms of backward

    # the same comm in a 15 ms backward: 15.3 ms cannot overlap whatever the buckets
    rs, colls = _ddp_step(0, issues=[0.015, 0.020, 0.025], sizes=sizes, alpha=alpha, beta=beta, data=0.0,
                          forward=0.010, backward=0.015, optimizer=0.005, other=0.0)
    tl = ov.timeline(rs, colls)
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts)
    by = {a["setting"]: a for a in advice}
    assert set(by) == {"bucket_cap_mb", "gradient bytes"}
    assert by["gradient bytes"]["expected_gain_s"] == pytest.approx(0.0153)
    assert by["bucket_cap_mb"]["expected_gain_s"] == pytest.approx(tl.tail_s - 0.0153)
    assert "bf16_compress_hook" in by["gradient bytes"]["suggestion"]


def test_advice_only_where_exposed_comm_is_a_top_bottleneck() -> None:
    rs, colls = _ddp_step(0, issues=[0.020, 0.030, 0.040], sizes=[10e6] * 3, alpha=1e-4, beta=1e-9, data=0.0,
                          forward=0.010, backward=0.030, optimizer=0.005, other=0.0)
    tl = ov.timeline(rs, colls)
    third = [{"component": "compute", "share": 0.6}, {"component": "data", "share": 0.2},
             {"component": "comm_exposed", "share": 0.08}]
    assert ov.overlap_advice([tl], bottlenecks=third, comm_exposed_s=0.004, step_s=0.05) == []
    assert ov.comm_is_top(third, 0.006, 0.05)  # 12 % of the step by the decomposition
    assert ov.comm_is_top([{"component": "data"}, {"component": "comm_exposed", "share": 0.01}], None, None)
    assert not ov.comm_is_top([], None, None)
    assert ov.overlap_advice([tl], bottlenecks=third, comm_exposed_s=0.006, step_s=0.05)
    # a gain under 1 % of the step is no suggestion
    assert ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=0.006, step_s=100.0) == []


def _tail_step(sizes: list[float]) -> tuple[RankStep, ov.Timeline]:
    """Buckets of ``sizes`` bytes issued 10 ms apart in a backward as long as their all-reduces (1 GB/s):
    the last one's all-reduce is left after backward."""
    n = len(sizes)
    issues = [0.010 + 0.010 * (i + 1) for i in range(n)]
    rs, colls = _ddp_step(0, issues=issues, sizes=sizes, alpha=1e-4, beta=1e-9, data=0.0, forward=0.010,
                          backward=0.010 * n, optimizer=0.005, other=0.0)
    return rs, ov.timeline(rs, colls)


def test_no_bucket_cap_below_the_largest_gradient_tensor() -> None:
    # the issue's case: three 16 MiB gradients, one per bucket — DDP cannot split a parameter, so "lower
    # bucket_cap_mb to about 8" is impossible: withheld, with the reason, and bf16 / fewer syncs instead
    mib16 = float(16 << 20)
    rs, tl = _tail_step([mib16] * 3)
    assert tl.tail_s and tl.tail_s > 0.01
    facts = {"bucket_cap_bytes": 25 << 20, "first_bucket_bytes": 1 << 20, "largest_grad_bytes": 16 << 20,
             "gradient_as_bucket_view": False}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts)
    given = [a for a in advice if not a.get("withheld")]
    (held,) = [a for a in advice if a.get("withheld")]
    assert held["setting"] == "bucket_cap_mb" and held["suggestion"] is None
    assert "cannot split one parameter" in held["withheld"] and "16 MiB" in held["withheld"]
    assert [a["setting"] for a in given] == ["gradient bytes"]
    assert "bf16_compress_hook" in given[0]["suggestion"] and given[0]["expected_gain_s"] == pytest.approx(tl.tail_s)
    assert not any("lower bucket_cap_mb" in str(a["suggestion"]) for a in advice)

    # a largest tensor of 10 MiB: the cap goes down to it, not to half the bucket
    facts10 = {**facts, "largest_grad_bytes": 10 << 20}
    rs, tl = _tail_step([float(24 << 20)] * 3)
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts10)
    (a,) = [a for a in advice if a["setting"] == "bucket_cap_mb"]
    assert a["suggestion"].startswith("lower bucket_cap_mb to about 12 ")  # half of 24 MiB ≥ 10 MiB
    assert "now bucket_cap_mb = 25, 3 buckets of 24 MiB" in a["suggestion"]
    assert "largest gradient tensor (10 MiB)" in a["why"] and "gradient_as_bucket_view is off" in a["why"]
    facts20 = {**facts, "largest_grad_bytes": 16 << 20}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts20)
    (a,) = [a for a in advice if a["setting"] == "bucket_cap_mb"]
    assert a["suggestion"].startswith("lower bucket_cap_mb to about 16 ")  # clamped to the largest tensor
    # the gain shrinks with the cut: 24 → 16 MiB removes at most two thirds of what halving would
    full = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts10)
    g_full = next(x for x in full if x["setting"] == "bucket_cap_mb")["expected_gain_s"]
    assert a["expected_gain_s"] == pytest.approx(g_full * 8 / 12)


def test_bucket_size_advice_needs_the_recorded_facts_and_skips_the_first_bucket() -> None:
    rs, tl = _tail_step([float(24 << 20)] * 3)
    # an agent that recorded no DDP facts: "unknown", no smaller-bucket advice
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s)
    assert "bucket_cap_mb" not in [a["setting"] for a in advice if not a.get("withheld")]
    (held,) = [a for a in advice if a.get("withheld")]
    assert "largest gradient tensor is unknown" in held["withheld"]
    # DDP's 1 MiB first bucket is not a bucket of the cap's size: left out of the mean
    rs, tl = _tail_step([float(1 << 20)] + [float(24 << 20)] * 3)
    facts = {"bucket_cap_bytes": 25 << 20, "first_bucket_bytes": 1 << 20, "largest_grad_bytes": 4 << 20}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, ddp=facts)
    (a,) = [a for a in advice if a["setting"] == "bucket_cap_mb"]
    assert "3 buckets of 24 MiB on average besides the first bucket (≤ 1 MiB)" in a["suggestion"]
    assert a["suggestion"].startswith("lower bucket_cap_mb to about 12 ")


def test_fsdp_units_advice_from_the_unit_sizes() -> None:
    # reduce-scatters issued in backward, the last one left after it
    rs, colls = _ddp_step(0, issues=[0.020, 0.030, 0.040], sizes=[10e6] * 3, alpha=1e-4, beta=1e-9, data=0.0,
                          forward=0.010, backward=0.030, optimizer=0.005, other=0.0)
    colls = [ov.Collective("reduce_scatter", c.dim, c.group_size, c.bytes, c.calls, c.start_ts, c.total_s, c.exposed_s)
             for c in colls]
    tl = ov.timeline(rs, colls)
    even = {"units": 4, "largest_unit_bytes": 40 << 20, "smallest_unit_bytes": 30 << 20}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, fsdp=even)
    (held,) = [a for a in advice if a.get("withheld")]
    assert held["setting"] == "fully_shard units" and "similar size" in held["withheld"]
    uneven = {"units": 2, "largest_unit_bytes": 400 << 20, "smallest_unit_bytes": 10 << 20}
    advice = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=tl.tail_s, step_s=rs.step_s, fsdp=uneven)
    (a,) = [a for a in advice if a["setting"] == "fully_shard units"]
    assert not a.get("withheld") and "now 2 units, the largest 400 MiB" in a["suggestion"]


def _fsdp_backward_gathers() -> tuple[RankStep, ov.Timeline]:
    """An FSDP step whose four 80 MB backward all-gathers (group of 8) expose 24 ms, peak 60 GB."""
    rs = RankStep(3, 0, TS, 0.200, 0.0, 0.050, 0.100, 0.010, 0.010, 0.030, 0.060, mem_peak_bytes=60e9)
    colls = [Collective("all_gather", "dp", 8, 80e6, 1, TS + 0.050 + 0.025 * i, 0.008, 0.006) for i in range(4)]
    colls += [Collective("reduce_scatter", "dp", 8, 80e6, 1, TS + 0.174, 0.010, 0.006)]
    return rs, ov.timeline(rs, colls)


def test_keeping_parameters_unsharded_is_advised_only_within_the_device_memory() -> None:
    rs, tl = _fsdp_backward_gathers()

    def advise(total: float | None, fsdp: dict | None = None) -> dict[str, dict]:
        out = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=0.030, step_s=rs.step_s, mem_peak_bytes=60e9,
                                device_total_bytes=total, fsdp=fsdp)
        return {a["setting"]: a for a in out}

    # 80 GB device: 60 GB + 4 × 70 MB fits in 90 % of it — advised for every block, the fit shown
    a = advise(80e9)["reshard_after_forward"]
    assert not a.get("withheld") and "for at most" not in a["suggestion"]
    assert a["expected_gain_s"] == pytest.approx(0.024) and "≤ 90% of the device's 80 GB" in a["why"]
    # 60.2 GB usable: two of the four units fit, half the gain; never the whole model
    a = advise(60.2e9 / 0.9)["reshard_after_forward"]
    assert "for at most 2 of the 4 blocks" in a["suggestion"] and a["expected_gain_s"] == pytest.approx(0.012)
    # the unit sizes recorded by the agent bound it: 150 MB units (131 MB more each) → one fits
    a = advise(60.2e9 / 0.9, {"units": 4, "largest_unit_bytes": 150e6, "smallest_unit_bytes": 150e6})
    assert "for at most 1 of the 4 blocks" in a["reshard_after_forward"]["suggestion"]
    # room for one unit only (1/4 of the gain, still ≥ 1 % of the step: advised for that one)
    assert "for at most 1 of the 4 blocks" in advise(60.1e9 / 0.9)["reshard_after_forward"]["suggestion"]
    # a full device: withheld with its cost — and backward prefetch too (it holds one more unit gathered)
    full = advise(60.05e9 / 0.9)
    assert full["reshard_after_forward"]["withheld"] and "no room for even one unit" in full["reshard_after_forward"]["why"]
    assert full["set_modules_to_backward_prefetch"]["withheld"] and "one more unit gathered" in (
        full["set_modules_to_backward_prefetch"]["why"])
    assert all(a["suggestion"] is None for a in full.values() if "reshard" in a["setting"] or "backward" in a["setting"])
    # device memory unknown: backward prefetch advised (its cost said), resharding withheld
    blind = advise(None)
    assert blind["reshard_after_forward"]["withheld"] and "not advised blindly" in blind["reshard_after_forward"]["why"]
    assert blind["set_modules_to_backward_prefetch"]["expected_gain_s"] == pytest.approx(0.024)
    assert "~70 MB per rank" in blind["set_modules_to_backward_prefetch"]["why"]  # 80 MB × 7/8
    # the peak not measured: not advised either
    out = ov.overlap_advice([tl], bottlenecks=TOP, comm_exposed_s=0.030, step_s=rs.step_s, device_total_bytes=80e9)
    (held,) = [x for x in out if x.get("withheld")]
    assert held["setting"] == "reshard_after_forward" and "peak memory was not measured" in held["withheld"]
