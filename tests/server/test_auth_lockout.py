"""The failed-auth limit locks out failing requests, never a valid token: it counts per credential (each
presented token; requests without a token per client address — the TCP peer unless the peer is a
configured proxy, X-Forwarded-For); every 429 and 503 says when to come back.

The servers here are started with the uvicorn configuration ``fleetscope serve`` uses
(``server.serve.uvicorn_config``: uvicorn's own proxy-header handling off), over loopback HTTP."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import LiveServer, start_server
from fleetscope.server.db import EmbeddedPostgres

REG = {"name": "lockout", "model_family": "f", "world_size": 1}


@pytest.fixture
def server_factory(db_url: str) -> Iterator[Any]:
    started: list[LiveServer] = []

    def make(**overrides: Any) -> LiveServer:
        srv = start_server(db_url, **overrides)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def _post(c: httpx.Client, token: str | None, xff: str | None = None) -> httpx.Response:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    if xff is not None:
        h["X-Forwarded-For"] = xff
    return c.post("/api/v1/runs", json=REG, headers=h)


def test_a_valid_token_passes_from_an_address_locked_out_by_bad_tokens(server_factory: Any) -> None:
    srv = server_factory()  # the default limit: 20 failures a minute
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        codes = [_post(c, "fs_bad").status_code for _ in range(21)]
        assert codes == [401] * 20 + [429]
        # the address is over the limit, but a request with a valid token passes, again and again
        for _ in range(3):
            r = _post(c, srv.token)
            assert r.status_code == 200, r.text
        # the failing credential still gets 429 with a Retry-After within the window
        r = _post(c, "fs_bad")
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 61, r.headers
        # the limit is per credential: no token, or another token, from the same address has its own count
        assert _post(c, None).status_code == 401 and _post(c, "fs_other").status_code == 401


def test_valid_requests_are_never_counted_as_failures(server_factory: Any) -> None:
    srv = server_factory(auth_fail_limit=3, auth_fail_window_s=30)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert [_post(c, "fs_bad").status_code for _ in range(2)] == [401, 401]
        assert all(_post(c, srv.token).status_code == 200 for _ in range(10))
        assert _post(c, "fs_bad").status_code == 401  # the third failure: still under the limit
        assert _post(c, "fs_bad").status_code == 429


def test_x_forwarded_for_is_ignored_unless_the_peer_is_a_configured_proxy(server_factory: Any) -> None:
    # requests without a token are counted per client address
    plain = server_factory(auth_fail_limit=3, auth_fail_window_s=30)
    with httpx.Client(base_url=plain.url, timeout=30) as c:
        # a client cannot escape the limit (or pin it on others) by inventing X-Forwarded-For
        codes = [_post(c, None, xff=f"10.0.0.{i}").status_code for i in range(4)]
        assert codes == [401, 401, 401, 429]

    proxied = server_factory(auth_fail_limit=3, auth_fail_window_s=30, forwarded_allow_ips="127.0.0.0/8, 10.9.9.9")
    with httpx.Client(base_url=proxied.url, timeout=30) as c:
        assert [_post(c, None, xff="10.0.0.1").status_code for _ in range(4)] == [401, 401, 401, 429]
        # another client behind the same proxy is not locked out
        assert _post(c, None, xff="10.0.0.2").status_code == 401
        # the nearest hop that is not a trusted proxy is the client: a spoofed leftmost entry does not count
        assert _post(c, None, xff="10.0.0.2, 10.0.0.1").status_code == 429
        assert _post(c, None, xff="10.0.0.1, 10.0.0.3, 10.9.9.9").status_code == 401  # client 10.0.0.3
        # and a valid token from the locked-out client passes
        assert _post(c, proxied.token, xff="10.0.0.1").status_code == 200


def test_a_flood_of_failed_auth_from_the_agents_address_never_refuses_their_batches(server_factory: Any) -> None:
    """Behind a proxy every agent shares one address: an unauthenticated (and bad-token) flood from it
    is limited, while agents with valid tokens keep writing — every batch accepted — and the flood's
    429s count as ``auth_limited``, not as overload."""
    import threading

    from fleetscope.server.auth import create_token
    from prometheus_client.parser import text_string_to_metric_families

    from fleetscope.client import columnar
    from fleetscope.synthetic import RunSpec, rank_step_rows
    from fleetscope.wire import RANK_STEP_FIELDS

    srv = server_factory(auth_fail_limit=5, auth_fail_window_s=60)
    tokens = [srv.token, create_token(srv.state.engine, "agent-b", scope="ingest")]
    stop = threading.Event()
    flood_codes: list[int] = []

    def flood() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            i = 0
            while not stop.is_set():
                token = None if i % 2 == 0 else f"fs_guess{i % 7}"
                r = c.post("/api/v1/ingest", json={"v": 1, "run_id": 1}, headers=(
                    {"Authorization": f"Bearer {token}"} if token else {}))
                flood_codes.append(r.status_code)
                i += 1

    t = threading.Thread(target=flood)
    t.start()
    accepted: dict[str, int] = {}
    try:
        while len(flood_codes) < 30:  # the flood is over its limit before the agents start
            stop.wait(0.05)
        for k, token in enumerate(tokens):
            with srv.client(token) as c:
                spec = RunSpec(name=f"agent-{k}", family="f", world_size=2, steps=6, seed=k)
                rid = c.register_run(spec.run_info())
                for _, rows in rank_step_rows(spec):
                    # no retries: a single refused batch fails the test
                    res = c.ingest({"v": 1, "run_id": rid, "rank_steps": columnar(rows, RANK_STEP_FIELDS, binary=True)},
                                   retries=0)
                    accepted[spec.name] = accepted.get(spec.name, 0) + res["accepted"]["rank_steps"]
    finally:
        stop.set()
        t.join(30)
    assert accepted == {"agent-0": 12, "agent-1": 12}
    assert 429 in flood_codes and set(flood_codes) <= {401, 429}, set(flood_codes)
    text = httpx.get(f"{srv.url}/metrics").text
    reasons = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
               if f.name == "fleetscope_ingest_rejections" for s in f.samples if s.name.endswith("_total")}
    assert reasons["auth_limited"] == flood_codes.count(429) and reasons["auth"] == flood_codes.count(401)
    assert "overloaded" not in reasons


def test_forwarded_allow_ips_comes_from_the_environment_and_refuses_garbage(monkeypatch: Any) -> None:
    from fleetscope.server.settings import Settings
    from pydantic import ValidationError

    assert Settings().forwarded_allow_ips == []
    monkeypatch.setenv("FLEETSCOPE_FORWARDED_ALLOW_IPS", "10.0.0.0/8, ::1,*")
    assert Settings().forwarded_allow_ips == ["10.0.0.0/8", "::1", "*"]
    monkeypatch.setenv("FLEETSCOPE_FORWARDED_ALLOW_IPS", "proxy.example.com")
    with pytest.raises(ValidationError, match="not an IP address or network"):
        Settings()


def test_healthz_and_every_route_answer_503_with_retry_after_while_postgres_is_down() -> None:
    d = Path(tempfile.mkdtemp(prefix="fsl-", dir="/tmp"))
    pg = EmbeddedPostgres(d)
    url = pg.start()
    srv = None
    try:
        srv = start_server(url)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            pg.stop()
            for r in (c.get("/healthz"), c.get("/api/v1/runs"), _post(c, srv.token)):
                assert r.status_code == 503, (r.request.url, r.text[:200])
                assert int(r.headers["retry-after"]) >= 1, r.request.url
    finally:
        if srv is not None:
            srv.stop()
        pg.stop()
        shutil.rmtree(d, ignore_errors=True)


def _count_lookups(srv: LiveServer) -> list[str | None]:
    """Wrap the server's token verifier: every database lookup of a token is appended to the list."""
    verifier = srv.state.tokens
    real = verifier.authenticate
    calls: list[str | None] = []

    def counting(authorization: str | None) -> Any:
        calls.append(authorization)
        return real(authorization)

    verifier.authenticate = counting
    return calls


