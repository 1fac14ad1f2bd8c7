"""API tokens: generated once, stored as SHA-256 hashes, compared in constant time, never logged.

A token has a scope (``ingest`` writes run data; ``read`` reads the API and dashboard when read auth
is on; ``admin`` does both and administers: alerts, other tokens' runs, deletes), an optional team
(tokens of one team share their runs), an optional expiry, and is revoked by name. Every request checks the database (a primary-key lookup), so a revocation
holds at once on every server instance; ``last_used_at`` is written at most once a minute per token.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from .store import tokens

__all__ = ["SCOPES", "Principal", "create_token", "list_tokens", "revoke_token", "TokenVerifier", "hash_token",
           "TokenError", "bearer_token"]

_PREFIX = "fs_"
SCOPES = ("ingest", "read", "admin")
_LAST_USED_EVERY_S = 60.0


class TokenError(ValueError):
    """A token operation that cannot be done (bad name or scope, a name already in use)."""


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a token's id, name, scope and team."""

    token_id: int | None
    name: str
    scope: str
    team: str | None = None

    def allows(self, scope: str) -> bool:
        """``admin`` holds every scope; ``ingest`` and ``read`` only their own."""
        return self.scope == "admin" or self.scope == scope

    @property
    def owner_key(self) -> str:
        """The namespace the runs this principal registers live in (``runs.owner_key``): ``team:<team>``
        for a token with a team, ``token:<id>`` without, ``''`` without a token (auth disabled)."""
        if self.team:
            return f"team:{self.team}"
        return "" if self.token_id is None else f"token:{self.token_id}"

    def may_write(self, owner_key: str) -> bool:
        """Whether this principal may write a run whose ``runs.owner_key`` is ``owner_key``: its own
        namespace (the same token, or a token of the same team), a run without an owner (``''``:
        registered with auth disabled or before owners existed), or any run for an admin."""
        return self.scope == "admin" or owner_key == "" or owner_key == self.owner_key


#: the principal of a server started with --insecure-no-auth
ANONYMOUS_ADMIN = Principal(None, "anonymous (auth disabled)", "admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


#: the longest ``Authorization`` value looked at (a token is 46 characters)
MAX_AUTHORIZATION = 512


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, normalised: surrounding whitespace
    stripped, any whitespace between scheme and token, the scheme in any case (``bearer``, ``BEARER``).
    None when missing, too long, of another scheme, or empty."""
    if not authorization or len(authorization) > MAX_AUTHORIZATION:
        return None
    parts = authorization.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1].strip()
    return token or None


def _check_name(name: str) -> None:
    if not name or len(name) > 128 or not name.isprintable():
        raise TokenError("token name must be 1..128 printable characters")


def _check_team(team: str) -> None:
    if not team or len(team) > 64 or not team.isprintable():
        raise TokenError("team must be 1..64 printable characters")


def create_token(engine: Engine, name: str, *, scope: str = "ingest", expires_in_days: float | None = None,
                 replace: bool = False, team: str | None = None) -> str:
    """Create a token named ``name``; returns the secret (shown once, only its hash is stored).

    A name is held by one active token at a time: ``replace=True`` revokes the one holding it. Tokens
    with the same ``team`` share their runs (register, write and finish them); a token without a team
    owns the runs it registers alone."""
    _check_name(name)
    if team is not None:
        _check_team(team)
    if scope not in SCOPES:
        raise TokenError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if expires_in_days is not None and not (0 < expires_in_days <= 3650):
        raise TokenError("--expires-in must be between 0 and 3650 days")
    token = _PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as c:
        active = tokens.active_count(c, name)
        if active and not replace:
            raise TokenError(f"an active token named {name!r} exists; revoke it first (fleetscope token revoke)")
        tokens.insert_token(c, name=name, token_hash=hash_token(token), prefix=token[:8], scope=scope,
                            expires_in_s=None if expires_in_days is None else expires_in_days * 86400.0,
                            revoke_same_name=bool(active), team=team)
    return token


def list_tokens(engine: Engine) -> list[dict[str, Any]]:
    """Every token, newest first: name, scope, team, prefix, created, last used, expiry, revocation —
    never the secret or its hash."""
    rows = tokens.list_all(engine)
    now = dt.datetime.now(dt.timezone.utc)
    for r in rows:
        r["state"] = ("revoked" if r["revoked_at"] is not None
                      else "expired" if r["expires_at"] is not None and r["expires_at"] <= now else "active")
    return rows


def revoke_token(engine: Engine, name: str) -> int:
    """Revoke the active token(s) named ``name``; returns how many were revoked."""
    return tokens.revoke_by_name(engine, name)


class TokenVerifier:
    """Checks bearer tokens against the stored hashes (no caching of validity: revocation is immediate).

    :meth:`may_be_valid` answers, without a lookup per token, whether a token could be valid at all (its
    8-character prefix is that of a token not revoked): the failed-auth limiter lets a valid token from
    a limited address through and refuses a spray of made-up ones without a database lookup each."""

    def __init__(self, engine: Engine, *, known_refresh_s: float = 2.0) -> None:
        self.engine = engine
        self._last_used: dict[int, float] = {}
        self._lock = threading.Lock()
        #: the prefixes of the tokens not revoked, re-read at most every ``known_refresh_s`` (on a miss)
        self.known_refresh_s = known_refresh_s
        self._prefixes: frozenset[str] | None = None
        self._prefixes_at = -1e18
        self._refresh_lock = threading.Lock()
        #: how often the prefixes were read (one query for all tokens)
        self.prefix_reads = 0

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of ``Authorization: Bearer <token>`` (parsed by :func:`bearer_token`), or None
        when it is missing, unknown, revoked or expired. Database errors propagate (the caller answers 503)."""
        token = bearer_token(authorization)
        if token is None:
            return None
        h = hash_token(token)
        row = tokens.find_valid(self.engine, h)
        if row is None or not hmac.compare_digest(row[3], h):
            return None
        self._touch(row[0])
        return Principal(row[0], row[1], row[2], row[4])

    def may_be_valid(self, token: str, *, refresh_s: float | None = None) -> bool:
        """Whether ``token`` (as :func:`bearer_token` returns it) could be a valid token: its prefix is
        one of a token not revoked. The prefixes are re-read (one query for every token) when a prefix is
        not among them and they are older than ``refresh_s`` (default ``known_refresh_s``), so a token
        created since is known within that time. Database errors propagate."""
        prefix = token[:8]
        snap, at = self._prefixes, self._prefixes_at
        if snap is not None and prefix in snap:
            return True
        if time.monotonic() - at < (self.known_refresh_s if refresh_s is None else refresh_s):
            return False
        with self._refresh_lock:  # one reader at a time; the others use what it read
            if self._prefixes_at == at:
                rows = tokens.list_all(self.engine)
                self._prefixes = frozenset(str(r["prefix"]) for r in rows if r["revoked_at"] is None)
                self._prefixes_at = time.monotonic()
                self.prefix_reads += 1
            snap = self._prefixes
        return snap is not None and prefix in snap

    def verify(self, authorization: str | None, *, scope: str = "ingest") -> bool:
        """True when ``authorization`` carries a valid token holding ``scope``."""
        p = self.authenticate(authorization)
        return p is not None and p.allows(scope)

    def _touch(self, token_id: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_used.get(token_id, -1e9) < _LAST_USED_EVERY_S:
                return
            if len(self._last_used) > 10_000:
                self._last_used.clear()
            self._last_used[token_id] = now
        tokens.touch(self.engine, token_id)
