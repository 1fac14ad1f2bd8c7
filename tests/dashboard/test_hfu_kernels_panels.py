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
