"""The Cluster page (dashboard/pages/cluster.py) through Dash's own callback endpoint on the real server
(no browser): runs with a slow node and per-node microbenchmarks → the page (its route and its
callback) ranks the slow node first, draws the runs it slowed, shows its microbenchmark against the
other nodes' and, with ``?node=``, its runs; an empty database explains how to get data."""

from __future__ import annotations

from typing import Any

import httpx
from dash_util import find as _find
from dash_util import load, texts

from fleetscope.synthetic import RunSpec

SLOW = "node0001"


def _texts(node: Any) -> list[str]:
    return texts(node, numbers=True)


def _update(srv: Any, outputs: list[tuple[str, str]], inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """POST /_dash-update-component as the browser does."""
    out = [{"id": i, "property": p} for i, p in outputs]
    body = {
        "output": out[0]["id"] + "." + out[0]["property"] if len(out) == 1
        else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": out[0] if len(out) == 1 else out,
        "inputs": inputs,
        "changedPropIds": [f"{inputs[0]['id']}.{inputs[0]['property']}"],
        "state": [],
    }
    r = httpx.post(f"{srv.url}/_dash-update-component", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()["response"]


def _page(srv: Any, search: str = "") -> Any:
    """The page's layout as Dash Pages' router renders it for /cluster?…"""
    httpx.get(f"{srv.url}/", timeout=30)  # the router callback is registered on the first request
    res = _update(srv, [("_pages_content", "children"), ("_pages_store", "data")],
                  [{"id": "_pages_location", "property": "pathname", "value": "/cluster"},
                   {"id": "_pages_location", "property": "search", "value": search}])
    return res["_pages_content"]["children"]


def _fill(srv: Any, node: str | None) -> dict[str, Any]:
    return _update(srv, [("cluster-kpis", "children"), ("cluster-chart", "figure"), ("cluster-table", "children"),
                         ("cluster-detail", "children")], [{"id": "cluster-node", "property": "value", "value": node}])






def _rows(table: Any) -> list[list[str]]:
    body = table["props"]["children"][1]["props"]["children"]
    return [[" ".join(_texts(td)) for td in tr["props"]["children"]] for tr in body]


def test_an_empty_cluster_page_explains_how_to_get_data(live_server: Any) -> None:
    page = _page(live_server)
    assert _find(page, "cluster-empty") is not None
    assert "--slow-node" in " ".join(_texts(page)) and "fleetscope bench" in " ".join(_texts(page))


def test_the_cluster_page_ranks_the_slow_node_first(live_server: Any) -> None:
    for i in range(3):
        load(live_server, RunSpec(name=f"slow-{i}", family="vla-7b", world_size=16, steps=12, seed=i, gpus_per_node=4,
                                  slow_nodes={SLOW: 2.5} if i < 2 else {}))
    pts = [{"name": "node_matmul_tflops", "params": {"node": f"node{k:04d}", "n": 8192, "dtype": "bfloat16"},
            "unit": "TFLOP/s", "value": 350.0 if k == 1 else 700.0, "ts": 1.7e9} for k in range(4)]
    with live_server.client() as c:
        assert c.http.post("/api/v1/benchmarks", json={"cluster": "c1", "points": pts}).status_code == 200

    page = _page(live_server, f"?node={SLOW}")
    dropdown = _find(page, "cluster-node")
    assert dropdown["props"]["value"] == SLOW and dropdown["props"]["options"][0]["value"] == SLOW

    res = _fill(live_server, SLOW)
    rows = _rows(_find(res["cluster-table"]["children"], "cluster-nodes"))
    assert rows[0][1] == SLOW and sorted(r[1] for r in rows[1:]) == ["node0000", "node0002", "node0003"]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert rows[0][2:6] == ["3", "2 (67 %)", "0", "2"]  # runs, slowed, straggler runs, slow-network runs
    assert "350 TFLOP/s (50 % of median)" in rows[0][9] and all("700 TFLOP/s (100 % of median)" in r[9] for r in rows[1:])
    fig = res["cluster-chart"]["figure"]
    net = next(t for t in fig["data"] if t["name"] == "network-slow")
    assert net["x"] == [SLOW] and net["y"] == [2]
    kpis = " ".join(_texts(res["cluster-kpis"]["children"]))
    assert "slowed a job" in kpis and "network-slow" in kpis
    detail = res["cluster-detail"]["children"]
    runs = _rows(_find(detail, "cluster-node-runs"))
    assert sorted(r[0] for r in runs) == ["slow-0", "slow-1", "slow-2"]
    assert sorted(r[4] for r in runs) == ["no", "yes", "yes"]
    assert f"Node {SLOW}: 3 run(s), slowed 2" in " ".join(_texts(detail))

    none = _fill(live_server, None)
    assert none["cluster-detail"]["children"] is None


def _device_event(rank: int, seq: int, i: int, *, throttle: list[str] | None = None, xid: list[int] | None = None,
                  ecc: int = 0) -> dict[str, Any]:
    thr = throttle or []
    figs = {"window_s": 30.0, "samples": 30, "sm_clock_mhz": {"min": 1400, "mean": 1410 if thr else 1980, "max": 1990},
            "power_w": {"min": 400, "mean": 500, "max": 700}, "power_limit_w": {"min": 700, "mean": 700, "max": 700},
            "temp_c": {"min": 60, "mean": 62, "max": 64}, "throttle": thr, "throttle_s": {n: 27.0 for n in thr},
            "ecc_errors": ecc, "xid": xid or []}
    return {"rank": rank, "seq": seq, "kind": "device", "ts": 1.7e9 + 30 * i, "step": 10 * i, "data": figs}


def test_the_cluster_page_ranks_nodes_by_device_trouble_beside_the_slow_node_table(live_server: Any) -> None:
    # two runs on nodes node0000..node0003 (2 ranks each): node0001 logs an XID and an ECC error, node0002
    # throttles (power) on one GPU all the time in both runs, node0003 two windows of one run, node0000 is healthy
    for k in range(2):
        rid = load(live_server, RunSpec(name=f"dev-{k}", family="vla-7b", world_size=8, steps=12, seed=k,
                                        gpus_per_node=2))
        with live_server.client() as c:
            evs = []
            for i in range(3):
                for r in range(8):
                    evs.append(_device_event(
                        r, 100 + i, i, throttle=["power"] if r == 4 or (k == 0 and r == 6 and i < 2) else None,
                        xid=[79] if (k == 1 and r == 2 and i == 1) else None, ecc=1 if (k == 1 and r == 3 and i == 2) else 0))
            assert c.ingest({"v": 1, "run_id": rid, "events": evs}, fmt="json")["accepted"]["events"] == 24

    page = _page(live_server)
    split = _find(page, "cluster-device-section")
    assert split is not None and _find(page, "cluster-table") is not None  # both tables on the page
    res = _update(live_server, [("cluster-devices", "children")],
                  [{"id": "cluster-node", "property": "value", "value": None}])
    table = _find(res["cluster-devices"]["children"], "cluster-device-nodes")
    rows = _rows(table)
    # XIDs first (node0001: one XID window, one ECC error), then by the share of time throttled (27 s of each
    # 30 s window; node0002: 6 of its 12 windows = 162 / 360 s = 45 %; node0003: 2 of 12 = 15 %); node0000 left out
    assert [r[1] for r in rows] == ["node0001", "node0002", "node0003"]
    assert rows[0][2:4] == ["1", "1"] and rows[0][4] == "0 %"
    assert rows[1][2:] == ["0", "0", "45 %", "2 of 2"]
    assert rows[2][2:] == ["0", "0", "15 %", "1 of 2"]
    assert "3 of 4 node(s) with telemetry had trouble" in " ".join(_texts(res["cluster-devices"]["children"]))
