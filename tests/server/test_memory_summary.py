"""The run summary's ``memory`` section (server/analysis/memory.py) from stored data: each rank's latest
``memory`` event (the agent's run figures) gives the per-rank peaks, their imbalance, fragmentation,
allocator retries and OOMs; a run without the events falls back to the step rollups; a CPU run says RSS.
Everything goes through the real server and Postgres over HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from fleetscope.wire import RANK_STEP_FIELDS

NAMES = [f.name for f in RANK_STEP_FIELDS]
GB = 1 << 30


def _row(rank: int, step: int, peak: int | None, reserved: int | None = None, retries: int | None = None) -> tuple:
    v = {"rank": rank, "step": step, "step_s": 1.0, "ts": 1.7e9 + step, "compute_s": 0.9, "other_s": 0.1,
         "mem_allocated_bytes": 1 * GB, "mem_reserved_bytes": reserved, "mem_peak_bytes": peak, "alloc_retries": retries}
    return tuple(v.get(n) for n in NAMES)


def _mem_event(rank: int, seq: int, **data: Any) -> dict[str, Any]:
    return {"rank": rank, "seq": seq, "kind": "memory", "ts": 1.7e9 + seq, "step": seq, "data": data}


def test_summary_reports_imbalance_fragmentation_and_ooms_from_stored_events(live_server: Any) -> None:
    peaks = [10 * GB, 11 * GB, 10 * GB, 20 * GB]  # rank 3 holds twice the median
    reserved = [12 * GB, 12 * GB, 16 * GB, 22 * GB]  # rank 2: 6 GiB reserved beyond its peak
    with live_server.client() as c:
        rid = c.register_run({"name": "mem-imbalance", "model_family": "f", "world_size": 4, "device_type": "H100"})
        c.ingest_rows(rid, [_row(r, s, peaks[r], reserved[r], 1 if (r, s) == (1, 2) else 0)
                            for s in range(4) for r in range(4)])
        evs = [_mem_event(r, 10, source="cuda", samples=4, peak_allocated_bytes=peaks[r], peak_exact=True,
                          peak_reserved_bytes=reserved[r], fragmentation_bytes=reserved[r] - peaks[r],
                          alloc_retries=1 if r == 1 else 0, ooms=2 if r == 2 else 0) for r in range(4)]
        # an earlier event of rank 3 (lower seq) is superseded by its latest
        evs.append(_mem_event(3, 5, source="cuda", peak_allocated_bytes=99 * GB, ooms=50))
        assert c.ingest({"v": 1, "run_id": rid, "events": evs})["accepted"]["events"] == 5
        # a client's non-numbers and out-of-range numbers are read as "not measured", never an error
        odd = c.register_run({"name": "mem-odd", "model_family": "f", "world_size": 2, "device_type": "H100"})
        c.ingest({"v": 1, "run_id": odd, "events": [
            _mem_event(0, 1, source="cuda", peak_allocated_bytes="lots", ooms=[1], alloc_retries=1e300),
            _mem_event(1, 1, source="x" * 100, peak_allocated_bytes=4 * GB, ooms=-3)]})
    live_server.compact()
    with live_server.client() as c:
        mem = c.summary(rid)["memory"]
    assert mem["source"] == "cuda" and mem["ranks"] == 4
    assert mem["peak_allocated_max"] == 20 * GB and mem["peak_allocated_max_rank"] == 3
    assert mem["peak_allocated_median"] == 10.5 * GB
    assert mem["imbalance"] == pytest.approx(20 / 10.5)
    assert mem["peak_reserved_max"] == 22 * GB
    assert mem["fragmentation_bytes"] == 6 * GB and mem["fragmentation_ratio"] == pytest.approx(6 / 22)
    assert mem["alloc_retries"] == 1 and mem["ooms"] == 2 and mem["ooms_ranks"] == 1
    assert mem["peak_exact"] is True
    with live_server.client() as c:
        odd_mem = c.summary(odd)["memory"]
    assert odd_mem["ranks"] == 1 and odd_mem["peak_allocated_max"] == 4 * GB and odd_mem["source"] == "cuda"
    assert odd_mem["ooms"] is None


def test_summary_without_memory_events_falls_back_and_a_cpu_run_says_rss(live_server: Any) -> None:
    with live_server.client() as c:
        gpu = c.register_run({"name": "mem-old-agent", "model_family": "f", "world_size": 2, "device_type": "H100"})
        c.ingest_rows(gpu, [_row(r, s, (8 + r) * GB, 9 * GB, 0) for s in range(3) for r in range(2)])
        cpu = c.register_run({"name": "mem-cpu", "model_family": "f", "world_size": 2, "device_type": "cpu"})
        c.ingest_rows(cpu, [_row(r, s, (2 + r) * GB // 4) for s in range(3) for r in range(2)])
        c.ingest({"v": 1, "run_id": cpu, "events": [
            _mem_event(r, 1, source="rss", samples=3, peak_allocated_bytes=(2 + r) * GB // 4, peak_exact=True)
            for r in range(2)]})
        none = c.register_run({"name": "mem-none", "model_family": "f", "world_size": 1, "device_type": "H100"})
        c.ingest_rows(none, [_row(0, s, None) for s in range(3)])
    live_server.compact()
    with live_server.client() as c:
        old = c.summary(gpu)["memory"]
        rss = c.summary(cpu)["memory"]
        assert c.summary(none)["memory"] is None  # nothing measured: no claim
    # the step rollups' max over ranks; no per-rank figures: no imbalance claimed
    assert old["source"] == "cuda" and old["peak_allocated_max"] == 9 * GB and old["imbalance"] is None
    assert old["ranks"] == 0 and old["ooms"] is None
    assert rss["source"] == "rss" and rss["peak_allocated_max"] == 3 * GB // 4
    assert rss["imbalance"] == pytest.approx(1.5 / 1.25) and rss["fragmentation_bytes"] is None and rss["ooms"] is None
