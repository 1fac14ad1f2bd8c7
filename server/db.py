"""Database access: the engine, embedded Postgres (pgserver), and Alembic migrations."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from .store.bootstrap import ensure_database

if TYPE_CHECKING:
    import psycopg
    from alembic.config import Config
    from pgserver import PostgresServer

__all__ = [
    "EmbeddedPostgres",
    "make_engine",
    "upgrade",
    "normalize_url",
    "raw_connection",
    "resolve_database_url",
]

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Make a Postgres URL use the psycopg 3 driver under SQLAlchemy."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(f"unsupported database URL scheme (expected postgresql://...): {url.split('://')[0]}")


def libpq_url(url: str) -> str:
    """The same URL as libpq/psycopg wants it (no +driver)."""
    return "postgresql://" + normalize_url(url)[len("postgresql+psycopg://") :]


def make_engine(url: str, *, pool_size: int = 8) -> Engine:
    """An SQLAlchemy engine on psycopg 3 with a bounded pool."""
    from .store.citus import configure_engine

    engine = create_engine(
        normalize_url(url),
        pool_size=pool_size,
        max_overflow=2,
        pool_pre_ping=True,
        pool_recycle=1800,
    )
    configure_engine(engine)  # Citus: per-connection settings (server/store/citus.py)
    return engine


@contextmanager
def raw_connection(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    """A psycopg connection from the engine's pool, in a transaction committed on success."""
    fairy = engine.raw_connection()
    try:
        # the engine is always psycopg 3 (normalize_url); SQLAlchemy types the driver connection as Any | None
        conn = cast("psycopg.Connection[Any]", fairy.driver_connection)
        try:
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
    finally:
        fairy.close()


def _alembic_config(url: str) -> Config:
    import fleetscope.migrations as mig
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(mig.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision``."""
    from alembic import command

    command.upgrade(_alembic_config(url), revision)
    # on a distributed Citus schema, distribute the tables the migrations just added (a no-op
    # otherwise; plain Postgres pays one catalog query)
    from .store.citus import distribute, is_distributed

    engine = create_engine(normalize_url(url), poolclass=NullPool)
    try:
        with engine.connect() as c:
            distributed = is_distributed(c)
        if distributed:
            _p, done = distribute(engine)
            for stmt in done:
                log.info("citus: %s", stmt)
    finally:
        engine.dispose()


class EmbeddedPostgres:
    """PostgreSQL from the ``pgserver`` package, run in ``data_dir/pg``; stopped by ``stop()``.

    pgserver shares one postmaster per data dir between processes and reference-counts them; we
    stop it explicitly (pg_ctl stop -m fast) so that no orphan postgres outlives `serve`.
    """

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)
        self.pgdata = self.data_dir / "pg"
        self._server: PostgresServer | None = None
        self.owner = False

    def _running(self) -> bool:
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def start(self) -> str:
        """Start (or attach to) the postmaster and return a libpq URL for the ``fleetscope`` db."""
        import pgserver

        self.pgdata.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        # attach to a postmaster another fleetscope process started here, but only stop our own
        self.owner = not self._running()
        self._server = pgserver.get_server(self.pgdata, cleanup_mode=None)
        ensure_database(self._server.get_uri(), "fleetscope")
        log.info("embedded Postgres ready in %.2fs at %s", time.monotonic() - t0, self.pgdata)
        return self._server.get_uri("fleetscope")

    def stop(self) -> None:
        """Stop the postmaster (fast shutdown) and wait for it to exit."""
        if self._server is None:
            return
        srv, self._server = self._server, None
        if not self.owner:
            log.info("leaving embedded Postgres running: another process started it")
            return
        pid = None
        try:
            pid = srv.get_pid()
        except Exception:  # noqa: BLE001 - best effort: pg may already be down
            pid = None
        try:
            # pgserver creates its command functions (pg_ctl, initdb, ...) at import time with setattr
            from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

            pg_ctl(["-m", "fast", "-w", "stop"], pgdata=self.pgdata, user=srv.system_user, timeout=30)
        except Exception as e:  # noqa: BLE001
            log.debug("pg_ctl stop failed (%s); signalling postmaster", e)
            if pid:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        if pid:
            _wait_gone(pid, 15.0)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.05)
    log.warning("postgres pid %s still alive after %.0fs", pid, timeout)


def resolve_database_url(database_url: str | None, data_dir: Path) -> tuple[str, EmbeddedPostgres | None]:
    """The URL to use: the given one, or a freshly started embedded Postgres in ``data_dir``."""
    if database_url:
        return database_url, None
    pg = EmbeddedPostgres(data_dir)
    return pg.start(), pg


def _pg_ctl_available() -> bool:  # pragma: no cover - diagnostic helper
    try:
        subprocess.run(["pg_ctl", "--version"], capture_output=True, check=False)
        return True
    except FileNotFoundError:
        return False
