"""``api_tokens``: hashes, scopes, expiry, revocation and last use of API tokens (never the secret)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text

__all__ = ["active_count", "insert_token", "list_all", "revoke_by_name", "find_valid", "touch"]


def active_count(conn: Any, name: str) -> int:
    """Active (unrevoked, unexpired) tokens named ``name``; takes a per-name transaction lock first,
    so two concurrent creations of one name cannot both pass."""
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('fleetscope.api_tokens.' || :n))"), {"n": name})
    return int(conn.execute(text("SELECT count(*) FROM api_tokens WHERE name = :n AND revoked_at IS NULL "
                                 "AND (expires_at IS NULL OR expires_at > now())"), {"n": name}).scalar_one())


def insert_token(conn: Any, *, name: str, token_hash: str, prefix: str, scope: str,
                 expires_in_s: float | None, revoke_same_name: bool, team: str | None = None) -> None:
    """Store a new token (in the caller's transaction), revoking the active one of that name if asked."""
    if revoke_same_name:
        conn.execute(text("UPDATE api_tokens SET revoked_at = now() WHERE name = :n AND revoked_at IS NULL"),
                     {"n": name})
    conn.execute(
        text("INSERT INTO api_tokens (name, token_hash, prefix, scope, expires_at, team) "
             "VALUES (:n, :h, :p, :s, now() + make_interval(secs => :e), :t)"),
        {"n": name, "h": token_hash, "p": prefix, "s": scope, "e": expires_in_s, "t": team},
    )


def list_all(engine: Engine) -> list[dict[str, Any]]:
    """Every token, newest first, without its hash."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT name, scope, team, prefix, created_at, last_used_at, expires_at, revoked_at FROM api_tokens "
            "ORDER BY created_at DESC, id DESC")).mappings().all()
    return [dict(r) for r in rows]


def revoke_by_name(engine: Engine, name: str) -> int:
    """Revoke the active token(s) named ``name``; how many."""
    with engine.begin() as c:
        return int(c.execute(text("UPDATE api_tokens SET revoked_at = now() WHERE name = :n AND revoked_at IS NULL"),
                             {"n": name}).rowcount or 0)


def find_valid(engine: Engine, token_hash: str) -> tuple[int, str, str, str, str | None] | None:
    """(id, name, scope, hash, team) of the unrevoked, unexpired token with this hash."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT id, name, scope, token_hash, team FROM api_tokens WHERE token_hash = :h "
                 "AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"), {"h": token_hash}
        ).fetchone()
    return None if row is None else (int(row[0]), str(row[1]), str(row[2]), str(row[3]),
                                     None if row[4] is None else str(row[4]))


def touch(engine: Engine, token_id: int) -> None:
    """Record that a token was used now."""
    with engine.begin() as c:
        c.execute(text("UPDATE api_tokens SET last_used_at = now() WHERE id = :i"), {"i": token_id})
