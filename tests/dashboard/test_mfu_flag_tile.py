"""The run page shows an implausible MFU / HFU (above 1: more FLOPs than peak × step time) as a flag,
never as a percentage above 100 (dashboard/pages/run.py; docs/metrics.md, "MFU")."""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_compile_panel import _callback  # noqa: E402
from test_hfu_kernels_panels import KPI_OUTPUTS, _row, _tile  # noqa: E402


def test_an_mfu_above_one_is_shown_as_a_flag_not_a_number(live_server: Any) -> None:
    with live_server.client() as c:
        # 1.08e12 model / 1.2e12 hardware FLOPs in 1 s against a 1e12 peak: 108 % and 120 %
        rid = c.register_run({"name": "over-peak", "model_family": "f", "world_size": 1, "peak_flops": 1e12})
        c.ingest_rows(rid, [_row(0, s, 1.08e12, 1.2e12) for s in range(3)])
    live_server.compact()
    out = _callback(live_server, KPI_OUTPUTS, rid)
    kpis = out["run-kpis"]["children"]
    mfu, hfu = _tile(kpis, "run-mfu"), _tile(kpis, "run-hfu")
    assert mfu.startswith("MFU flagged implausible: MFU 1.08 > 1") and "%" not in mfu, mfu
    assert hfu.startswith("HFU flagged implausible: HFU 1.20 > 1") and "%" not in hfu, hfu
    # the per-step chart draws no MFU point above 100 %
    traces = [t for t in out["run-throughput"]["figure"]["data"] if t.get("name") == "MFU"]
    for t in traces:
        y = t["y"]
        if isinstance(y, dict):  # a plotly typed array (dashboard/figures.py _arr)
            y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"])
        y = np.asarray(y, dtype=float)
        assert not (y > 100).any(), y
