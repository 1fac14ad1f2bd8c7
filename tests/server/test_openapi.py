"""The OpenAPI document: valid (openapi-spec-validator), a response model for every route, the summary
model declaring every key the summary returns, the bearer security scheme on writes, the one error
body on every error status each route declares — and the live server's errors in that shape."""

from __future__ import annotations

from typing import Any

import httpx
from openapi_spec_validator import validate

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

WRITES = {"post", "put", "patch", "delete"}


def _spec(srv: Any) -> dict[str, Any]:
    r = httpx.get(f"{srv.url}/openapi.json")
    assert r.status_code == 200
    return r.json()


def _ops(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(p, m, op) for p, ops in spec["paths"].items() for m, op in ops.items()]


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_the_document_is_valid_typed_and_declares_security_and_errors(live_server: Any) -> None:
    spec = _spec(live_server)
    validate(spec)  # raises on an invalid OpenAPI 3.1 document
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]["HTTPBearer"]["description"]}
    ops = _ops(spec)
    assert len(ops) >= 24
    for path, method, op in ops:
        where = f"{method.upper()} {path}"
        ok = op["responses"].get("200")
        assert ok is not None, where
        if path != "/metrics":
            schema = ok["content"]["application/json"]["schema"]
            body = _resolve(spec, schema)
            # a typed answer: a model with declared properties, not a bare object
            assert body.get("properties"), (where, schema)
        # the statuses each route can answer, all with the one error body
        want = {"503"}
        if path != "/healthz":
            want |= {"401", "403", "429"}
        if "{" in path:
            want.add("404")
        if op.get("parameters") or op.get("requestBody") or method in WRITES:
            want.add("422")
        assert want <= set(op["responses"]), (where, sorted(op["responses"]))
        for status, r in op["responses"].items():
            if int(status) >= 400:
                assert r["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}, (
                    where, status)
        # writes need the bearer token; reads take it optionally (needed with --read-auth)
        if method in WRITES:
            assert op["security"] == [{"HTTPBearer": []}], where
        elif path == "/healthz":
            assert op["security"] == [], where
        else:
            assert {"HTTPBearer": []} in op["security"] and {} in op["security"], where
    err = spec["components"]["schemas"]["ErrorBody"]
    assert err["required"] == ["error"]
    info = _resolve(spec, err["properties"]["error"])
    assert set(info["required"]) == {"status", "code", "message"}
    assert {"where", "loc", "errors"} <= set(info["properties"])


def test_the_summary_model_declares_every_key_the_summary_returns(live_server: Any) -> None:
    spec = RunSpec(name="typed", family="f", world_size=4, steps=6)
    with live_server.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    live_server.compact()
    doc = _spec(live_server)
    for path, model_keys_of in (
        (f"/api/v1/runs/{rid}/summary", "/api/v1/runs/{run_id}/summary"),
        (f"/api/v1/runs/{rid}", "/api/v1/runs/{run_id}"),
        (f"/api/v1/runs/{rid}/steps", "/api/v1/runs/{run_id}/steps"),
        (f"/api/v1/runs/{rid}/health", "/api/v1/runs/{run_id}/health"),
        ("/api/v1/nodes", "/api/v1/nodes"),
        (f"/api/v1/runs/{rid}/overlap", "/api/v1/runs/{run_id}/overlap"),
    ):
        got = httpx.get(f"{live_server.url}{path}").json()
        schema = _resolve(doc, doc["paths"][model_keys_of]["get"]["responses"]["200"]["content"]["application/json"]["schema"])
        undeclared = set(got) - set(schema["properties"])
        assert not undeclared, (path, sorted(undeclared))
    summary = httpx.get(f"{live_server.url}/api/v1/runs/{rid}/summary").json()
    assert len(summary) >= 31


def test_every_error_comes_in_one_shape_and_keeps_what_agents_read(live_server: Any) -> None:
    h = {"Authorization": f"Bearer {live_server.token}"}
    with live_server.client() as c:
        rid = c.register_run({"name": "err", "world_size": 2})
    cases = {
        "404 (HTTPException)": httpx.get(f"{live_server.url}/api/v1/runs/999999"),
        "422 (validation)": httpx.get(f"{live_server.url}/api/v1/runs", params={"limit": "many"}),
        "422 (batch)": httpx.post(f"{live_server.url}/api/v1/ingest", headers=h,
                                  json={"v": 1, "run_id": rid, "rank_steps": {"rank": [0], "step": [1], "step_s": ["x"]}}),
        "401 (edge)": httpx.post(f"{live_server.url}/api/v1/runs", json={"name": "x"}),
        "415 (edge)": httpx.post(f"{live_server.url}/api/v1/runs", content=b"name=x", headers={
            **h, "Content-Type": "text/plain"}),
        "403 (scope)": httpx.delete(f"{live_server.url}/api/v1/runs/{rid}", headers={
            "Authorization": f"Bearer {_ingest_token(live_server)}"}),
    }
    for what, r in cases.items():
        status = int(what[:3])
        assert r.status_code == status, (what, r.status_code, r.text[:300])
        body = r.json()
        assert set(body) == {"error", "detail"}, (what, body)
        e = body["error"]
        assert e["status"] == status and isinstance(e["code"], str) and e["message"], (what, e)
    batch = cases["422 (batch)"].json()
    # the batch error's fields, where agents read them (detail.error / where / loc), and in `error`
    assert batch["detail"]["where"] == batch["error"]["where"] and batch["detail"]["loc"] == batch["error"]["loc"]
    assert batch["error"]["loc"]["section"] == "rank_steps" and batch["detail"]["error"] == batch["error"]["message"]
    invalid = cases["422 (validation)"].json()["error"]
    assert invalid["errors"][0]["loc"] == ["query", "limit"] and "limit" in invalid["message"]
    assert cases["404 (HTTPException)"].json()["error"]["code"] == "not_found"
    assert cases["401 (edge)"].json()["error"]["code"] == "unauthorized"


def _ingest_token(srv: Any) -> str:
    from fleetscope.server.auth import create_token

    return create_token(srv.state.engine, "ingest-only", scope="ingest")
