"""The formulas on small hand-made traces whose answers are worked out by hand (TRACE_FORMULAS.md),
the corrected variants beside HTA's, the interval helpers, and a real CPU torch.profiler trace."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from trace_testutil import cpu, kernel, launch, write_trace  # noqa: E402

from fleetscope.traces import intervals as iv  # noqa: E402
from fleetscope.traces import reduce_traces  # noqa: E402

DL = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def _two_step_events() -> list[dict[str, Any]]:
    return [
        cpu("ProfilerStep#1", 0, 100, "user_annotation"),
        cpu("ProfilerStep#2", 100, 100, "user_annotation"),
        cpu(DL, 0, 5, "user_annotation"),
        launch(5, 1),
        kernel("ampere_sgemm_128x64_nn", 10, 30, 7, 1),
        launch(8, 2),
        kernel(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 30, 30, 20, 2
        ),
        launch(50, 3),
        kernel("Memcpy HtoD (Pinned -> Device)", 60, 10, 7, 3, cat="gpu_memcpy"),
        launch(105, 4),
        kernel("ampere_sgemm_128x64_nn", 110, 40, 7, 4),
    ]


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    return write_trace(
        tmp_path / "t.json", _two_step_events(), meta={"distributedInfo": {"rank": 2, "world_size": 4}}
    )


def test_hand_computed_figures_default_mode(two_steps: Path) -> None:
    r = reduce_traces(two_steps)["ranks"]["2"]
    assert r["profiler_steps"] == [1]  # the last step and the kernel it launched are dropped
    assert (r["kernel_time_us"], r["idle_time_us"], r["compute_time_us"], r["non_compute_time_us"]) == (
        60,
        0,
        30,
        30,
    )
    assert (r["idle_pct"], r["compute_pct"], r["non_compute_pct"]) == (0.0, 50.0, 50.0)
    assert r["comm_time_us"] == 30 and r["comm_compute_overlap_us"] == 10 and r["comm_overlap_pct"] == 33.33
    idle = {(x["stream"], x["idle_category"]): x["idle_time_us"] for x in r["idle_breakdown"]}
    assert idle == {
        (7, "host_wait"): 20,
        (7, "other"): 0,
        (20, "other"): 0,
    }  # memcpy launched after sgemm ended
    kt = {x["kernel_type"]: x["time_us"] for x in r["kernel_types"]}
    assert kt == {
        "COMPUTATION": 20,
        "COMPUTATION overlapping COMMUNICATION": 10,
        "COMMUNICATION": 20,
        "MEMORY": 10,
    }
    (step,) = r["steps"]
    assert step["step"] == 1 and step["step_s"] == 100e-6
    # compute [10,40); exposed comm [40,60); data = DataLoader [0,5) + HtoD [60,70); the rest other
    assert (step["compute_s"], step["comm_exposed_s"], step["data_s"], step["other_s"]) == (
        30e-6,
        20e-6,
        15e-6,
        35e-6,
    )
    assert (
        step["idle_s"] == 40e-6
        and step["comm_total_s"] == 30e-6
        and step["overlap_ratio"] == pytest.approx(1 / 3, abs=1e-6)
    )


def test_hand_computed_figures_with_the_last_step(two_steps: Path) -> None:
    r = reduce_traces(two_steps, include_last_step=True)["ranks"]["2"]
    assert r["profiler_steps"] == [1, 2]
    assert (r["kernel_time_us"], r["idle_time_us"], r["compute_time_us"], r["non_compute_time_us"]) == (
        140,
        40,
        70,
        30,
    )
    assert r["steps"][1]["compute_s"] == 40e-6 and r["steps"][1]["idle_s"] == 60e-6


def test_float_timestamps_are_rounded_like_hta(tmp_path: Path) -> None:
    """ts → ceil(ts), end → floor(ts + dur): a kernel at 10.4 lasting 29.2 µs spans [11, 39)."""
    ev = [
        launch(1.5, 1),
        kernel("ampere_sgemm", 10.4, 29.2, 7, 1),
        launch(2.25, 2),
        kernel("ampere_sgemm", 50.6, 10.0, 7, 2),
    ]
    r = reduce_traces(write_trace(tmp_path / "f.json", ev))["ranks"]["0"]
    assert r["timestamps_rounded"] is True
    assert r["kernel_time_us"] == 60 - 11 and r["compute_time_us"] == 28 + 9


def test_integer_timestamps_with_float_durations_are_not_rounded(tmp_path: Path) -> None:
    ev = [launch(1, 1), kernel("ampere_sgemm", 10, 29.5, 7, 1)]
    r = reduce_traces(write_trace(tmp_path / "i.json", ev))["ranks"]["0"]
    assert r["timestamps_rounded"] is False and r["kernel_time_us"] == 29.5


def test_both_nccl_kernel_name_families_are_communication(tmp_path: Path) -> None:
    ev = [launch(1, 1), kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 10, 10, 20, 1),
          launch(2, 2), kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 30, 10, 21, 2),
          launch(3, 3), kernel("ampere_sgemm", 5, 30, 7, 3)]  # fmt: skip
    r = reduce_traces(write_trace(tmp_path / "n.json", ev))["ranks"]["0"]
    assert r["comm_time_us"] == 20 and r["comm_overlap_pct"] == 75.0  # [10,20) and [30,35) under compute


def test_hip_memcpy_flaw_has_a_corrected_figure(tmp_path: Path) -> None:
    """HTA's ``^hip`` rule calls hipMemcpy* communication; the corrected classification calls it memory."""
    ev = [
        launch(1, 1),
        kernel("ampere_sgemm", 0, 10, 7, 1),
        launch(2, 2),
        kernel("hipMemcpyWithStream", 5, 10, 8, 2),
    ]
    r = reduce_traces(write_trace(tmp_path / "h.json", ev))["ranks"]["0"]
    assert r["comm_overlap_pct"] == 50.0
    c = r["corrected_classification"]
    assert c["differs_from_hta"] is True and c["comm_overlap_pct"] is None and c["comm_time_us"] == 0


