"""Postgres stopped under a running server: every route answers 503 with Retry-After (reads, token
checks, ingest, /healthz), never 500. (Recovery under load belongs to the fault benchmarks of issue #13.)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx
from conftest import start_server
from fleetscope.server.db import EmbeddedPostgres


def test_reads_auth_and_ingest_answer_503_while_postgres_is_down_then_recover() -> None:
    d = Path(tempfile.mkdtemp(prefix="fso-", dir="/tmp"))
    pg = EmbeddedPostgres(d)
    url = pg.start()
    srv = None
    try:
        srv = start_server(url)
        h = {"Authorization": f"Bearer {srv.token}"}
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            rid = c.post("/api/v1/runs", json={"name": "o", "model_family": "f", "world_size": 1}, headers=h).json()["id"]
            pg.stop()
            checks = {
                "read": c.get("/api/v1/runs"),
                "summary": c.get(f"/api/v1/runs/{rid}/summary"),
                "token check": c.post("/api/v1/runs", json={"name": "p"}, headers=h),
                "ingest": c.post("/api/v1/ingest", json={"v": 1, "run_id": rid}, headers=h),
                "healthz": c.get("/healthz"),
            }
            for what, r in checks.items():
                assert r.status_code == 503, (what, r.status_code, r.text[:300])
                assert int(r.headers["retry-after"]) >= 1, what
            # the same keep-alive client is still served: a 503 closes nothing
            assert c.get("/api/v1/runs").status_code == 503
    finally:
        if srv is not None:
            srv.stop()
        pg.stop()
        shutil.rmtree(d, ignore_errors=True)
