"""The run page's memory chart and tile (dashboard/pages/run.py, dashboard/figures.py) through Dash's own
callback endpoint on the real server: a CPU run, recorded by the real agent, is labelled as the process's
RSS — no GPU-allocator claim — and a GPU run as the CUDA caching allocator, with its rank imbalance,
fragmentation and OOMs in the tile."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_compile_panel import _callback, _texts  # noqa: E402

from fleetscope.wire import RANK_STEP_FIELDS  # noqa: E402

NAMES = [f.name for f in RANK_STEP_FIELDS]
OUTPUTS = [("run-kpis", "children"), ("run-bottleneck-text", "children"), ("run-decomposition", "figure"),
           ("run-throughput", "figure"), ("run-memory", "figure"), ("run-modality", "figure")]
GB = 1 << 30


def _tile(kpis: list[Any], kid: str) -> str:
    (tile,) = [k for k in kpis if (k.get("props") or {}).get("id") == kid]
    return " ".join(_texts(tile))


def test_a_cpu_runs_memory_panel_says_rss(live_server: Any, tmp_path: Path, monkeypatch: Any) -> None:
    import fleetscope.agent as fs

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FLEETSCOPE_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    run = fs.init("mem-cpu-page", server=live_server.url, token=live_server.token, spool_dir=str(tmp_path),
                  clock="cpu", collectives=False, measure_flops=False)
    model = torch.nn.Linear(32, 32)
    for _ in range(4):
        with run.step():
            with run.phase("forward"):
                model(torch.randn(16, 32)).sum().backward()
    run.finish(timeout=20)
    live_server.compact()
    with live_server.client() as c:
        (r,) = c.run_list(name="mem-cpu-page")
        assert c.summary(r["id"])["memory"]["source"] == "rss"
    out = _callback(live_server, OUTPUTS, r["id"])
    fig = out["run-memory"]["figure"]
    text = json.dumps(fig)
    assert "RSS (CPU process)" in fig["layout"]["title"]["text"]
    assert fig["data"] and fig["data"][0]["name"] == "peak RSS (max over ranks)"
    assert "GPU" not in text and "allocator" not in text and "reserved" not in text
    tile = _tile(out["run-kpis"]["children"], "run-memory-kpi")
    assert tile.startswith("peak RSS") and "RSS (CPU process)" in tile and "allocated" not in tile


def test_a_gpu_runs_memory_panel_names_the_allocator_and_its_ranks(live_server: Any) -> None:
    def row(rank: int, step: int) -> tuple:
        v = {"rank": rank, "step": step, "step_s": 1.0, "ts": 1.7e9 + step, "compute_s": 1.0, "other_s": 0.0,
             "mem_allocated_bytes": 5 * GB, "mem_reserved_bytes": 12 * GB, "mem_peak_bytes": (10 + 10 * (rank == 1)) * GB,
             "alloc_retries": 0}
        return tuple(v.get(n) for n in NAMES)

    with live_server.client() as c:
        rid = c.register_run({"name": "mem-gpu-page", "model_family": "f", "world_size": 3, "device_type": "H100"})
        c.ingest_rows(rid, [row(r, s) for s in range(3) for r in range(3)])
        c.ingest({"v": 1, "run_id": rid, "events": [
            {"rank": r, "seq": 1, "kind": "memory", "ts": 1.7e9, "step": 2,
             "data": {"source": "cuda", "peak_allocated_bytes": (10 + 10 * (r == 1)) * GB, "peak_exact": True,
                      "peak_reserved_bytes": 22 * GB, "fragmentation_bytes": (12 - 10 * (r == 1)) * GB,
                      "alloc_retries": 0, "ooms": int(r == 2)}} for r in range(3)]})
    live_server.compact()
    out = _callback(live_server, OUTPUTS, rid)
    fig = out["run-memory"]["figure"]
    assert "CUDA caching allocator" in fig["layout"]["title"]["text"] and "RSS" not in json.dumps(fig)
    assert [d["name"] for d in fig["data"]][:2] == ["peak allocated (max over ranks)", "reserved (max over ranks)"]
    tile = _tile(out["run-kpis"]["children"], "run-memory-kpi")
    assert "peak allocated, max over ranks" in tile and "max/median 2.00×" in tile
    assert "reserved−allocated 12" in tile and "1 OOM" in tile