def test_a_spray_of_distinct_bad_tokens_from_one_address_is_limited_without_a_lookup_each(server_factory: Any) -> None:
    """300 different made-up tokens from one address: each of the first ``auth_fail_limit`` is looked up
    (401), then the address is over its budget of distinct bad tokens: 429, and no more lookups — while a
    valid token from that address still passes, and one created during the spray passes too."""
    import secrets
    import time

    from fleetscope.server.auth import create_token

    srv = server_factory(auth_fail_limit=20, auth_fail_window_s=60, auth_known_tokens_refresh_s=0.5)
    lookups = _count_lookups(srv)
    t0 = time.monotonic()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        codes = [_post(c, "fs_" + secrets.token_urlsafe(32)).status_code for _ in range(300)]
        elapsed = time.monotonic() - t0
        assert codes == [401] * 20 + [429] * 280, codes
        assert len(lookups) == 20  # the database saw the first 20, not the other 280
        # the token list is read at most once per auth_known_tokens_refresh_s meanwhile (one query, all tokens)
        assert 1 <= srv.state.tokens.prefix_reads <= 2 + elapsed / 0.5, (srv.state.tokens.prefix_reads, elapsed)
        r = _post(c, "fs_" + secrets.token_urlsafe(32))
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 61, r.headers
        assert "from this client" in r.json()["detail"]
        # a valid token from the limited address passes, again and again (each looked up: revocation holds)
        n = len(lookups)
        for _ in range(3):
            assert _post(c, srv.token).status_code == 200
        assert len(lookups) == n + 3
        # so does a token created now, once the server has re-read the token list (within the refresh time)
        fresh = create_token(srv.state.engine, "fresh", scope="ingest")
        deadline = time.monotonic() + 10
        while (r := _post(c, fresh)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        # requests without a token have their own count and are not limited by the spray
        assert _post(c, None).status_code == 401


def test_a_token_differing_only_in_case_or_spacing_is_one_credential_for_the_limiter(server_factory: Any) -> None:
    srv = server_factory(auth_fail_limit=3, auth_fail_window_s=30)
    lookups = _count_lookups(srv)
    variants = ["Bearer fs_badtoken", "bearer FS_BADTOKEN", "BEARER   fs_BadToken", "Bearer\tfs_badTOKEN"]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        codes = [c.post("/api/v1/runs", json=REG, headers={"Authorization": v}).status_code for v in variants]
        assert codes == [401, 401, 401, 429]  # one credential: its count reached the limit
        assert len(lookups) == 3
        # the address is not over its budget of distinct bad tokens (it presented one): another is looked up
        assert _post(c, "fs_another").status_code == 401 and len(lookups) == 4


def _raw_post(url: str, authorization: str) -> int:
    """POST /api/v1/runs with the Authorization header's bytes exactly as given (httpx refuses surrounding
    whitespace in a header value; a client on a raw socket can send it)."""
    import json
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    body = json.dumps(REG).encode()
    req = (f"POST /api/v1/runs HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nAuthorization:{authorization}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(req + body)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


def test_bearer_token_parsing_is_normalised() -> None:
    from fleetscope.server.auth import bearer_token

    for authz in ("bearer  fs_x ", "BEARER fs_x", "  Bearer\tfs_x", "BeArEr fs_x  ", "Bearer \t fs_x\t"):
        assert bearer_token(authz) == "fs_x", authz
    for authz in (None, "", "Bearer", "Bearer   ", "Basic fs_x", "fs_x", "Bearerfs_x", "Bearer " + "x" * 600):
        assert bearer_token(authz) is None, authz


def test_bearer_scheme_in_any_case_with_odd_spacing_authenticates(server_factory: Any) -> None:
    srv = server_factory()
    # surrounding whitespace and a lower-case scheme, byte for byte on the wire
    for authz in (f" bearer  {srv.token} ", f"BEARER {srv.token}\t", f"\tBeArEr\t{srv.token}  "):
        assert _raw_post(srv.url, authz) == 200, repr(authz)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for authz in (f"bearer  {srv.token}", f"BEARER {srv.token}", f"Bearer\t{srv.token}", f"BeArEr {srv.token}"):
            r = c.post("/api/v1/runs", json=REG, headers={"Authorization": authz})
            assert r.status_code == 200, (authz, r.text)
        # the token itself is case-sensitive: a case variant of a valid token is not valid
        assert _post(c, srv.token.upper()).status_code == 401
        # another scheme, or a scheme without a token, is no token at all
        for authz in (f"Basic {srv.token}", "Bearer", srv.token):
            r = c.post("/api/v1/runs", json=REG, headers={"Authorization": authz})
            assert r.status_code == 401, authz


def test_a_valid_token_is_never_locked_out_even_after_its_case_variants_failed(server_factory: Any) -> None:
    """A case variant of a valid token fails (tokens are case-sensitive) and fills the credential's count
    — the valid token itself still passes: it may be valid, and it never failed."""
    srv = server_factory(auth_fail_limit=3, auth_fail_window_s=30)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        wrong = srv.token[:3] + srv.token[3:].swapcase()
        codes = [_post(c, wrong).status_code for _ in range(4)]
        assert codes == [401, 401, 401, 429]
        for _ in range(3):
            assert _post(c, srv.token).status_code == 200
