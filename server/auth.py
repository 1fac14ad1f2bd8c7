"""API tokens: generated once, stored as SHA-256 hashes, compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from sqlalchemy import Engine, text

__all__ = ["create_token", "TokenVerifier", "hash_token"]

_PREFIX = "fs_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(engine: Engine, name: str) -> str:
    """Create a token named ``name``; returns the secret (shown once, only its hash is stored)."""
    if not name or len(name) > 128:
        raise ValueError("token name must be 1..128 characters")
    token = _PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as c:
        c.execute(
            text("INSERT INTO api_tokens (name, token_hash, prefix) VALUES (:n, :h, :p)"),
            {"n": name, "h": hash_token(token), "p": token[:8]},
        )
    return token


class TokenVerifier:
    """Checks bearer tokens against the stored hashes, caching valid ones briefly."""

    def __init__(self, engine: Engine, *, ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._cache: dict[str, float] = {}
        self._lock = threading.Lock()

    def verify(self, authorization: str | None, *, scope: str = "ingest") -> bool:
        """True when ``authorization`` is ``Bearer <token>`` of a stored, unrevoked token. Every token
        holds every scope today (``scope`` is where scoped tokens plug in)."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        h = hash_token(token.strip())
        now = time.monotonic()
        with self._lock:
            exp = self._cache.get(h)
        if exp is not None and exp > now:
            return True
        with self.engine.connect() as c:
            row = c.execute(
                text("SELECT token_hash FROM api_tokens WHERE token_hash = :h AND revoked_at IS NULL"), {"h": h}
            ).fetchone()
        if row is None or not hmac.compare_digest(row[0], h):
            return False
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[h] = now + self.ttl_s
        return True
