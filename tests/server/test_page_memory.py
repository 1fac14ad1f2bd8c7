"""What a run page costs is bounded by what was received, not by what was declared: a run that
declares the largest world size and sends a few rank-steps (one on its highest rank) stays under
the stated ceiling, and a run too large to hold whole is sampled, saying so."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
from fleetscope.server import rank_matrix, reports
from fleetscope.server.runs import MAX_WORLD_SIZE

CEILING_MIB = 256


def _ingest(srv: Any, name: str, world: int, ranks: list[int], steps: int) -> int:
    from fleetscope.client import Client

    with Client(srv.url, srv.token) as c:
        rid = c.register_run({"name": name, "model_family": "f", "world_size": world})
        for s in range(steps):
            c.ingest({"v": 1, "run_id": rid, "rank_steps": {
                "rank": ranks, "step": [s] * len(ranks), "step_s": [0.1 + 0.01 * (r % 7) for r in ranks],
                "comm_exposed_s": [0.01] * len(ranks), "ts": [1.7e9 + s] * len(ranks)}})
    srv.app.state.fs.compactor.run_once(force=True)
    return rid


def _page(engine: Any, rid: int) -> tuple[dict[str, Any], float]:
    rank_matrix.clear_cache()
    reports.clear_caches()
    tracemalloc.start()
    try:
        s = reports.run_page_summary(engine, rid)
        reports.run_series(engine, rid)
        reports.bottleneck_report(engine, rid, s)
        hm = reports.rank_heatmap(engine, rid, field="work_s")
        reports.rank_slowdown(engine, rid)
        reports.collectives_view(engine, rid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hm is not None
    return hm, peak / 2**20


def test_largest_declared_world_with_few_records_stays_under_the_ceiling(live_server: Any) -> None:
    rid = _ingest(live_server, "declared-huge", MAX_WORLD_SIZE, [0, 1, 5, MAX_WORLD_SIZE - 1], steps=30)
    hm, peak = _page(live_server.app.state.fs.engine, rid)
    print(f"run page peak: {peak:.0f} MiB")
    assert peak < CEILING_MIB, f"run page took {peak:.0f} MiB"
    assert hm["n_ranks"] == MAX_WORLD_SIZE and hm["n_steps"] == 30  # the highest rank was seen; all 30 steps held


def test_a_run_too_large_to_hold_is_sampled_and_says_so(live_server: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(rank_matrix, "MAX_CELLS", 4 * 10)  # 4 ranks × 10 steps fit; 40 steps do not
    rid = _ingest(live_server, "sampled", 4, [0, 1, 2, 3], steps=40)
    hm, _ = _page(live_server.app.state.fs.engine, rid)
    assert hm["sampled_every_steps"] == 4 and hm["n_steps"] == 10
    assert np.all(np.asarray(hm["step_lo"]) % 4 == 0)
    from fleetscope.dashboard.figures import heatmap_figure

    assert "every 4th step" in heatmap_figure(hm)["layout"]["title"]["subtitle"]["text"]
