"""Kernel hotspots (``GET /api/v1/runs/{id}/kernels``) through the real server: trace summaries reduced
from real Kineto traces (tests/data/kineto, an A100 recommendation-model job) arrive as the agent's
``trace_summary`` events, are folded once into the bounded per-run tables and reported with known
answers — totals and shares per kernel, categories, trend (first vs last window) and rank spread —
recomputed here independently from the summaries."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "traces"))

from fleetscope.agent.tracing import json_safe  # noqa: E402
from fleetscope.server.analysis.kernels import MAX_NAME_CHARS  # noqa: E402
from trace_testutil import KINETO  # noqa: E402

from fleetscope.traces import reduce_trace  # noqa: E402

NCCL = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
EMB = "split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1"
STEPS = 2  # profiled steps per window
OTHERS = {"COMPUTATION": "(other kernels)", "COMMUNICATION": "(other comm kernels)", "MEMORY": "(other memcpy kernels)"}


def _summary(rank: int) -> dict[str, Any]:
    src = KINETO / "hta_sampled_2rank" / f"sampled_rank-{rank}.json.gz"
    assert src.is_file(), f"Kineto trace missing: {src}"
    return json_safe(reduce_trace(src, rank=rank, include_last_step=True))


def _scaled(summary: dict[str, Any], match: str, factor: float) -> dict[str, Any]:
    out = copy.deepcopy(summary)
    hit = [k for k in out["top_kernels"] if match in k["name"]]
    assert hit, match
    for k in hit:
        k["sum_us"] *= factor
    return out


def _event(rank: int, seq: int, step: int, summary: dict[str, Any]) -> dict[str, Any]:
    """What agent/tracing.py submits (agent/run.py sends it as a ``trace_summary`` event)."""
    return {"rank": rank, "seq": seq, "kind": "trace_summary", "ts": 1.7e9 + step, "step": step,
            "data": {"first_step": step, "active_steps": STEPS, "trace_bytes": 1, "summary": summary}}


def _per_name(summary: dict[str, Any]) -> dict[str, tuple[float, int]]:
    out: dict[str, tuple[float, int]] = {}
    for k in summary["top_kernels"]:
        name = OTHERS[k["kernel_type"]] if k["name"] == "others" else k["name"][:MAX_NAME_CHARS]  # names are cut
        us, n = out.get(name, (0.0, 0))
        out[name] = (us + k["sum_us"], n + k["count"])
    return out


@pytest.fixture(scope="module")
def windows() -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, step) → summary: ranks 0 and 1 as traced (an A100 DLRM job); rank 2 is rank 0 with 1.6×
    the embedding backward; at step 200 every rank's NCCL kernel takes 1.5× longer than at step 100."""
    s0, s1 = _summary(0), _summary(1)
    s2 = _scaled(s0, EMB, 1.6)
    base = {0: s0, 1: s1, 2: s2}
    return {**{(r, 100): s for r, s in base.items()}, **{(r, 200): _scaled(s, "ncclKernel_SendRecv", 1.5)
                                                         for r, s in base.items()}}


def _get(c: Any, rid: int, **params: Any) -> dict[str, Any]:
    return c.get(f"/api/v1/runs/{rid}/kernels", **params)


