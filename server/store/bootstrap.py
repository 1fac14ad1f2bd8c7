"""Creating the ``fleetscope`` database of embedded Postgres (psycopg on the admin connection)."""

from __future__ import annotations

from typing import Any

__all__ = ["ensure_database", "set_statement_timeout"]


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


def set_statement_timeout(engine: Any, seconds: float) -> None:
    """Every new connection of ``engine`` gets ``statement_timeout``: Postgres cancels any statement
    running longer (the read pool's budget, server/reads.py)."""
    from sqlalchemy import event

    ms = max(1, int(seconds * 1000))

    @event.listens_for(engine, "connect")
    def _budget(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"SET statement_timeout = {ms}")
        finally:
            cur.close()
        dbapi_conn.commit()