def test_no_communication_means_undefined_overlap(tmp_path: Path) -> None:
    r = reduce_traces(write_trace(tmp_path / "c.json", [launch(1, 1), kernel("ampere_sgemm", 0, 10, 7, 1)]))[
        "ranks"
    ]["0"]
    assert r["comm_overlap_pct"] is None and any("no communication" in n for n in r["notes"])
    assert r["corrected_classification"]["differs_from_hta"] is False


def _rank_events(start: float, dur: float, name: str) -> list[dict[str, Any]]:
    return [
        cpu("ProfilerStep#1", 0, 1000, "user_annotation"),
        cpu("ProfilerStep#2", 1000, 1000, "user_annotation"),
        launch(10, 1),
        kernel("ampere_sgemm", 20, start - 20, 7, 1),
        launch(20, 2),
        kernel(name, start, dur, 20, 2),
    ]


@pytest.mark.parametrize(
    ("name", "hta_finds"),
    [("ncclKernel_AllReduce_RING_LL_Sum_float", True), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", False)],
)
def test_late_start_straggler_and_the_ncclDevKernel_flaw(tmp_path: Path, name: str, hta_finds: bool) -> None:
    """Rank 1 starts its all-reduce 200 µs later; both finish together. HTA only knows ncclKernel*."""
    write_trace(tmp_path / "r0.json", _rank_events(500, 300, name), meta={"distributedInfo": {"rank": 0}})
    write_trace(tmp_path / "r1.json", _rank_events(700, 100, name), meta={"distributedInfo": {"rank": 1}})
    st = reduce_traces(tmp_path)["stragglers"]
    assert st["corrected"]["ranks"] == [1] and st["corrected"]["error"] is None
    if hta_finds:
        assert st["hta"]["ranks"] == [1]
    else:
        assert st["hta"]["ranks"] == [] and "empty sequence" in st["hta"]["error"]


def test_interval_helpers() -> None:
    s = iv.IntervalSet()
    for a, b in [(10, 20), (0, 5), (30, 40), (4, 11), (50, 50), (39, 45), (60, 70)]:
        s.add(a, b)
    assert s.clipped(-1e18, 1e18) == ([0, 30, 60], [20, 45, 70]) and len(s) == 3
    a = iv.from_pairs([(0, 10), (20, 30)])
    b = iv.from_pairs([(5, 25)])
    assert iv.intersect(a, b) == ([5, 20], [10, 25])
    assert iv.difference(a, b) == ([0, 25], [5, 30])
    assert iv.union(a, b) == ([0], [30])
    assert iv.clip(a, 7, 22) == ([7, 20], [10, 22])
    assert iv.measure(a) == 20
    assert iv.label_sweep({1: a, 2: b}) == {1: 10, 3: 10, 2: 10}


def test_real_cpu_profiler_trace_end_to_end(tmp_path: Path) -> None:
    """A small CPU job profiled with torch.profiler (schedule: 1 warm-up + 3 active steps)."""
    import torch
    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(128, 32), torch.randn(128, 4)), batch_size=16
    )
    out = tmp_path / "cpu_rank0.json"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:  # fmt: skip
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
            if i == 4:
                break
    default = reduce_traces(out)["ranks"]["0"]
    full = reduce_traces(out, include_last_step=True)["ranks"]["0"]
    assert default["timeline"] == "cpu" and default["kernel_time_us"] is None
    assert len(default["steps"]) == 2 and len(full["steps"]) == 3
    for st in full["steps"]:
        assert st["compute_s"] > 0 and st["data_s"] > 0
        parts = st["data_s"] + st["compute_s"] + st["comm_exposed_s"] + st["other_s"]
        assert abs(parts - st["step_s"]) < 1e-6 and st["other_s"] >= 0
