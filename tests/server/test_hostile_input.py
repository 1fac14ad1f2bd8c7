"""Hostile but small inputs over real HTTP: each answers a 4xx naming the field, writes nothing, and
leaves the keep-alive connection usable; reads tolerate whatever is already stored."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from sqlalchemy import text

REG = {"name": "hostile", "model_family": "f", "world_size": 4}
TABLES = ("runs", "ingest_fragments", "modality_raw", "run_events", "ranks", "benchmark_series", "trace_summaries")


def _counts(srv: Any) -> dict[str, int]:
    with srv.app.state.fs.engine.connect() as c:
        return {t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in TABLES}


@pytest.fixture
def api(live_server: Any) -> Any:
    with httpx.Client(base_url=live_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {live_server.token}"}) as c:
        rid = c.post("/api/v1/runs", json=REG).json()["id"]
        yield live_server, c, rid


def _raw_json(c: httpx.Client, path: str, body: str) -> httpx.Response:
    return c.post(path, content=body.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})


def _check(srv: Any, c: httpx.Client, r: httpx.Response, field: str, before: dict[str, int]) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert field in r.text, (field, r.text[:500])
    assert len(r.content) < 4096, "the error must not echo the whole input back"
    assert r.headers.get("connection", "").lower() != "close"
    assert _counts(srv) == before
    assert c.get("/healthz").status_code == 200  # the same client, still usable


def _steps(rid: int, **cols: Any) -> str:
    base: dict[str, Any] = {"rank": [0], "step": [0], "step_s": [0.1]}
    base.update(cols)
    return json.dumps({"v": 1, "run_id": rid, "rank_steps": base})


@pytest.mark.parametrize("case, field", [
    ("deep_nesting", "nested"),
    ("huge_int_step", "step"),
    ("huge_int_tokens", "tokens"),
    ("string_for_float", "step_s"),
    ("bool_for_float", "step_s"),
    ("nested_list_column", "step_s"),
    ("bool_for_int", "rank"),
    ("float_for_int", "tokens"),
    ("event_kind_not_string", "kind"),
    ("event_ts_huge", "ts"),
    ("event_ts_huge_int", "ts"),
    ("lone_surrogate_host", "host"),
    ("event_data_too_deep", "data"),
])
def test_hostile_ingest_batch_is_a_4xx_naming_the_field(api: Any, case: str, field: str) -> None:
    srv, c, rid = api
    before = _counts(srv)
    body = {
        "deep_nesting": '{"v": 1, "run_id": ' + str(rid) + ', "rank_steps": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "huge_int_step": _steps(rid, step=[10**400]),
        "huge_int_tokens": _steps(rid, tokens=[10**400]),
        "string_for_float": _steps(rid, step_s=["1.0"]),
        "bool_for_float": _steps(rid, step_s=[True]),
        "nested_list_column": _steps(rid, step_s=[[1.0]]),
        "bool_for_int": _steps(rid, rank=[True]),
        "float_for_int": _steps(rid, tokens=[1.5]),
        "event_kind_not_string": json.dumps({"v": 1, "run_id": rid, "events": [
            {"rank": 0, "seq": 0, "kind": 5, "ts": 1.7e9, "data": {}}]}),
        "event_ts_huge": json.dumps({"v": 1, "run_id": rid, "events": [
            {"rank": 0, "seq": 0, "kind": "note", "ts": 1e308, "data": {}}]}),
        "event_ts_huge_int": json.dumps({"v": 1, "run_id": rid, "events": [
            {"rank": 0, "seq": 0, "kind": "note", "ts": 10**400, "data": {}}]}),
        "lone_surrogate_host": '{"v": 1, "run_id": ' + str(rid) + ', "ranks": [{"rank": 0, "host": "a\\ud800b"}]}',
        "event_data_too_deep": json.dumps({"v": 1, "run_id": rid, "events": [
            {"rank": 0, "seq": 0, "kind": "note", "ts": 1.7e9, "data": json.loads('{"a":' * 200 + "1" + "}" * 200)}]}),
    }[case]
    _check(srv, c, _raw_json(c, "/api/v1/ingest", body), field, before)


@pytest.mark.parametrize("case, field", [
    ("config_too_deep", "config"),
    ("meta_too_deep", "meta"),
    ("name_lone_surrogate", "name"),
    ("name_nul", "name"),
    ("world_size_bool", "world_size"),
    ("world_size_string", "world_size"),
    ("world_size_huge", "world_size"),
    ("config_huge_int", "config"),
])
def test_hostile_run_registration_is_a_4xx_naming_the_field(api: Any, case: str, field: str) -> None:
    srv, c, _ = api
    before = _counts(srv)
    deep = '{"a":' * 250 + "1" + "}" * 250
    body = {
        "config_too_deep": '{"name": "x1", "config": ' + deep + "}",
        "meta_too_deep": '{"name": "x2", "meta": ' + deep + "}",
        "name_lone_surrogate": '{"name": "x\\udc80"}',
        "name_nul": '{"name": "x\\u0000y"}',
        "world_size_bool": '{"name": "x3", "world_size": true}',
        "world_size_string": '{"name": "x4", "world_size": "8"}',
        "world_size_huge": '{"name": "x5", "world_size": 100000000}',
        "config_huge_int": '{"name": "x6", "config": {"lr": ' + "9" * 400 + "}}",
    }[case]
    _check(srv, c, _raw_json(c, "/api/v1/runs", body), field, before)


def test_hostile_benchmark_and_trace_strings_are_4xx(api: Any) -> None:
    srv, c, rid = api
    before = _counts(srv)
    r = _raw_json(c, "/api/v1/benchmarks", '{"points": [{"name": "mm", "cluster": "a\\ud800", "value": 1.0}]}')
    _check(srv, c, r, "cluster", before)
    r = _raw_json(c, f"/api/v1/runs/{rid}/traces", '{"source": "x\\udfff", "ranks": {}}')
    _check(srv, c, r, "source", before)


def test_another_token_cannot_raise_world_size_reopen_or_rewrite_a_run(api: Any) -> None:
    from fleetscope.server.auth import create_token

    srv, c, rid = api
    other = create_token(srv.app.state.fs.engine, "other-team")
    h = {"Authorization": f"Bearer {other}"}
    assert c.post(f"/api/v1/runs/{rid}/finish", json={"status": "finished"}).status_code == 200
    r = c.post("/api/v1/runs", json={**REG, "world_size": 100_000, "meta": {"x": 1}}, headers=h)
    assert r.status_code == 200 and r.json()["id"] != rid  # the name in its own namespace: a run of its own ...
    run = c.get(f"/api/v1/runs/{rid}").json()
    assert run["world_size"] == 4 and run["status"] == "finished" and "x" not in (run.get("meta") or {})
    # ... and finishing another token's run needs admin
    assert c.post(f"/api/v1/runs/{rid}/finish", json={"status": "failed"}, headers=h).status_code == 403


def test_admin_deletes_a_poisoned_run_and_everything_that_hangs_off_it(live_server: Any) -> None:
    import subprocess
    import sys

    from fleetscope.server.auth import create_token

    from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

    srv = live_server
    spec = RunSpec(name="poisoned", family="f", world_size=2, steps=3, seed=1)
    with srv.client() as c:
        from fleetscope.client import columnar
        from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS

        rid = c.register_run(spec.run_info())
        rows, colls = [], []
        for step, rs in rank_step_rows(spec):
            rows += rs
            colls += collective_rows(spec, step, rs)
        c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar(rows, RANK_STEP_FIELDS),
                  "collectives": columnar(colls, COLLECTIVE_FIELDS),
                  "events": [{"rank": 0, "seq": 0, "kind": "note", "ts": 1.7e9, "data": {}}]})
    ingest_only = create_token(srv.app.state.fs.engine, "not-admin")
    r = httpx.delete(f"{srv.url}/api/v1/runs/{rid}", headers={"Authorization": f"Bearer {ingest_only}"})
    assert r.status_code == 403
    out = subprocess.run([sys.executable, "-m", "fleetscope.cli", "delete-run", "poisoned", "--server", srv.url],
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                           "FLEETSCOPE_TOKEN": srv.token})
    assert out.returncode == 0 and f"deleted run {rid}" in out.stdout, out.stderr
    with srv.app.state.fs.engine.connect() as conn:
        for t in ("runs", "ingest_fragments", "steps", "run_collectives", "run_events", "ranks"):
            col = "id" if t == "runs" else "run_id"
            assert conn.execute(text(f"SELECT count(*) FROM {t} WHERE {col} = :r"), {"r": rid}).scalar_one() == 0, t
    assert httpx.get(f"{srv.url}/api/v1/runs/{rid}").status_code == 404
    again = subprocess.run([sys.executable, "-m", "fleetscope.cli", "delete-run", str(rid), "--server", srv.url,
                            "--token", srv.token], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "404" in again.stderr
