"""The run page's MFU / HFU tiles and Kernels panel (dashboard/pages/run.py), through Dash's own callback
endpoint on the real server (no browser)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_compile_panel import _callback, _ids, _texts  # noqa: E402

from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

NAMES = [f.name for f in RANK_STEP_FIELDS]
KPI_OUTPUTS = [("run-kpis", "children"), ("run-bottleneck-text", "children"), ("run-decomposition", "figure"),
               ("run-throughput", "figure"), ("run-memory", "figure"), ("run-modality", "figure")]


def _row(rank: int, step: int, flops: float, hw: float | None) -> tuple:
    v = {"rank": rank, "step": step, "step_s": 1.0, "ts": 1.7e9 + step, "compute_s": 1.0, "other_s": 0.0,
         "tokens": 750, "padded_tokens": 1000, "flops": flops, "hw_flops": hw}
    return tuple(v.get(n) for n in NAMES)


def _tile(kpis: list[Any], kid: str) -> str:
    (tile,) = [k for k in kpis if (k.get("props") or {}).get("id") == kid]
    return " ".join(_texts(tile))


def test_mfu_and_hfu_tiles_are_labelled(live_server: Any) -> None:
    with live_server.client() as c:
        ckpt = c.register_run({"name": "ckpt", "model_family": "f", "world_size": 1, "peak_flops": 1e12})
        # model 2.25e11 FLOP/s; hardware 3.75e11 = model × 4/3 padding × 1.25 recomputation
        c.ingest_rows(ckpt, [_row(0, s, 2.25e11, 3.75e11) for s in range(3)])
        plain = c.register_run({"name": "plain", "model_family": "f", "world_size": 1, "peak_flops": 1e12})
        c.ingest_rows(plain, [_row(0, s, 2.25e11, None) for s in range(3)])  # hardware FLOPs not measured
    live_server.compact()
    kpis = _callback(live_server, KPI_OUTPUTS, ckpt)["run-kpis"]["children"]
    assert "MFU" in _tile(kpis, "run-mfu") and "22.5 %" in _tile(kpis, "run-mfu")
    hfu = _tile(kpis, "run-hfu")
    assert "HFU" in hfu and "37.5 %" in hfu and "recompute +25 % FLOPs" in hfu
    kpis = _callback(live_server, KPI_OUTPUTS, plain)["run-kpis"]["children"]
    assert "22.5 %" in _tile(kpis, "run-mfu")
    assert _tile(kpis, "run-hfu") == "HFU – not measured"
    assert "run-hfu" in _ids(kpis)


def test_kernels_panel_lists_the_hotspots(live_server: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "traces"))
    from fleetscope.agent.tracing import json_safe
    from trace_testutil import KINETO

    from fleetscope.traces import reduce_trace

    with live_server.client() as c:
        rid = c.register_run({"name": "kern-page", "model_family": "dlrm", "world_size": 2})
        none = c.register_run({"name": "no-traces", "model_family": "dlrm", "world_size": 2})
        evs = []
        for r in (0, 1):
            s = json_safe(reduce_trace(KINETO / "hta_sampled_2rank" / f"sampled_rank-{r}.json.gz", rank=r,
                                       include_last_step=True))
            evs.append({"rank": r, "seq": 1, "kind": "trace_summary", "ts": 1.7e9, "step": 100,
                        "data": {"first_step": 100, "active_steps": 2, "summary": s}})
        c.ingest({"v": 1, "run_id": rid, "events": evs})
        api = c.get(f"/api/v1/runs/{rid}/kernels", top=15)
    panel = _callback(live_server, [("run-kernels", "children")], rid)["run-kernels"]["children"]
    ids = _ids(panel)
    assert "run-kernels-section" in ids and "run-kernels-table" in ids and "run-kernels-findings" in ids
    text = " ".join(_texts(panel))
    assert "Kernel hotspots" in text and "2 windows on 2 ranks" in text
    top = api["kernels"][0]
    assert top["name"].startswith("ncclKernel_SendRecv") and top["name"][:90] in text
    assert f"{top['share'] * 100:.1f} %" in text and "comm" in text and "embedding" in text
    assert f"rank {top['rank_spread']['max_rank']})" in text
    # a run without trace windows shows no panel
    assert _callback(live_server, [("run-kernels", "children")], none)["run-kernels"]["children"] is None