def test_kernel_hotspots_across_ranks_and_windows(live_server: Any, windows: dict[tuple[int, int], dict[str, Any]]) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "kern", "model_family": "dlrm", "world_size": 4})
        evs = [_event(r, 10 + st // 100, st, s) for (r, st), s in windows.items()]
        c.ingest({"v": 1, "run_id": rid, "events": evs[:3]})  # windows arrive over time
        first = _get(c, rid, top=200)
        c.ingest({"v": 1, "run_id": rid, "events": evs[3:]})
        rep = _get(c, rid, top=200)
        again = _get(c, rid, top=200)

    assert first["folded_now"] == 3 and rep["folded_now"] == 3 and again["folded_now"] == 0
    assert {k: v for k, v in again.items() if k != "folded_now"} == {k: v for k, v in rep.items() if k != "folded_now"}
    assert (rep["ranks"], rep["windows"], rep["profiled_rank_steps"]) == (3, 6, 6 * STEPS)
    assert (rep["first_step"], rep["last_step"]) == (100, 200)

    # totals per kernel over ranks and windows, recomputed from the summaries
    expected: dict[str, list[float]] = {}
    per_rank: dict[str, np.ndarray] = {}
    first_w: dict[str, np.ndarray] = {}
    last_w: dict[str, np.ndarray] = {}
    for (r, st), s in windows.items():
        for name, (us, n) in _per_name(s).items():
            e = expected.setdefault(name, [0.0, 0])
            e[0] += us
            e[1] += n
            per_rank.setdefault(name, np.zeros(3))[r] += us
            (first_w if st == 100 else last_w).setdefault(name, np.zeros(3))[r] = us / STEPS
    total = sum(v[0] for v in expected.values())
    assert rep["kernel_us"] == pytest.approx(total, rel=1e-9)
    got = {k["name"]: k for k in rep["kernels"]}
    assert set(got) == set(expected)
    assert [k["time_us"] for k in rep["kernels"]] == sorted((k["time_us"] for k in rep["kernels"]), reverse=True)
    for name, (us, n) in expected.items():
        k = got[name]
        assert k["time_us"] == pytest.approx(us, rel=1e-9) and k["launches"] == n
        assert k["share"] == pytest.approx(us / total, rel=1e-9)
        assert k["us_per_step"] == pytest.approx(us / (6 * STEPS), rel=1e-9)
        spread = per_rank[name] / (2 * STEPS)  # each rank profiled 2 windows × 2 steps
        sp = k["rank_spread"]
        assert (sp["min_us"], sp["median_us"], sp["max_us"]) == (
            pytest.approx(spread.min()), pytest.approx(float(np.median(spread))), pytest.approx(spread.max()))
        f = float(np.median(first_w.get(name, np.zeros(3))))
        la = float(np.median(last_w.get(name, np.zeros(3))))
        assert k["trend"]["first_us"] == pytest.approx(f) and k["trend"]["last_us"] == pytest.approx(la)

    # what the numbers say about this job
    top = rep["kernels"][0]
    assert top["name"] == NCCL and top["category"] == "comm"
    assert top["trend"]["ratio"] == pytest.approx(1.5, rel=1e-9)  # every rank's NCCL kernel slowed 1.5×
    (emb,) = [k for n, k in got.items() if EMB in n]
    # the traced rank 1 spends ~2.4× rank 0's time in the embedding backward (rank 2: 1.6×, the median)
    sp = emb["rank_spread"]
    assert emb["category"] == "embedding" and sp["max_rank"] == 1
    assert sp["ratio"] == pytest.approx(per_rank[emb["name"]][1] / (1.6 * per_rank[emb["name"]][0]), rel=1e-9)
    assert emb["trend"]["ratio"] == pytest.approx(1.0)
    assert any(f.startswith(f"rank 1 spends {sp['ratio']:.2f}× the median rank's time in") for f in rep["findings"])
    cats = {k["category"] for k in rep["kernels"] if "cutlass" in k["name"]} | {got["Memcpy HtoD (Pinned -> Device)"]["category"]}
    assert cats == {"gemm", "memcpy"}
    assert sum(c["share"] for c in rep["categories"]) == pytest.approx(1.0)
    assert any(NCCL[:40] in f and "1.50×" in f for f in rep["findings"]), rep["findings"]


def test_a_late_older_window_becomes_the_first_and_cpu_windows_add_nothing(
        live_server: Any, windows: dict[tuple[int, int], dict[str, Any]]) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "kern-late", "model_family": "dlrm", "world_size": 4})
        c.ingest({"v": 1, "run_id": rid, "events": [_event(0, 1, 100, windows[(0, 100)]),
                                                     _event(0, 2, 200, windows[(0, 200)])]})
        before = _get(c, rid)
        # an older window arrives late (a spooled batch replayed), and a CPU-only trace (no GPU kernels)
        older = _scaled(windows[(0, 100)], "ncclKernel_SendRecv", 0.5)
        cpu = {**windows[(0, 100)], "top_kernels": [], "timeline": "cpu"}
        c.ingest({"v": 1, "run_id": rid, "events": [_event(0, 3, 50, older), _event(3, 1, 100, cpu)]})
        after = _get(c, rid)
        c.ingest({"v": 1, "run_id": rid, "events": [_event(0, 3, 50, older)]})  # a retried batch: same seq
        again = _get(c, rid)
    nccl_before = next(k for k in before["kernels"] if k["name"] == NCCL)
    nccl_after = next(k for k in after["kernels"] if k["name"] == NCCL)
    assert nccl_before["trend"]["ratio"] == pytest.approx(1.5)
    assert nccl_after["trend"]["ratio"] == pytest.approx(3.0)  # last (1.5×) over the new first (0.5×)
    base = _per_name(windows[(0, 100)])[NCCL][0]
    assert nccl_after["time_us"] == pytest.approx(base * (1 + 1.5 + 0.5))
    assert (after["ranks"], after["windows"], after["first_step"]) == (1, 3, 50)  # the CPU window: no rank
    assert after["folded_now"] == 2 and again["folded_now"] == 0
    assert next(k for k in again["kernels"] if k["name"] == NCCL)["time_us"] == nccl_after["time_us"]


def test_errors_name_what_is_wrong(live_server: Any) -> None:
    import httpx

    with live_server.client() as c:
        rid = c.register_run({"name": "kern-empty", "model_family": "f", "world_size": 1})
        empty = _get(c, rid)
    assert empty["kernels"] == [] and empty["ranks"] == 0 and empty["findings"] == []
    r = httpx.get(f"{live_server.url}/api/v1/runs/999999/kernels", timeout=10)
    assert r.status_code == 404 and "999999" in r.text
    r = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/kernels", params={"top": 0}, timeout=10)
    assert r.status_code == 422 and "top" in r.text
