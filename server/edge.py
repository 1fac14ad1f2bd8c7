"""The server's edge: what every request passes before any route reads a byte of its body.

A pure ASGI middleware, in this order:

1. **Trusted host** — the ``Host`` header must name this server (loopback names, the bind address, the
   public URL's host, or ``allowed_hosts``), so a DNS-rebinding page cannot read a local server.
2. **Body cap** — a per-route ceiling checked on ``Content-Length`` before reading, and again while
   the body streams (chunked uploads); 413 naming the limit.
3. **Authentication** — every write (and, with ``read_auth``, every read but ``/healthz``) needs a
   valid token: 401 before the body is read. The token is parsed leniently (``auth.bearer_token``:
   whitespace stripped, the ``Bearer`` scheme in any case). Failed authentications are limited
   (``_AuthLimiter``, ``auth_fail_limit`` per ``auth_fail_window_s``) three ways: per credential (one
   bad token repeated; a token differing only in case is the same credential), per client address for
   requests without a token, and per client address by the number of *distinct* bad tokens it
   presented (a spray of made-up tokens). Over a limit, a request is answered 429 + ``Retry-After``
   without a database lookup — unless its token may be valid (``TokenVerifier.may_be_valid``: its
   prefix is that of a token not revoked) and has not failed already, then it is looked up as usual.
   So a valid token is never locked out, whatever the flood from its address (behind a proxy, the
   agents' own), and a spray of garbage costs no lookup once limited. The client address is the TCP
   peer; ``X-Forwarded-For`` counts only when the peer is in ``forwarded_allow_ips``. A database
   outage answers 503 + ``Retry-After``, never 500. The principal is put in the request's state; the
   routes' ``require_token(scope)`` dependency checks its scope.
4. **Media type** — a write with a body must say ``application/json`` or msgpack (415 otherwise), so
   a cross-origin ``text/plain`` form cannot post to an unauthenticated server.
5. **Security headers** on every response (nosniff, no framing, no referrer).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import HTTPException
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from .auth import ANONYMOUS_ADMIN, Principal, bearer_token
from .errors import error_body

__all__ = ["EdgeMiddleware", "body_cap", "TOKEN_COOKIE", "credential_key", "edge_reason"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_PUBLIC = ("/healthz",)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
_BODY_TYPES = ("application/json", "application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
#: dashboard sign-in for --read-auth: open ``/?token=fs_...`` once, the token lives in this cookie
TOKEN_COOKIE = "fleetscope_token"
_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", b"frame-ancestors 'none'; base-uri 'self'; form-action 'self'"),
]
KIB = 1024
MIB = 1024 * KIB


def body_cap(method: str, path: str, settings: Any) -> int:
    """The largest body a route accepts, in bytes (as sent, before any decompression)."""
    if path == "/api/v1/ingest":
        return int(settings.max_body_bytes)
    if path.startswith("/api/v1/runs/") and path.endswith("/traces"):
        return int(settings.max_trace_body_bytes)
    if path == "/api/v1/benchmarks":
        return MIB
    if method in _WRITES and path.startswith("/api/"):
        return 64 * KIB  # run registration, finish, alert transitions, deletes: small JSON documents
    return 16 * KIB  # reads and the dashboard's callbacks (JSON of a few component properties)


def _dash_cap(path: str) -> int:
    # Dash callbacks POST their inputs/state (URL, dropdown values, stored small dicts)
    return 256 * KIB if path.startswith("/_dash-") else 0


class _FailedAuth:
    """Per-credential count of failed authentications in a sliding window (keys: ``credential_key``),
    bounded in size (at most ``max_clients`` keys, each with at most ``limit`` timestamps; the least
    recent goes first)."""

    def __init__(self, limit: int, window_s: float, max_clients: int = 10_000) -> None:
        self.limit, self.window_s, self.max_clients = limit, window_s, max_clients
        self._hits: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def blocked_for(self, client: str) -> float:
        """Seconds until ``client`` may try again (0 when it may now)."""
        now = time.monotonic()
        with self._lock:
            hits = [t for t in self._hits.get(client, ()) if now - t < self.window_s]
            if hits:
                self._hits[client] = hits
            else:
                self._hits.pop(client, None)
            if len(hits) < self.limit:
                return 0.0
            return max(0.0, self.window_s - (now - hits[0]))

    def record(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            hits = self._hits.pop(client, [])
            hits.append(now)
            self._hits[client] = hits[-self.limit:]
            while len(self._hits) > self.max_clients:
                self._hits.popitem(last=False)


class _AuthLimiter:
    """The failed-auth limits (module docstring, 3.): per credential and per address without a token
    (``_FailedAuth`` counts), per address by distinct bad tokens, and the tokens that failed a lookup.
    Bounded: at most ``max_clients`` keys in each table, ``limit`` entries per key."""

    def __init__(self, limit: int, window_s: float, max_clients: int = 10_000) -> None:
        self.limit, self.window_s, self.max_clients = limit, window_s, max_clients
        self.counts = _FailedAuth(limit, window_s, max_clients)
        self._distinct: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()  # address -> {cred: last seen}
        self._bad: OrderedDict[str, float] = OrderedDict()  # exact token hash -> when its lookup failed
        self._lock = threading.Lock()

    def address_blocked_for(self, address: str) -> float:
        """Seconds until ``address`` is under its budget of distinct bad tokens (0: it is now)."""
        now = time.monotonic()
        with self._lock:
            seen = self._distinct.get(address)
            if not seen:
                return 0.0
            for cred in [c for c, t in seen.items() if now - t >= self.window_s]:
                del seen[cred]
            if not seen:
                del self._distinct[address]
                return 0.0
            if len(seen) < self.limit:
                return 0.0
            return max(0.0, self.window_s - (now - min(seen.values())))

    def record_token(self, address: str, cred: str) -> None:
        """A bad (or, over the limit, unchecked) token from ``address``: counts once per window there."""
        now = time.monotonic()
        with self._lock:
            seen = self._distinct.pop(address, None) or OrderedDict()
            seen.pop(cred, None)
            seen[cred] = now
            while len(seen) > self.limit:
                seen.popitem(last=False)
            self._distinct[address] = seen
            while len(self._distinct) > self.max_clients:
                self._distinct.popitem(last=False)

    def failed_lookup(self, exact: str) -> None:
        with self._lock:
            self._bad.pop(exact, None)
            self._bad[exact] = time.monotonic()
            while len(self._bad) > self.max_clients:
                self._bad.popitem(last=False)

    def known_bad(self, exact: str) -> bool:
        """Whether this exact token failed a lookup within the window (tokens never become valid)."""
        with self._lock:
            t = self._bad.get(exact)
            return t is not None and time.monotonic() - t < self.window_s


_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class _Proxies:
    """The peers whose ``X-Forwarded-For`` is believed (``forwarded_allow_ips``: addresses or networks;
    ``*``: any peer; empty: none, the TCP peer is the client)."""

    def __init__(self, allowed: list[str]) -> None:
        self.any = "*" in allowed
        self.networks: list[_Network] = [ipaddress.ip_network(a, strict=False) for a in allowed if a != "*"]

    def trusted(self, address: str) -> bool:
        if self.any:
            return True
        if not self.networks:
            return False
        try:
            ip = ipaddress.ip_address(address.strip("[]"))
        except ValueError:
            return False
        return any(ip in n for n in self.networks)

    def client(self, scope: Scope) -> str:
        """The client's address: the TCP peer, or — when the peer is a trusted proxy — the nearest
        address in ``X-Forwarded-For`` that is not itself a trusted proxy (the leftmost when all are)."""
        peer = str((scope.get("client") or ("?", 0))[0])
        if not self.trusted(peer):
            return peer
        hops = [h.strip() for k, v in scope.get("headers", ()) if k.lower() == b"x-forwarded-for"
                for h in v.decode("latin-1").split(",") if h.strip()]
        if not hops:
            return peer
        for hop in reversed(hops):
            if not self.trusted(hop):
                return hop[:64]
        return hops[0][:64]


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class EdgeMiddleware:
    """See the module docstring. ``get_state()`` returns the server's ``AppState`` or None while starting."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, settings: Any,
                 get_state: Callable[[], Any]) -> None:
        self.app = app
        self.settings = settings
        self.get_state = get_state
        self.limiter = _AuthLimiter(settings.auth_fail_limit, settings.auth_fail_window_s)
        self.failed = self.limiter.counts
        self.proxies = _Proxies(list(getattr(settings, "forwarded_allow_ips", None) or []))
        allowed = {h.lower() for h in settings.allowed_hosts}
        bind = settings.host.lower()
        self.any_host = "*" in allowed or (not allowed and bind in ("0.0.0.0", "::", ""))
        allowed |= _LOOPBACK | {bind, f"[{bind}]"}
        if settings.public_url:
            allowed.add((urlsplit(settings.public_url).hostname or "").lower())
        self.allowed_hosts = frozenset(h for h in allowed if h)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._with_security_headers(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method, path = scope["method"], scope["path"]

        if not self.any_host and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            await _reply(send, 400, "invalid Host header: this server answers only to its own names "
                                    "(set FLEETSCOPE_ALLOWED_HOSTS to add one)")
            return

        cap = max(body_cap(method, path, self.settings), _dash_cap(path))
        clen = headers.get("content-length")
        if clen is not None:
            if not clen.isdigit():
                await _reply(send, 400, "invalid Content-Length")
                return
            if int(clen) > cap:
                await self._reject(send, 413, f"body of {clen} bytes exceeds the limit of {cap} bytes for "
                                              f"{method} {path}")
                return
        has_body = (clen is not None and int(clen) > 0) or "chunked" in headers.get("transfer-encoding", "")

        st = self.get_state()
        write = method in _WRITES and path.startswith("/api/")
        needs_auth = write or (self.settings.read_auth and not path.startswith(_PUBLIC))
        if needs_auth:
            principal, status, detail, extra = await self._authenticate(scope, headers, st)
            if principal is None:
                await self._reject(send, status, detail, extra)
                return
            if not write and not principal.allows("read"):
                await self._reject(send, 403, f"token {principal.name!r} has scope {principal.scope!r}; reading "
                                              "needs a read or admin token")
                return
            scope.setdefault("state", {})["principal"] = principal

        if write and has_body:
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype not in _BODY_TYPES:
                await self._reject(send, 415, f"unsupported media type {ctype or '(none)'!r}: send application/json "
                                              "or application/msgpack")
                return

        sign_in = _sign_in_token(scope) if self.settings.read_auth else None
        if sign_in is not None and "principal" in scope.get("state", {}):
            # dashboard sign-in: keep the (valid) token in an HttpOnly cookie, drop it from the URL
            await _redirect_with_cookie(send, path, sign_in)
            return

        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _capped(receive, cap, method, path), tracking)
        except _TooLarge as e:
            if started:
                raise
            await self._reject(send, 413, str(e.detail))

    async def _authenticate(self, scope: Scope, headers: dict[str, str],
                            st: Any) -> tuple[Principal | None, int, str, dict[str, str]]:
        if self.settings.insecure_no_auth:
            return ANONYMOUS_ADMIN, 200, "", {}
        if st is None or not st.ready:
            return None, 503, "starting up", {"Retry-After": "1"}
        sign_in = _sign_in_token(scope)
        authz = (headers.get("authorization") or (f"Bearer {sign_in}" if sign_in else None)
                 or _cookie_token(headers.get("cookie", "")))
        token = bearer_token(authz)
        client = self.proxies.client(scope)
        lim = self.limiter
        if token is None:  # no (usable) token: one count per client address; nothing to look up
            key = f"anon:{client}"
            wait = lim.counts.blocked_for(key)
            lim.counts.record(key)
            if wait <= 0:
                return None, 401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"}
            return None, 429, "too many failed authentications without a token from this client; retry later", {
                "Retry-After": str(int(lim.counts.blocked_for(key)) + 1)}
        key = credential_key(authz, client)
        exact = "exact:" + hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:32]
        # over a limit — this credential failed too often, or this address presented too many distinct bad
        # tokens — a token is looked up only if it may be valid (a valid token is never locked out)
        wait = max(lim.counts.blocked_for(key), lim.address_blocked_for(client))
        try:
            if wait > 0 and (lim.known_bad(exact) or not await run_in_threadpool(
                    st.tokens.may_be_valid, token, refresh_s=self.settings.auth_known_tokens_refresh_s)):
                lim.counts.record(key)
                lim.record_token(client, key)
                wait = max(lim.counts.blocked_for(key), lim.address_blocked_for(client), 1.0)
                what = "with this token" if lim.counts.blocked_for(key) > 0 else "from this client"
                return None, 429, f"too many failed authentications {what}; retry later", {
                    "Retry-After": str(int(wait) + 1)}
            principal = await run_in_threadpool(st.tokens.authenticate, authz)
        except (OperationalError, OSError, TimeoutError) as e:
            log.warning("token check failed, database unavailable: %s", type(e).__name__)
            return None, 503, "database unavailable; retry later", {"Retry-After": "2"}
        if principal is not None:
            return principal, 200, "", {}
        lim.counts.record(key)
        lim.record_token(client, key)
        lim.failed_lookup(exact)
        return None, 401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"}

    async def _reject(self, send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        st = self.get_state()
        if st is not None:
            st.metrics.reject(edge_reason(status, detail))
        await _reply(send, status, detail, headers)

    @staticmethod
    def _with_security_headers(send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", ())}
                message["headers"] = [*message.get("headers", ()),
                                      *((k, v) for k, v in _SECURITY_HEADERS if k not in have)]
            await send(message)

        return wrapped


def credential_key(authz: str | None, client: str) -> str:
    """The failed-auth bucket of a request: ``token:<hash>`` per presented credential (the same bucket
    from every address; the token as ``auth.bearer_token`` parses it, in lower case, so a token differing
    only in case or spacing is the same credential), ``anon:<client address>`` for requests without a
    usable token."""
    token = bearer_token(authz)
    if token is None:
        return f"anon:{client}"
    return "token:" + hashlib.sha256(token.lower().encode("utf-8", "replace")).hexdigest()[:32]


def edge_reason(status: int, detail: str) -> str:
    """The ``reason`` label of a rejection at the edge (``fleetscope_ingest_rejections_total``)."""
    if status == 429:
        return "auth_limited"  # failed authentications over the limit: not overload
    if status == 503:
        return "starting" if detail.startswith("starting") else "db_unavailable"
    return {400: "malformed", 401: "auth", 403: "forbidden", 413: "too_large", 415: "unsupported"}.get(status, str(status))


def _sign_in_token(scope: Scope) -> str | None:
    """``?token=`` on a dashboard page (GET, not the API): the browser's way to present a read token."""
    if scope["method"] != "GET" or scope["path"].startswith("/api/"):
        return None
    token = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return token[0] if token else None


def _cookie_token(cookie: str) -> str | None:
    for part in cookie.split(";"):
        k, _, v = part.strip().partition("=")
        if k == TOKEN_COOKIE and v:
            return f"Bearer {v}"
    return None


def _capped(receive: Receive, cap: int, method: str, path: str) -> Receive:
    """``receive`` that stops a streamed body at ``cap`` bytes (a chunked upload has no Content-Length)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise _TooLarge(f"body exceeds the limit of {cap} bytes for {method} {path}")
        return message

    return wrapped


class _TooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes its cap; routes answer it as a 413."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail)


async def _reply(send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, detail)).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hs += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


async def _redirect_with_cookie(send: Send, path: str, token: str) -> None:
    cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", (path or "/").encode("latin-1")), (b"set-cookie", cookie.encode("latin-1")),
                            (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
