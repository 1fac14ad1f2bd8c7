"""Reads that cannot stall the store, through the real server on loopback and real Postgres.

Caps per request answer a 422 naming the cap; scalar filters are one pass over the scalars table (so a
URL's cost cannot explode with its length); a read past its statement budget is cancelled by Postgres and
answered 503 naming the budget, not "database unavailable"; a client that goes away cancels its running
statement at once; reads have a pool of their own; out-of-range times are 422 and the keep-alive
connection survives them."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from conftest import start_server
from fleetscope.server.db import libpq_url
from sqlalchemy import text


def _register(srv: Any, name: str, **extra: Any) -> int:
    r = httpx.post(f"{srv.url}/api/v1/runs", json={"name": name, "model_family": "vla", "world_size": 2, **extra},
                   headers={"Authorization": f"Bearer {srv.token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["id"])


def _log_scalars(srv: Any, run_id: int, values: dict[str, float]) -> None:
    events = [{"kind": "scalars", "rank": 0, "seq": 0, "step": 1, "ts": 1.7e9, "data": values}]
    r = httpx.post(f"{srv.url}/api/v1/ingest", json={"v": 1, "run_id": run_id, "events": events},
                   headers={"Authorization": f"Bearer {srv.token}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_caps_answer_422_naming_them_and_healthz_is_unaffected(live_server: Any) -> None:
    url = f"{live_server.url}/api/v1/runs"
    with httpx.Client(timeout=30) as c:
        # the tester's URL: 64 scalar clauses
        params = [(f"scalar.loss{i}.min", "lt:1") for i in range(64)]
        r = c.get(url, params=params)
        assert r.status_code == 422, r.text
        msg = r.json()["error"]["message"]
        assert "at most 32" in msg or "at most 8" in msg or "32 filters" in msg, msg
        # 9 distinct training scalars (under the filter cap): the scalar cap names itself
        r = c.get(url, params=[(f"scalar.s{i}.last", "gt:0") for i in range(9)])
        assert r.status_code == 422 and "training scalars in one request; at most 8" in r.json()["error"]["message"], r.text
        # 1,700 sort keys: a 422 naming the cap, never a 503 "database unavailable"
        r = c.get(url, params=[("sort", f"config.k{i}") for i in range(1700)])  # repeated sort= keys
        assert r.status_code == 422 and "at most 8 sort keys" in r.json()["error"]["message"], r.text
        # too many columns
        r = c.get(url, params={"columns": ",".join(f"config.c{i}" for i in range(65))})
        assert r.status_code == 422 and "at most 64" in r.json()["error"]["message"], r.text
        # too many values in all
        r = c.get(url, params=[(f"config.k{i}", "in:" + ",".join(map(str, range(200)))) for i in range(3)])
        assert r.status_code == 422 and "512 filter values" in r.json()["error"]["message"], r.text
        assert c.get(f"{live_server.url}/healthz").status_code == 200


def test_scalar_filters_are_one_pass_and_still_exact(live_server: Any) -> None:
    a = _register(live_server, "a")
    b = _register(live_server, "b")
    _log_scalars(live_server, a, {f"s{i}": float(i) for i in range(8)})
    _log_scalars(live_server, b, {f"s{i}": float(10 + i) for i in range(8)})
    params = [(f"scalar.s{i}.last", f"lt:{i + 5}") for i in range(8)] + [("columns", "scalar.s7.min")]
    params.append(("sort", "-scalar.s3.last"))
    r = httpx.get(f"{live_server.url}/api/v1/runs", params=params, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["id"] for x in body["runs"]] == [a] and body["total"] == 1
    assert body["runs"][0]["columns"]["scalar.s7.min"] == 7.0
    # the SQL holds one join on run_scalar_names whatever the number of scalar fields
    from fleetscope.server.store.run_query import _from, _Sql, _where, parse_query

    q = parse_query(params[:8])
    sql = _Sql()
    _where(q, sql)
    assert _from(sql).count("run_scalar_names") == 1


def test_out_of_range_times_are_422_and_the_connection_survives(live_server: Any) -> None:
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        for params in ({"since": "1e20"}, {"until": "253402300800"}, {"since": "-5"}, {"since": "99999-01-01"}):
            r = c.get("/api/v1/runs", params=params)
            assert r.status_code == 422, (params, r.text)
            assert list(params)[0] in r.json()["error"]["message"]
            # the same keep-alive connection answers the next request
            assert c.get("/api/v1/runs").status_code == 200
        r = c.get("/runs-table", params={"filter": "since=1e20"})
        assert r.status_code == 200


def test_reads_have_their_own_pool_with_a_statement_budget(live_server: Any) -> None:
    st = live_server.state
    assert st.read_engine is not None and st.read_engine is not st.engine
    with st.read_engine.connect() as c:
        assert c.execute(text("SHOW statement_timeout")).scalar() == "5s"
    with st.engine.connect() as c:  # ingest's connections have no read budget
        assert c.execute(text("SHOW statement_timeout")).scalar() == "0"


def _lock_runs(db_url: str) -> tuple[psycopg.Connection[Any], threading.Event]:
    conn = psycopg.connect(libpq_url(db_url))
    conn.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")  # held until rollback: every read of runs waits
    return conn, threading.Event()


def _waiting_reads(db_url: str) -> int:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as c:
        return int(c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND query ILIKE '%FROM runs r%'").fetchone()[0])


def test_a_read_past_its_budget_is_503_naming_it(db_url: str) -> None:
    srv = start_server(db_url, read_timeout_s=0.5)
    lock = None
    try:
        lock, _ = _lock_runs(db_url)
        t0 = time.monotonic()
        r = httpx.get(f"{srv.url}/api/v1/runs", timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "budget" in r.json()["error"]["message"] and "database unavailable" not in r.text
        assert took < 25  # cancelled by its budget, not by the client's timeout
        assert httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
    finally:
        if lock is not None:
            lock.rollback()
            lock.close()
        srv.stop()


def test_a_client_that_goes_away_cancels_its_statement(db_url: str) -> None:
    srv = start_server(db_url, read_timeout_s=60)
    lock = None
    try:
        lock, _ = _lock_runs(db_url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{srv.url}/api/v1/runs", timeout=1.0)  # gives up after 1 s and closes the connection
        # the abandoned read no longer waits in Postgres, though the lock is still held and its budget is 60 s
        deadline = time.monotonic() + 15
        while _waiting_reads(db_url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _waiting_reads(db_url) == 0
        from fleetscope.server.reads import cancel_count

        assert cancel_count() >= 1
    finally:
        if lock is not None:
            lock.rollback()
            lock.close()
        srv.stop()


def test_malformed_dash_callbacks_are_json_400s(live_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    url = f"{live_server.url}/_dash-update-component"
    bodies = [b"{not json", b"[1, 2]", b'"x"', b'{"output": 5}', b"",
              b'{"output": "nope.children", "outputs": {"id": "nope", "property": "children"}, "inputs": []}',
              b'{"output": "x", "inputs": [1]}']
    with httpx.Client(timeout=30) as c:
        for body in bodies:
            r = c.post(url, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (body, r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/json")
            assert "malformed callback request" in r.json()["error"]["message"]
        assert c.get(f"{live_server.url}/healthz").status_code == 200
    assert "Traceback" not in caplog.text


def test_read_admission_answers_503_past_its_concurrency() -> None:
    import asyncio

    from fleetscope.server.reads import CancelOnDisconnect

    release = asyncio.Event()
    served: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        served.append(scope["path"])
        if scope["path"] == "/api/v1/runs":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(mw: Any, path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)  # the client stays
            return {"type": "http.disconnect"}

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        await mw({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)
        return int(sent[0]["status"])

    async def scenario() -> tuple[int, int, int]:
        mw = CancelOnDisconnect(app, concurrency=1, wait_s=0.2)
        first = asyncio.ensure_future(call(mw, "/api/v1/runs"))  # holds the one slot
        await asyncio.sleep(0.05)
        second = await call(mw, "/api/v1/runs/1")  # waits 0.2 s for a slot, then 503
        health = await call(mw, "/healthz")  # not counted
        release.set()
        return await first, second, health

    first, second, health = asyncio.run(scenario())
    assert (first, second, health) == (200, 503, 200)
    assert served == ["/api/v1/runs", "/healthz"]
