"""Tokens with a lifecycle: scopes, expiry, list without secrets, revocation effective at once on every
server instance (two `fleetscope serve` processes on one database)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
from conftest import free_port, wait_healthy
from fleetscope.server.auth import TokenError, TokenVerifier, create_token, list_tokens, revoke_token
from sqlalchemy import text

FS = [sys.executable, "-m", "fleetscope.cli"]
REG = {"name": "tok-run", "model_family": "f", "world_size": 2}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FS, *args], capture_output=True, text=True, timeout=120)


def test_scopes_expiry_and_revocation_are_checked_on_every_request(engine: Any) -> None:
    v = TokenVerifier(engine)
    ingest = create_token(engine, "ci", scope="ingest")
    read = create_token(engine, "viewer", scope="read")
    admin = create_token(engine, "ops", scope="admin")
    assert v.verify(f"Bearer {ingest}", scope="ingest") and not v.verify(f"Bearer {ingest}", scope="admin")
    assert v.verify(f"Bearer {read}", scope="read") and not v.verify(f"Bearer {read}", scope="ingest")
    assert all(v.verify(f"Bearer {admin}", scope=s) for s in ("ingest", "read", "admin"))
    with pytest.raises(TokenError, match="active token named 'ci'"):
        create_token(engine, "ci")
    with pytest.raises(TokenError, match="scope must be one of"):
        create_token(engine, "x", scope="root")
    assert revoke_token(engine, "ci") == 1
    assert v.authenticate(f"Bearer {ingest}") is None  # no cache: revoked is refused on the next request
    short = create_token(engine, "short", expires_in_days=1)
    assert v.verify(f"Bearer {short}")
    with engine.begin() as c:
        c.execute(text("UPDATE api_tokens SET expires_at = now() - interval '1 second' WHERE name = 'short'"))
    assert v.authenticate(f"Bearer {short}") is None
    rows = {r["name"]: r for r in list_tokens(engine)}
    assert rows["ci"]["state"] == "revoked" and rows["short"]["state"] == "expired" and rows["ops"]["state"] == "active"
    assert rows["ops"]["last_used_at"] is not None and rows["viewer"]["scope"] == "read"
    assert all("hash" not in k for r in rows.values() for k in r)


def test_token_cli_creates_lists_without_secrets_and_revokes(db_url: str) -> None:
    out = _cli("token", "create", "--name", "ci-bot", "--scope", "ingest", "--expires-in", "30", "--database-url", db_url)
    assert out.returncode == 0, out.stderr
    secret = out.stdout.strip().splitlines()[-1]
    assert secret.startswith("fs_")
    listed = _cli("token", "list", "--database-url", db_url)
    assert listed.returncode == 0 and "ci-bot" in listed.stdout and "ingest" in listed.stdout
    assert secret not in listed.stdout and secret[8:20] not in listed.stdout
    bad = _cli("token", "create", "--name", "x", "--scope", "root", "--database-url", db_url)
    assert bad.returncode == 2 and "scope must be one of" in bad.stderr
    assert _cli("token", "revoke", "ci-bot", "--database-url", db_url).returncode == 0
    assert "revoked" in _cli("token", "list", "--database-url", db_url).stdout
    missing = _cli("token", "revoke", "nobody", "--database-url", db_url)
    assert missing.returncode == 1 and "no active token named 'nobody'" in missing.stderr


def _serve(db_url: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    p = subprocess.Popen([*FS, "serve", "--port", str(port), "--database-url", db_url], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    return p, f"http://127.0.0.1:{port}"


def test_revoked_token_gets_401_at_once_on_two_server_processes(db_url: str) -> None:
    assert _cli("db", "upgrade", "--database-url", db_url).returncode == 0
    tok = _cli("token", "create", "--name", "agent", "--database-url", db_url).stdout.strip().splitlines()[-1]
    servers = [_serve(db_url), _serve(db_url)]
    try:
        for p, url in servers:
            wait_healthy(url, p)
        h = {"Authorization": f"Bearer {tok}"}
        for _, url in servers:
            assert httpx.post(f"{url}/api/v1/runs", json=REG, headers=h, timeout=10).status_code == 200
        assert _cli("token", "revoke", "agent", "--database-url", db_url).returncode == 0
        for _, url in servers:
            r = httpx.post(f"{url}/api/v1/runs", json=REG, headers=h, timeout=10)
            assert r.status_code == 401, r.text
    finally:
        for p, _ in servers:
            os.killpg(p.pid, signal.SIGTERM)
        for p, _ in servers:
            p.wait(60)


def test_ingest_token_cannot_administer_alerts_but_admin_can(live_server: Any) -> None:
    ingest = create_token(live_server.app.state.fs.engine, "ingest-only")
    with httpx.Client(base_url=live_server.url) as c:
        r = c.post("/api/v1/alerts/1/ack", headers={"Authorization": f"Bearer {ingest}"})
        assert r.status_code == 403 and "needs 'admin'" in r.json()["detail"]
        r = c.post("/api/v1/alerts/1/ack", headers={"Authorization": f"Bearer {live_server.token}"})
        assert r.status_code == 404  # admin passes the check; there is no alert 1
