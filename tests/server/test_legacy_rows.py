"""Reads tolerate what an older server stored before the strict checks: a legacy bad row shows as
such, never a 500 (run list, run, summary, run page data, fleet)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fleetscope.server import reports
from sqlalchemy import text


def test_legacy_bad_rows_never_make_reads_fail(live_server: Any) -> None:
    srv = live_server
    eng = srv.app.state.fs.engine
    with httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {srv.token}"}) as c:
        rid = c.post("/api/v1/runs", json={"name": "legacy", "model_family": "f", "world_size": 2}).json()["id"]
        deep = json.loads('{"a":' * 260 + "1" + "}" * 260)
        with eng.begin() as conn:  # what an older server let through
            conn.execute(text("UPDATE runs SET config = CAST(:c AS jsonb), meta = CAST(:m AS jsonb) WHERE id = :i"),
                         {"c": json.dumps(deep), "m": json.dumps({"n": 10**30, "deep": deep}), "i": rid})
            conn.execute(text("INSERT INTO run_events (run_id, rank, seq, kind, ts, step, data) VALUES "
                              "(:i, 0, 0, 'note', 1e308, NULL, '{}'), (:i, 1, 0, 'ckpt', 'infinity', 5, '{}')"),
                         {"i": rid})
        for path in ("/api/v1/runs", f"/api/v1/runs/{rid}", f"/api/v1/runs/{rid}/summary",
                     f"/api/v1/runs/{rid}/collectives", "/api/v1/alerts"):
            r = c.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[:300])
        for fn in (reports.run_events, reports.goodput, reports.run_series):
            fn(eng, rid)  # the run page's data: no exception
        assert any(row["id"] == rid for row in reports.fleet_rows(eng))
        assert c.get(f"/runs/{rid}").status_code == 200
