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
           "TokenError"]

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
    """Checks bearer tokens against the stored hashes (no caching of validity: revocation is immediate)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._last_used: dict[int, float] = {}
        self._lock = threading.Lock()

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of ``Authorization: Bearer <token>``, or None when it is missing, unknown, revoked
        or expired. Database errors propagate (the caller answers 503)."""
        if not authorization or len(authorization) > 512:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        h = hash_token(token)
        row = tokens.find_valid(self.engine, h)
        if row is None or not hmac.compare_digest(row[3], h):
            return None
        self._touch(row[0])
        return Principal(row[0], row[1], row[2], row[4])

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
