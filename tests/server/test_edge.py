"""The server's edge (server/edge.py) over real HTTP: body caps and auth before the body is read, the
Host check, media types, failed-auth rate limit, security headers, read auth and exposure."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import start_server
from fleetscope.server.auth import create_token
from sqlalchemy import text

WRITES = ["/api/v1/ingest", "/api/v1/runs", "/api/v1/runs/1/finish", "/api/v1/runs/1/traces", "/api/v1/benchmarks",
          "/api/v1/alerts/1/ack"]


def _raw(url: str, request: bytes, timeout: float = 10.0) -> tuple[int, bytes, float]:
    """Send ``request`` (headers only: the announced body never follows); the status and how long it took."""
    u = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data, time.monotonic() - t0


@pytest.mark.parametrize("path", WRITES)
def test_huge_declared_body_is_refused_before_it_is_sent(live_server: Any, path: str) -> None:
    req = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Content-Length: {200 * 1024 * 1024}\r\n\r\n").encode()
    status, data, took = _raw(live_server.url, req)
    assert status == 413 and b"exceeds the limit" in data
    assert took < 5  # answered without waiting for 200 MB that never come


def test_no_token_is_refused_before_the_body_is_read(live_server: Any) -> None:
    req = (b"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: 60000\r\n\r\n")  # under the cap; the body never comes
    status, data, took = _raw(live_server.url, req)
    assert status == 401 and took < 5


def test_chunked_body_past_the_cap_is_413_and_writes_nothing(live_server: Any) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "x", "model_family": "f", "world_size": 1, "meta": {"pad": "'
        for _ in range(100):
            yield b"a" * 4096
        yield b'"}}'

    h = {"Authorization": f"Bearer {live_server.token}", "Content-Type": "application/json"}
    r = httpx.post(f"{live_server.url}/api/v1/runs", content=chunks(), headers=h, timeout=30)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    with live_server.app.state.fs.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM runs")).scalar() == 0
    # the connection pool is still usable afterwards
    assert httpx.get(f"{live_server.url}/healthz").status_code == 200


def test_foreign_host_header_is_refused(live_server: Any) -> None:
    r = httpx.get(f"{live_server.url}/api/v1/runs", headers={"Host": "attacker.example:8000"})
    assert r.status_code == 400 and "Host" in r.json()["detail"]
    assert httpx.get(f"{live_server.url}/api/v1/runs", headers={"Host": "localhost"}).status_code == 200


def test_security_headers_on_api_and_dashboard(live_server: Any) -> None:
    for path in ("/api/v1/runs", "/", "/healthz"):
        r = httpx.get(f"{live_server.url}{path}", timeout=30)
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_failed_authentications_are_rate_limited_per_client(db_url: str) -> None:
    srv = start_server(db_url, auth_fail_limit=5, auth_fail_window_s=30)
    try:
        with httpx.Client(base_url=srv.url) as c:
            codes = [c.post("/api/v1/runs", json={}, headers={"Authorization": "Bearer fs_bad"}).status_code
                     for _ in range(6)]
            assert codes == [401] * 5 + [429]
            r = c.post("/api/v1/runs", json={}, headers={"Authorization": "Bearer fs_bad"})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            # a valid token from the same address is not locked out (tests/server/test_auth_lockout.py)
            r = c.post("/api/v1/runs", json={"name": "x"}, headers={"Authorization": f"Bearer {srv.token}"})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_without_auth_a_write_needs_a_json_or_msgpack_body(db_url: str) -> None:
    srv = start_server(db_url, insecure_no_auth=True)
    try:
        r = httpx.post(f"{srv.url}/api/v1/runs", content=b'{"name": "x", "model_family": "f", "world_size": 1}',
                       headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "application/json" in r.json()["detail"]
        with srv.app.state.fs.engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM runs")).scalar() == 0
    finally:
        srv.stop()


def test_read_auth_covers_api_dashboard_metrics_and_docs(db_url: str) -> None:
    srv = start_server(db_url, read_auth=True)
    try:
        eng = srv.app.state.fs.engine
        read, ingest = create_token(eng, "viewer", scope="read"), create_token(eng, "agent")
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for path in ("/api/v1/runs", "/", "/metrics", "/docs", "/openapi.json"):
                assert c.get(path).status_code == 401, path
                assert c.get(path, headers={"Authorization": f"Bearer {ingest}"}).status_code == 403, path
                assert c.get(path, headers={"Authorization": f"Bearer {read}"}).status_code == 200, path
            assert c.get("/healthz").status_code == 200
            # the agent's writes still work with an ingest token
            r = c.post("/api/v1/runs", json={"name": "r", "model_family": "f", "world_size": 1},
                       headers={"Authorization": f"Bearer {ingest}"})
            assert r.status_code == 200
            # browser sign-in: ?token= once → HttpOnly cookie, token gone from the URL
            r = c.get("/?token=" + read, follow_redirects=False)
            assert r.status_code == 303 and r.headers["location"] == "/"
            assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=Strict" in r.headers["set-cookie"]
            assert c.get("/api/v1/runs").status_code == 200  # the cookie is sent back by the client
    finally:
        srv.stop()


def test_serve_on_a_public_address_refuses_open_reads_unless_told() -> None:
    r = subprocess.run([sys.executable, "-m", "fleetscope.cli", "serve", "--host", "0.0.0.0",
                        "--database-url", "postgresql://nobody@127.0.0.1:1/none"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--read-auth" in r.stderr and "--allow-public-reads" in r.stderr
