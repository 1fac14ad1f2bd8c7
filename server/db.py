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
    "distribute_database",
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


def make_engine(url: str, *, pool_size: int = 8, statement_timeout_s: float | None = None,
                pool_timeout_s: float = 30.0) -> Engine:
    """An SQLAlchemy engine on psycopg 3 with a bounded pool. ``statement_timeout_s``: every statement
    on its connections is cancelled by Postgres after this long (the read engine's budget per query)."""
    from .store.bootstrap import set_statement_timeout
    from .store.citus import configure_engine

    engine = create_engine(
        normalize_url(url),
        pool_size=pool_size,
        max_overflow=2,
        pool_pre_ping=True,
        pool_recycle=1800,
        pool_timeout=pool_timeout_s,
    )
    configure_engine(engine)  # Citus: per-connection settings (server/store/citus.py)
    if statement_timeout_s is not None and statement_timeout_s > 0:
        set_statement_timeout(engine, statement_timeout_s)
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


def distribute_database(url: str) -> tuple[Any, list[str], dict[str, int]]:
    """``fleetscope db distribute`` (server/store/citus.py ``distribute_database``)."""
    from .store.citus import distribute_database as _distribute

    return _distribute(url, make_engine=make_engine, upgrade=upgrade)


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
    """PostgreSQL from the ``pgserver`` package, run in ``data_dir/pg``; released by ``stop()``.

    Several processes may use one data dir (two ``serve``, a ``token create`` beside a ``serve``): each
    registers itself while it uses the postmaster — a file ``.pg-users/<pid>.<n>`` in the data dir that
    it holds an ``flock`` on while registered — and ``stop()`` stops the postmaster (``pg_ctl stop -m
    fast``) only when no other live process is registered, whoever started it. A registration whose
    process died (``kill -9``, a crash) holds no lock any more: it is ignored and removed. Starting and
    stopping are serialised by ``.pg-users.lock`` (beside ``pg``, which initdb wants empty), so a process
    that starts while the last one stops waits for that stop, then starts a fresh postmaster.
    """

    _seq = 0

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)
        self.pgdata = self.data_dir / "pg"
        self._server: PostgresServer | None = None
        #: whether this process started the postmaster (informational: the last user stops it)
        self.owner = False
        self._reg: tuple[Path, int] | None = None  # (registration file, its open, flocked fd)

    @property
    def _users_dir(self) -> Path:
        return self.data_dir / ".pg-users"

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

    @contextmanager
    def _serialised(self) -> Iterator[None]:
        """Hold the data dir's start/stop lock (blocking)."""
        fd = os.open(self.data_dir / ".pg-users.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _flock(fd, exclusive=True, block=True)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _register(self) -> None:
        self._users_dir.mkdir(exist_ok=True)
        EmbeddedPostgres._seq += 1
        path = self._users_dir / f"{os.getpid()}.{EmbeddedPostgres._seq}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        _flock(fd, exclusive=False, block=True)  # held until _unregister or this process dies
        os.write(fd, f"{os.getpid()}\n".encode())
        self._reg = (path, fd)

    def _unregister(self) -> None:
        if self._reg is None:
            return
        path, fd = self._reg
        self._reg = None
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)

    def other_users(self) -> int:
        """How many other live processes (or other instances in this one) are registered on this data
        dir; stale registrations (their process died) are removed on the way."""
        mine = self._reg[0] if self._reg is not None else None
        n = 0
        try:
            entries = list(self._users_dir.iterdir())
        except OSError:
            return 0
        for path in entries:
            if path == mine:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # gone meanwhile
            try:
                if _flock(fd, exclusive=True, block=False) and not _pid_alive_without_flock(path):
                    try:  # nobody holds it: its process is gone
                        path.unlink()
                    except OSError:
                        pass
                    log.debug("embedded Postgres: removed stale registration %s", path.name)
                else:
                    n += 1
            finally:
                os.close(fd)
        return n

    def start(self) -> str:
        """Start (or attach to) the postmaster, register this process as a user of it, and return a
        libpq URL for the ``fleetscope`` db."""
        import pgserver

        self.pgdata.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self._serialised():
            self.owner = not self._running()
            known = _pgserver_instance(self.pgdata)
            if known is not None and self.owner:
                # this process used the data dir before and the postmaster was stopped since: start it again
                with known._lock:
                    known.ensure_postgres_running()
            self._server = pgserver.get_server(self.pgdata, cleanup_mode=None)
            self._register()
        try:
            ensure_database(self._server.get_uri(), "fleetscope")
        except BaseException:
            self.stop()
            raise
        log.info("embedded Postgres ready in %.2fs at %s", time.monotonic() - t0, self.pgdata)
        return self._server.get_uri("fleetscope")

    def stop(self) -> bool:
        """Leave the postmaster: stop it (fast shutdown, waiting for it to exit) when no other process
        uses it, whoever started it; leave it running for the others otherwise. True when it stopped it."""
        if self._server is None:
            return False
        srv, self._server = self._server, None
        with self._serialised():
            self._unregister()
            others = self.other_users()
            if others:
                log.info("leaving embedded Postgres running: %d other fleetscope process(es) use it", others)
                return False
            self._stop_postmaster(srv)
            return True

    def _stop_postmaster(self, srv: PostgresServer) -> None:
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


def _flock(fd: int, *, exclusive: bool, block: bool) -> bool:
    """``flock`` on ``fd``; False when ``block`` is off and another open file holds a conflicting lock.
    Without ``fcntl`` (Windows) there is no lock: True, and liveness is judged by pid instead."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return True
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if block else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        return False
    return True


def _pid_alive_without_flock(path: Path) -> bool:
    """Where there is no ``flock`` (Windows): whether the process named by a registration still runs.
    False on POSIX, where the lock alone decides."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - not POSIX
        import psutil

        try:
            return bool(psutil.pid_exists(int(path.name.split(".", 1)[0])))
        except ValueError:
            return False
    return False


def _pgserver_instance(pgdata: Path) -> Any:
    """pgserver's cached handle for ``pgdata`` in this process, if any (it caches one per data dir and
    would otherwise hand back a handle on a postmaster that was stopped since)."""
    try:
        from pgserver.postgres_server import PostgresServer
    except ImportError:  # pragma: no cover
        return None
    return PostgresServer._instances.get(pgdata.expanduser().resolve())


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
