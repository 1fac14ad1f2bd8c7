"""The run page's "Memory per module" panel (dashboard/memory_modules_panel.py) through Dash's own callback
endpoint on the real server: the modules holding the most, the peak's parts, the imbalance across ranks
and the checkpointing advice, from stored ``memory_modules`` events; a run without them shows no panel."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_compile_panel import _callback, _texts  # noqa: E402

from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

NAMES = [f.name for f in RANK_STEP_FIELDS]
MB = 1 << 20
OUT = [("run-memory-modules", "children")]


def _row(rank: int, step: int) -> tuple:
    v = {"rank": rank, "step": step, "step_s": 1.0, "ts": 1.7e9 + step, "compute_s": 0.8, "other_s": 0.2,
         "mem_peak_bytes": 2000 * MB, "flops": 1e12, "hw_flops": 1e12}
    return tuple(v.get(n) for n in NAMES)


def _event(rank: int, act_scale: float) -> dict[str, Any]:
    names = ["(model)", "embed", "layers.0", "layers.1", "lm_head<script>"]
    cols = {"name": names, "type": ["LM", "Embedding", "Block", "Block", "Linear"],
            "activation_bytes": [0, 8 * MB, 600 * MB * act_scale, 600 * MB * act_scale, 40 * MB],
            "param_bytes": [0, 200 * MB, 100 * MB, 100 * MB, 200 * MB], "grad_bytes": [0, 200 * MB, 100 * MB, 100 * MB, 200 * MB],
            "optim_bytes": [0, 400 * MB, 200 * MB, 200 * MB, 400 * MB], "input_bytes": [None, 0, 8 * MB, 8 * MB, 8 * MB],
            "flops": [5e11, 1e9, 2e11, 2e11, 9e10], "checkpointed": [False] * 5}
    tot = {k: sum(v for v in cols[k] if v) for k in ("activation_bytes", "param_bytes", "grad_bytes", "optim_bytes")}
    return {"rank": rank, "seq": 3, "kind": "memory_modules", "ts": 1.7e9, "step": 0,
            "data": {"modules": cols, "totals": tot, "forwards": 1, "micro_batch": 8, "cost_s": 0.02}}


def test_the_panel_shows_top_modules_peak_parts_imbalance_and_advice(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "mem-mod-page", "model_family": "f", "world_size": 2, "device_type": "cpu"})
        c.ingest_rows(rid, [_row(r, s) for s in range(3) for r in range(2)])
        c.ingest({"v": 1, "run_id": rid, "events": [_event(0, 1.0), _event(1, 1.2)] + [
            {"rank": r, "seq": 4, "kind": "memory", "ts": 1.7e9, "step": 2,
             "data": {"source": "rss", "peak_allocated_bytes": (2000 + 100 * r) * MB, "peak_exact": True}}
            for r in range(2)]})
        bare = c.register_run({"name": "mem-mod-bare", "model_family": "f", "world_size": 1, "device_type": "cpu"})
        c.ingest_rows(bare, [_row(0, s) for s in range(3)])
    live_server.compact()
    out = _callback(live_server, OUT, rid)["run-memory-modules"]["children"]
    text = " ".join(_texts(out))
    assert "Memory per module" in text and "rank 1's modules" in text
    # top modules by what they hold, names as given (escaped by Dash: no markup is built from them)
    assert text.index("layers.0") < text.index("embed") and "lm_head<script>" in text
    assert "parameters" in text and "optimizer state" in text and "temporaries (estimated)" in text
    acts = [8 + 2 * 600 * k + 40 for k in (1.0, 1.2)]  # per rank, MiB; two ranks: the median is their mean
    assert f"activations max/median {max(acts) / (sum(acts) / 2):.2f}×" in text
    assert "checkpoint layers.0" in text and "per step" in text  # the advice and its price
    assert '"dangerouslySetInnerHTML"' not in json.dumps(out)
    assert not _callback(live_server, OUT, bare).get("run-memory-modules", {}).get("children")
