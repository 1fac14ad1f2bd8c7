"""Creating the ``fleetscope`` database of embedded Postgres (psycopg on the admin connection)."""

from __future__ import annotations

__all__ = ["ensure_database"]


def ensure_database(admin_uri: str, name: str) -> bool:
    """Create database ``name`` (a plain identifier) unless it exists; True when it was created."""
    import psycopg

    if not name.isidentifier():
        raise ValueError(f"not a plain database name: {name!r}")
    with psycopg.connect(admin_uri, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return False
        conn.execute(f"CREATE DATABASE {name}")
    return True
