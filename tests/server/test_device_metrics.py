"""GPU trouble per node on /metrics (server/prom_devices.py), parsed as Prometheus parses it: from the agents'
device telemetry of the last 24 hours, ``fleetscope_node_gpu_throttled_ratio``, ``fleetscope_node_gpu_xid_total``,
``fleetscope_node_gpu_ecc_errors_total`` and ``fleetscope_node_gpu_throttled_runs`` labelled ``node`` only (never
a run, rank or GPU), worst nodes first and capped (the rest folded into ``_other``); older telemetry left out."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fleetscope.server import prom_devices
from test_metrics_scrape import samples, scrape, value

NAMES = ("fleetscope_node_gpu_throttled_ratio", "fleetscope_node_gpu_xid_total", "fleetscope_node_gpu_ecc_errors_total",
         "fleetscope_node_gpu_throttled_runs")


def _dev(rank: int, seq: int, ts: float, *, throttle: list[str] | None = None, xid: list[int] | None = None,
         ecc: int = 0) -> dict[str, Any]:
    thr = throttle or []
    data = {"window_s": 30.0, "samples": 30, "sm_clock_mhz": {"min": 1400, "mean": 1410 if thr else 1980, "max": 1990},
            "power_w": {"min": 400, "mean": 500, "max": 700}, "power_limit_w": {"min": 700, "mean": 700, "max": 700},
            "temp_c": {"min": 60, "mean": 62, "max": 64}, "throttle": thr, "throttle_s": {n: 15.0 for n in thr},
            "ecc_errors": ecc, "xid": xid or []}
    return {"rank": rank, "seq": seq, "kind": "device", "ts": ts, "step": seq, "data": data}


def _scrape(srv: Any) -> dict[str, Any]:
    prom_devices._cache.clear()  # computed at most once a minute per process: a fresh figure for each check
    return scrape(srv.url)


def test_device_gauges_per_node_bounded_and_worst_first(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    with live_server.client() as c:
        rid = c.register_run({"name": "gpu-m", "world_size": 8})
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "host": f"h{r // 2}", "node": f"gn{r // 2}"}
                                                   for r in range(8)]}, fmt="json")
        evs = []
        for i in range(4):  # 4 windows of 30 s per rank, in the last hour
            ts = now - 3600 + 30 * i
            for r in range(8):
                evs.append(_dev(r, 100 + i, ts, throttle=["thermal"] if r == 2 else None,
                                xid=[79] if (r == 5 and i == 1) else None, ecc=2 if (r == 4 and i == 3) else 0))
        evs.append(_dev(6, 99, now - 3 * 86400, xid=[48], ecc=7))  # three days ago: outside the 24 h
        assert c.ingest({"v": 1, "run_id": rid, "events": evs}, fmt="json")["accepted"]["events"] == 33

    fams = _scrape(live_server)
    for name in NAMES:
        got = samples(fams, name)
        assert got and all(set(lv) == {"node"} for lv, _ in got), (name, got)
        assert sorted(lv["node"] for lv, _ in got) == ["gn0", "gn1", "gn2", "gn3"]
    # gn1: rank 2 throttled 15 s of each 30 s window, rank 3 never → 60 / 240 s
    assert value(fams, "fleetscope_node_gpu_throttled_ratio", node="gn1") == pytest.approx(0.25)
    assert value(fams, "fleetscope_node_gpu_throttled_runs", node="gn1") == 1.0
    assert value(fams, "fleetscope_node_gpu_xid_total", node="gn2") == 1.0
    assert value(fams, "fleetscope_node_gpu_ecc_errors_total", node="gn2") == 2.0
    assert value(fams, "fleetscope_node_gpu_xid_total", node="gn3") == 0.0  # the old XID left out
    assert value(fams, "fleetscope_node_gpu_ecc_errors_total", node="gn3") == 0.0
    assert value(fams, "fleetscope_node_gpu_throttled_ratio", node="gn0") == 0.0
    assert value(fams, "fleetscope_metrics_collection_errors_total", group="devices") == 0.0

    monkeypatch.setattr(prom_devices, "MAX_NODES", 2)  # capped: the 2 worst by name, the rest as _other
    fams = _scrape(live_server)
    got = samples(fams, "fleetscope_node_gpu_throttled_ratio")
    assert [lv["node"] for lv, _ in got] == ["gn2", "gn1", "_other"]  # XID first, then the throttled share
    assert value(fams, "fleetscope_node_gpu_throttled_ratio", node="_other") == 0.0
    assert value(fams, "fleetscope_node_gpu_xid_total", node="_other") == 0.0
