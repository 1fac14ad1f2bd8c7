"""Device telemetry through the real server: ``device`` events land in ``run_devices`` (one row per rank and
window, not in ``run_events``; a re-sent batch stores nothing twice), ``GET /api/v1/runs/{id}/devices``
answers per-rank figures with the throttled rank, its reason and share of time, clocks against its peers',
XID and ECC errors and the node; a malformed ``device`` event is a 422 naming the field; a straggler's
``cause`` and the straggler alert's sentence carry the device's reason (the pure join, analysis/devices.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from dash_util import texts
from fleetscope.server.analysis.devices import attach_device_causes, device_report
from fleetscope.server.analysis.explain import explanation
from sqlalchemy import text

T0 = 1.7e9


def _dev(rank: int, seq: int, i: int, *, sm: float = 1980.0, throttle: list[str] | None = None, xid: list[int] | None = None,
         ecc: int = 0, temp: float = 60.0) -> dict[str, Any]:
    thr = throttle or []
    data = {"window_s": 30.0, "samples": 30, "sm_clock_mhz": {"min": sm - 15, "mean": sm, "max": sm + 15},
            "mem_clock_mhz": {"min": 2619, "mean": 2619, "max": 2619}, "power_w": {"min": 400, "mean": 690 if thr else 500,
                                                                                  "max": 700},
            "power_limit_w": {"min": 700, "mean": 700, "max": 700}, "temp_c": {"min": temp, "mean": temp, "max": temp + 2},
            "util": {"min": 0.9, "mean": 0.95, "max": 1.0}, "mem_used_bytes": {"min": 1 << 30, "mean": 1 << 30, "max": 2 << 30},
            "throttle": thr, "throttle_s": {n: 27.0 for n in thr}, "ecc_errors": ecc, "xid": xid or []}
    return {"rank": rank, "seq": seq, "kind": "device", "ts": T0 + 30 * i, "step": 10 * i, "data": data}


def _q(srv: Any, sql: str, **params: Any) -> Any:
    with srv.app.state.fs.engine.connect() as c:
        return c.execute(text(sql), params).fetchall()


def test_devices_endpoint_names_the_throttled_rank_its_reason_clocks_errors_and_node(live_server: Any) -> None:
    with live_server.client() as c:
        rid = c.register_run({"name": "dev-api", "world_size": 4})
        c.ingest({"v": 1, "run_id": rid, "ranks": [{"rank": r, "host": f"h{r // 2}", "node": f"node{r // 2}"}
                                                   for r in range(4)]}, fmt="json")
        events = []
        for i in range(4):
            events += [_dev(0, 100 + i, i), _dev(1, 100 + i, i), _dev(2, 100 + i, i, sm=1410.0, throttle=["power"]),
                       _dev(3, 100 + i, i, xid=[79] if i == 2 else None, ecc=1 if i == 3 else 0)]
        batch = {"v": 1, "run_id": rid, "events": events}
        assert c.ingest(batch, fmt="json")["accepted"]["events"] == 16
        c.ingest(batch, fmt="json")  # re-sent after a lost answer: nothing stored twice
        body = c.get(f"/api/v1/runs/{rid}/devices")
        missing = c.http.get("/api/v1/runs/999999/devices")
        bad = c.http.post("/api/v1/ingest", json={"v": 1, "run_id": rid, "events": [
            {**_dev(0, 500, 9), "data": {**_dev(0, 500, 9)["data"], "throttle": ["lunch"]}}]},
            headers={"Authorization": f"Bearer {live_server.token}"})
        bad2 = c.http.post("/api/v1/ingest", json={"v": 1, "run_id": rid, "events": [
            {**_dev(0, 501, 9), "data": {**_dev(0, 501, 9)["data"], "power_w": {"mean": -3}}}]},
            headers={"Authorization": f"Bearer {live_server.token}"})
    assert missing.status_code == 404
    assert bad.status_code == 422 and "throttle" in bad.text and "lunch" in bad.text
    assert bad2.status_code == 422 and "power_w" in bad2.text
    assert _q(live_server, "SELECT count(*) FROM run_devices WHERE run_id = :r", r=rid)[0][0] == 16
    assert _q(live_server, "SELECT count(*) FROM run_events WHERE run_id = :r AND kind = 'device'", r=rid)[0][0] == 0
    assert _q(live_server, "SELECT stored, dropped FROM run_event_counts WHERE run_id = :r AND kind = 'device'",
              r=rid) == [(16, 0)]
    ranks = {r["rank"]: r for r in body["ranks"]}
    assert body["throttled_ranks"] == [2] and body["error_ranks"] == [3]
    r2 = ranks[2]
    assert r2["throttled"] and r2["reason"] == "power" and r2["throttle"] == ["power"]
    assert r2["throttle_share"]["power"] == pytest.approx(27 * 4 / 120)
    assert r2["sm_clock_mhz"] == pytest.approx(1410) and r2["peers_sm_clock_mhz"] == pytest.approx(1980)
    assert r2["node"] == "node1" and r2["windows"] == 4 and r2["seconds"] == pytest.approx(120)
    assert r2["power_limit_w"] == pytest.approx(700) and r2["temp_c_max"] == pytest.approx(62)
    assert ranks[3]["xid"] == [79] and ranks[3]["ecc_errors"] == 1 and not ranks[3]["throttled"]
    assert not ranks[0]["throttled"] and ranks[0]["reason"] is None and ranks[0]["util"] == pytest.approx(0.95)
    assert body["peers"]["sm_clock_mhz"] == pytest.approx(1980)
    from fleetscope.client import Client  # the notebook client: one row per rank

    df = Client(live_server.url).devices(rid)
    assert list(df["rank"]) == [0, 1, 2, 3] and list(df["reason"].fillna("-")) == ["-", "-", "power", "-"]
    # the run page's device panel (its Dash callback over HTTP): rank 2 marked by its reason, the table names it
    outs = [("run-devices-figure", "figure"), ("run-devices-table", "children")]
    r = httpx.post(f"{live_server.url}/_dash-update-component", timeout=60, json={
        "output": ".." + "...".join(f"{i}.{p}" for i, p in outs) + "..",
        "outputs": [{"id": i, "property": p} for i, p in outs],
        "inputs": [{"id": "run-devices-run", "property": "data", "value": rid}],
        "changedPropIds": ["run-devices-run.data"], "state": []})
    assert r.status_code == 200, r.text[:500]
    resp = r.json()["response"]
    traces = {t["name"]: t["x"] for t in resp["run-devices-figure"]["figure"]["data"]}
    assert traces["throttled: power"] == [2] and sorted(traces["not throttled"]) == [0, 1, 3]
    table = texts(resp["run-devices-table"]["children"])
    assert "power" in table and "1.41 GHz vs 1.98 GHz" in table and "79" in table and "node1" in table


def test_a_throttled_straggler_carries_its_reason_in_its_cause_and_the_alert_sentence() -> None:
    figs = [{"rank": r, "host": "h", "node": "n0", "windows": 2, "seconds": 60.0, "sm_clock_mhz_median": 1980.0,
             "throttle_mask": 0, "throttled_s": 0.0, "reason_s": {}, "xid": [], "ecc_errors": 0} for r in range(8)]
    figs[5].update(sm_clock_mhz_median=1410.0, throttle_mask=1 << 2, throttled_s=57.0, reason_s={"power": 57.0})
    figs[6].update(throttle_mask=1 << 5, throttled_s=2.0, reason_s={"thermal": 2.0})  # 3 %: not throttled
    dev = device_report(7, figs)
    assert dev["throttled_ranks"] == [5]
    rep = {"stragglers": [{"rank": 5, "slowdown": 1.3, "component": "compute"},
                          {"rank": 1, "slowdown": 1.1, "component": "data"}]}
    out = attach_device_causes(rep, dev)
    c5, c1 = out["stragglers"][0]["cause"], out["stragglers"][1]["cause"]
    assert c5["reason"] == "power" and c5["component"] == "compute"
    assert c5["text"] == ("rank 5 is 1.30× slower; its GPU sat at its power cap 95 % of the time, "
                          "SM clocks 1.41 GHz vs 1.98 GHz on its peers")
    assert c1["reason"] is None and c1["device"] is None and "data" in c1["text"]
    assert "cause" not in rep["stragglers"][0]  # the cached report is not changed
    alert_cause = {"basis": "rank_vs_median", "rank": 5, "slowdown": 1.3, "component": "compute", "label": "compute",
                   "before": 0.1, "after": 0.13, "share_of_change": 0.97, "reason": "power", "device": c5["device"]}
    sentence = explanation("work_s", None, None, None, "s", alert_cause, None)
    assert sentence is not None and "power cap" in sentence and "1.41 GHz vs 1.98 GHz" in sentence


def test_simulate_throttle_on_1024_ranks_finds_the_rank_with_its_reason_in_cause_and_alert(db_url: str) -> None:
    """``fleetscope simulate --throttle 17:power --throttle 600:thermal`` on 1,024 ranks: /devices names both,
    the worst straggler (17) carries ``power`` in its cause and in the straggler alert's sentence, and the
    thermal rank raises a ``device`` alert."""
    import typer
    from conftest import start_server

    from fleetscope.simulate import parse_throttle, run_simulation

    with pytest.raises(typer.BadParameter, match="RANK:REASON"):
        parse_throttle(["17:sleepy"])
    assert parse_throttle(["17:power", "3:thermal,5:hw_slowdown"]) == {17: "power", 3: "thermal", 5: "hw_slowdown"}
    srv = start_server(db_url, alert_interval_s=3600.0, alert_step_check_interval_s=0.0)
    try:
        run_simulation(server=srv.url, token=srv.token, run="throttled-fleet", family="llm-70b", ranks=1024, steps=12,
                       throttle={17: "power", 600: "thermal"}, flush_timeout_s=300)
        srv.compact()
        rid = int(httpx.get(f"{srv.url}/api/v1/runs", params={"name": "throttled-fleet"}).json()["runs"][0]["id"])
        dev = httpx.get(f"{srv.url}/api/v1/runs/{rid}/devices", timeout=60).json()
        assert dev["throttled_ranks"] == [17, 600] and len(dev["ranks"]) == 1024
        assert dev["ranks"][600]["reason"] == "thermal" and dev["ranks"][600]["temp_c_max"] > 85
        assert dev["ranks"][17]["reason"] == "power" and dev["ranks"][17]["node"] == "node0002"
        summary = httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary", timeout=120).json()
        top = summary["stragglers"][0]
        assert top["rank"] == 17 and top["cause"]["reason"] == "power", summary["stragglers"][:2]
        assert "power cap" in top["cause"]["text"] and "vs 1.98 GHz on its peers" in top["cause"]["text"]
        # the diagnosis quotes the device in the straggler evidence and points its advice at the GPU
        wait = [p for p in summary["diagnosis"]["parts"] if p["cause"] == "straggler_wait"]
        assert wait and any("power cap" in e for e in wait[0]["evidence"]), summary["diagnosis"]["parts"]
        advice = [a["text"] for a in summary["diagnosis"]["advice"] if a["cause"] == "straggler_wait"]
        assert any("its GPU" in t and "power cap" in t for t in advice), advice
        srv.state.alerts.poke(runs=[rid])
        srv.state.alerts.run_once()
        (a,) = httpx.get(f"{srv.url}/api/v1/alerts", params={"kind": "straggler"}, timeout=60).json()["alerts"]
        assert a["first_bad"]["rank"] == 17 and a["cause"]["reason"] == "power"
        assert "power cap" in a["explanation"] and "GHz vs 1.98 GHz" in a["explanation"], a["explanation"]
        # heat is a device alert of its own (a power cap is a setting: only the straggler's cause says it)
        (d,) = httpx.get(f"{srv.url}/api/v1/alerts", params={"kind": "device"}, timeout=60).json()["alerts"]
        assert d["first_bad"]["rank"] == 600 and d["details"]["ranks"] == [600] and d["details"]["reasons"] == ["thermal"]
        assert "heat" in d["details"]["text"] and d["details"]["nodes"] == ["node0075"]
        # nodes ranked by device trouble across runs: the two throttled ranks' nodes first
        nodes = httpx.get(f"{srv.url}/api/v1/devices/nodes", params={"limit": 3}, timeout=60).json()["nodes"]
        assert {n["node"] for n in nodes[:2]} == {"node0002", "node0075"} and nodes[0]["runs_throttled"] == 1
        assert len(nodes) == 3 and nodes[2]["runs_throttled"] == 0 and nodes[0]["runs"] == 1
    finally:
        srv.stop()


def test_a_data_straggler_whose_gpu_also_throttled_keeps_data_as_its_cause() -> None:
    """A rank late in data loading whose GPU sat at its power cap half the time (a bystander throttle): its
    cause stays ``data`` — the throttle is reported (``device.throttle_reason``) but is not the ``reason`` — while
    a compute straggler with the same GPU figures is named by the throttle (bench/straggler_cause.py's confounder)."""
    from fleetscope.server.analysis.devices import device_cause

    figs = [{"rank": r, "host": "h", "node": "n0", "windows": 2, "seconds": 60.0, "sm_clock_mhz_median": 1980.0,
             "throttle_mask": 0, "throttled_s": 0.0, "reason_s": {}, "xid": [], "ecc_errors": 0} for r in range(8)]
    for r in (2, 4):
        figs[r].update(sm_clock_mhz_median=1700.0, throttle_mask=1 << 2, throttled_s=30.0, reason_s={"power": 30.0})
    figs[4].update(xid=[79])
    dev = device_report(9, figs)
    assert dev["throttled_ranks"] == [2, 4]
    rep = {"stragglers": [{"rank": 2, "slowdown": 1.4, "component": "data"},
                          {"rank": 4, "slowdown": 1.2, "component": "compute"}]}
    c2, c4 = (s["cause"] for s in attach_device_causes(rep, dev)["stragglers"])
    assert c2["component"] == "data" and c2["reason"] is None
    assert c2["device"]["reason"] is None and c2["device"]["throttle_reason"] == "power"
    assert c2["text"] == ("rank 2 is 1.40× slower; its excess is in data, which its GPU's clocks do not explain "
                          "(its GPU also sat at its power cap 50 % of the time)")
    assert c4["reason"] == "power" and c4["device"]["throttle_reason"] == "power"
    assert "XID 79" in c4["text"] and "power cap 50 %" in c4["text"]
    # without a component (the alert's older callers) the throttle is still the reason
    assert device_cause(next(r for r in dev["ranks"] if r["rank"] == 2), 1.4)["reason"] == "power"  # type: ignore[index]


def test_nodes_rank_by_xid_then_ecc_then_throttled_share() -> None:
    from fleetscope.server.analysis.devices import rank_device_nodes

    def node(name: str, xid: int = 0, ecc: int = 0, thr: float = 0.0, runs_thr: int = 0) -> dict[str, Any]:
        return {"node": name, "runs": 3, "runs_throttled": runs_thr, "throttled_s": thr, "seconds": 100.0,
                "xid_windows": xid, "ecc_errors": ecc}

    nodes = [node("a", thr=80.0, runs_thr=3), node("b", ecc=2), node("c"), node("d", xid=1, thr=5.0, runs_thr=1),
             node("e", thr=20.0, runs_thr=1), node("f", thr=500.0, runs_thr=1)]
    ranked = rank_device_nodes(nodes)
    assert [n["node"] for n in ranked] == ["d", "b", "f", "a", "e"]  # c had no trouble
    assert [n["throttled_share"] for n in ranked] == [0.05, 0.0, 1.0, 0.8, 0.2]  # capped at 1
    assert [n["node"] for n in rank_device_nodes(nodes, trouble_only=False)][-1] == "c"


def test_the_diagnosis_points_a_data_straggler_at_its_input_pipeline_not_its_bystander_gpu() -> None:
    from fleetscope.server.analysis.diagnosis import diagnose

    figs = [{"rank": r, "host": "h", "node": "n0", "windows": 2, "seconds": 60.0, "sm_clock_mhz_median": 1980.0,
             "throttle_mask": 0, "throttled_s": 0.0, "reason_s": {}, "xid": [], "ecc_errors": 0} for r in range(8)]
    figs[3].update(throttle_mask=1 << 2, throttled_s=30.0, reason_s={"power": 30.0})
    dev = device_report(1, figs)
    shares = {"data": 0.05, "compute": 0.6, "other": 0.05, "comm_exposed": 0.05, "straggler_wait": 0.25}

    def advice(component: str, most_ranks: bool = False) -> str:
        rep = attach_device_causes({"stragglers": [{"rank": 3, "host": "h", "slowdown": 1.4, "component": component,
                                                    "kind": "persistent"}], "nodes": []}, dev)
        # data stalls on most ranks too: the wait for rank 3 stays "waiting for the slowest rank" with its advice
        bn = [{"component": "data", "findings": ["input pipeline stalls: 5 % of the step on most ranks"]}] if most_ranks else []
        d = diagnose(step_s=1.0, shares=shares, colls=[], world_size=8, stragglers=rep, bottlenecks=bn)
        assert d is not None
        return " ".join(a["text"] for a in d["advice"])

    assert "rank 3 (h)'s input pipeline" in advice("data") and "GPU" not in advice("data")
    assert "fix or replace rank 3: look at its input pipeline" in advice("data", most_ranks=True)
    assert "GPU" not in advice("data", most_ranks=True)
    assert "look at its GPU (rank 3 is 1.40× slower; its GPU sat at its power cap 50 %" in advice("compute", True)
