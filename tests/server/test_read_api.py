"""The read API over HTTP: runs, summary, collectives, alerts, OpenAPI, /metrics, /healthz."""

from __future__ import annotations

import time
from typing import Any

import httpx

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows


def _load(srv: Any, spec: RunSpec) -> int:
    with srv.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    srv.compact()
    return rid


def test_runs_list_filters_and_summary_follow_the_contract(live_server: Any) -> None:
    a = _load(live_server, RunSpec(name="a", family="vla-7b", world_size=4, steps=4))
    _load(live_server, RunSpec(name="b", family="vit-h", world_size=8, steps=3))
    r = httpx.get(f"{live_server.url}/api/v1/runs").json()["runs"]
    assert {x["name"] for x in r} == {"a", "b"}
    for x in r:
        for k in ("id", "name", "model_family", "world_size", "status", "started_at", "steps", "rank_steps"):
            assert k in x
    only = httpx.get(f"{live_server.url}/api/v1/runs", params={"family": "vit-h"}).json()["runs"]
    assert [x["name"] for x in only] == ["b"] and only[0]["rank_steps"] == 24
    assert httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "a", "limit": 1}).json()["runs"][0]["id"] == a
    s = httpx.get(f"{live_server.url}/api/v1/runs/{a}/summary").json()
    d = s["decomposition"]
    assert s["rank_steps"] == 16 and s["collective_records"] == 64
    assert set(d) == {"step_s", "data_s", "compute_s", "comm_exposed_s", "other_s"}
    # medians of the components add up to about the median step (each is a median, not a sum)
    assert abs(d["data_s"] + d["compute_s"] + d["comm_exposed_s"] + d["other_s"] - d["step_s"]) / d["step_s"] < 0.05
    assert 0 < s["mfu"] < 1 and s["mfu_estimated"] is True and s["tokens_per_s"] > 0
    # the measured compute phases (synthetic: forward = compute/3, backward = 0.6 compute on every rank)
    ph = s["phases"]
    assert set(ph) == {"forward", "backward", "optimizer"}
    assert abs(ph["forward"] - d["compute_s"] / 3) <= 1e-4 * d["compute_s"]
    assert abs(ph["backward"] - 0.6 * d["compute_s"]) <= 1e-4 * d["compute_s"]
    assert isinstance(s["stragglers"], list) and isinstance(s["bottlenecks"], list)  # filled by the analysis layer
    colls = httpx.get(f"{live_server.url}/api/v1/runs/{a}/collectives").json()["collectives"]
    ar = [c for c in colls if c["op"] == "all_reduce"]
    assert ar and all(c["group_size"] == 4 for c in ar)
    c0 = ar[0]
    assert c0["busbw_bytes_per_s"] == c0["algbw_bytes_per_s"] * 2 * 3 / 4


def test_unknown_run_is_404_and_bad_params_are_422(live_server: Any) -> None:
    assert httpx.get(f"{live_server.url}/api/v1/runs/999/summary").status_code == 404
    assert httpx.get(f"{live_server.url}/api/v1/runs/0/summary").status_code == 422
    assert httpx.get(f"{live_server.url}/api/v1/runs", params={"limit": -1}).status_code == 422
    assert httpx.get(f"{live_server.url}/api/v1/alerts", params={"state": "nope"}).status_code == 422
    assert httpx.get(f"{live_server.url}/api/v1/alerts", params={"state": "firing"}).json() == {"alerts": []}


def test_run_registration_is_idempotent_by_name(live_server: Any) -> None:
    info = RunSpec(name="same", family="vla-7b", world_size=4, steps=1).run_info()
    with live_server.client() as c:
        ids = {c.register_run(info) for _ in range(4)}
        assert len(ids) == 1
        c.finish_run(ids.pop())
    assert httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "same"}).json()["runs"][0]["status"] == "finished"


def test_a_registration_reopens_an_ended_run_only_for_a_process_started_after_its_end(live_server: Any) -> None:
    """A late rank of a run, or ``import-trace`` registering the run it attaches to, joins the ended run
    as it is (reopened, the health pass would page it "stalled"); the same name run again — a process
    started after the end — is running again."""
    def state() -> tuple[str, str | None]:
        r = httpx.get(f"{live_server.url}/api/v1/runs", params={"name": "ended"}).json()["runs"][0]
        return r["status"], r["finished_at"]

    with live_server.client() as c:
        rid = c.register_run({"name": "ended", "world_size": 2, "started_at": time.time() - 60})
        c.finish_run(rid, finished_at=time.time() - 30)
        ended = state()
        assert ended[0] == "finished" and ended[1] is not None
        assert c.register_run({"name": "ended", "world_size": 2}) == rid  # no start time
        assert state() == ended
        assert c.register_run({"name": "ended", "world_size": 2, "started_at": time.time() - 45}) == rid  # a late rank
        assert state() == ended
        assert c.register_run({"name": "ended", "world_size": 2, "started_at": time.time()}) == rid  # run again
        assert state() == ("running", None)


def test_openapi_healthz_and_metrics(live_server: Any) -> None:
    spec = httpx.get(f"{live_server.url}/openapi.json").json()
    paths = spec["paths"]
    for p in ("/api/v1/ingest", "/api/v1/runs", "/api/v1/runs/{run_id}/summary", "/api/v1/alerts", "/healthz"):
        assert p in paths
    body = paths["/api/v1/ingest"]["post"]["requestBody"]["content"]
    assert "application/msgpack" in body and "rank_steps" in body["application/json"]["schema"]["properties"]
    assert httpx.get(f"{live_server.url}/healthz").json() == {"status": "ok"}
    _load(live_server, RunSpec(name="m", family="vla-7b", world_size=2, steps=2))
    httpx.post(f"{live_server.url}/api/v1/ingest", content=b"x")  # a rejection (401)
    m = httpx.get(f"{live_server.url}/metrics").text
    assert 'fleetscope_ingest_records_total{kind="rank_steps"} 4.0' in m
    assert "fleetscope_ingest_batch_seconds_bucket" in m
    assert 'fleetscope_ingest_rejections_total{reason="auth"} 1.0' in m
    assert "fleetscope_db_pool_checked_out" in m and "fleetscope_ingest_queue_depth" in m
    assert 'fleetscope_cluster_runs{status="running"} 1.0' in m


def test_values_the_database_cannot_store_get_422_not_500(live_server: Any) -> None:
    h = {"Authorization": f"Bearer {live_server.token}"}
    r = httpx.post(f"{live_server.url}/api/v1/runs", json={"name": "nul\u0000name"}, headers=h)
    assert r.status_code == 422, r.text
    r = httpx.post(f"{live_server.url}/api/v1/runs", json={"name": "ok", "config": {"k\u0000": 1}}, headers=h)
    assert r.status_code == 422, r.text
    assert httpx.get(f"{live_server.url}/api/v1/runs", params={"status": "a\u0000b"}).status_code == 422
    with live_server.client() as c:
        rid = c.register_run({"name": "fine", "world_size": 1})
    r = httpx.post(f"{live_server.url}/api/v1/runs/{rid}/finish", json={"finished_at": 6.3e16}, headers=h)
    assert r.status_code == 422, r.text
    assert httpx.get(f"{live_server.url}/healthz").status_code == 200
