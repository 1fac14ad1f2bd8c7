"""Shared fixtures: one embedded Postgres per test session, a fresh database per test, and the real
server on a loopback port (uvicorn in a thread) over HTTP."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# One temp root per test session, removed at its end: whatever a test or a process it starts leaves
# in the temp dir (torchrun's torchelastic_* dirs when a job is stopped, browser profiles, embedded
# Postgres) goes with it. Short, so Postgres' unix socket paths stay under their ~107-byte limit.
_SESSION_TMP = tempfile.mkdtemp(prefix="fst-", dir="/tmp")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None  # re-read TMPDIR


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


atexit.register(shutil.rmtree, _SESSION_TMP, True)  # and whatever exit handlers write after the session


def pytest_collection_finish(session: pytest.Session) -> None:
    """The browser tests need Debian's chromium + chromedriver: install them once, before any test
    runs (outside every test's timeout), when a selected test uses the browser and they are missing."""
    if not any("browser" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "dashboard"))
    from browser_util import ensure_chromium, find_chromium

    if all(find_chromium()):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("installing chromium + chromium-driver with apt-get for the browser tests (first run only) ...")
    try:
        ensure_chromium()
    except RuntimeError as e:  # the browser fixture fails each browser test with this message
        if tr is not None:
            tr.write_line(f"  {e}")


def wait_healthy(url: str, proc: Any, timeout: float = 60) -> None:
    """Wait until the server subprocess ``proc`` answers ``/healthz`` 200; fail if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server not healthy in time")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pg_root() -> Iterator[Any]:
    """The session's embedded PostgreSQL (pgserver)."""
    from fleetscope.server.db import EmbeddedPostgres

    d = tempfile.mkdtemp(prefix="fs-pg-")
    pg = EmbeddedPostgres(d)
    try:
        pg.start()
        _no_durability(pg._server.get_uri("postgres"))
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_admin_uri(pg_root: Any) -> str:
    return pg_root._server.get_uri("postgres")


def _db_uri(admin_uri: str, name: str) -> str:
    # postgresql://postgres:@/postgres?host=/path  → same with /name
    head, _, query = admin_uri.partition("?")
    base = head.rsplit("/", 1)[0]
    return f"{base}/{name}" + (f"?{query}" if query else "")


def _no_durability(admin_uri: str) -> None:
    """The session's Postgres is thrown away at its end and never crashes under a test (tests stop
    fleetscope's processes, never this postmaster): commits need not wait for the disk."""
    import psycopg

    with psycopg.connect(admin_uri, autocommit=True) as c:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            c.execute(f"ALTER SYSTEM SET {setting} = off")
        c.execute("SELECT pg_reload_conf()")


#: the session's migrated database that each test's database is copied from
TEMPLATE_DB = "fs_template"


@pytest.fixture(scope="session")
def pg_template(pg_admin_uri: str) -> str:
    """A database migrated to head by every migration in the tree (built once per session, so a new
    migration is in the next session's template), the template of each test's database: copying it
    (``CREATE DATABASE ... TEMPLATE``, 0.35-0.45 s, made ahead: ``_ReadyDatabases``) instead of migrating
    an empty one (1 s and more)."""
    import psycopg
    from fleetscope.server.db import upgrade

    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    upgrade(_db_uri(pg_admin_uri, TEMPLATE_DB))
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        # a template must have no sessions while it is copied: none may connect to it from now on
        c.execute(f"ALTER DATABASE {TEMPLATE_DB} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (TEMPLATE_DB,))
    return TEMPLATE_DB


class _ReadyDatabases:
    """Copies of the template made ahead, on a thread of their own, while tests run. A copy costs
    0.35-0.45 s of Postgres' time (``CREATE DATABASE ... TEMPLATE`` logs every page of the 8.5 MB
    template; ``STRATEGY FILE_COPY`` forces a checkpoint instead, as slow once tests have written): on
    the test's own clock that was ~2.5 minutes of a session. Most tests wait on sockets and processes,
    so a copy made beside them costs the session little. ``take`` returns a ready copy, or makes one
    now when none is ready; ``close`` drops the copies no test took."""

    def __init__(self, admin_uri: str, template: str, ahead: int = 2) -> None:
        self.admin_uri, self.template, self.ahead = admin_uri, template, ahead
        self._ready: list[str] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._fill, name="test-db-copies", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= self.ahead:
                    self._cv.wait()
                if self._closed:
                    return
            try:
                name = _new_db(self.admin_uri, self.template)
            except Exception:  # noqa: BLE001 - take() makes its own copy, which raises where it is seen
                with self._cv:
                    if self._closed:
                        return
                    self._cv.wait(1.0)
                continue
            with self._cv:
                self._ready.append(name)

    def take(self) -> str:
        with self._cv:
            name = self._ready.pop(0) if self._ready else None
            self._cv.notify_all()
        return name if name is not None else _new_db(self.admin_uri, self.template)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(60)
        with self._cv:
            left, self._ready = self._ready, []
        for name in left:
            _drop_db(self.admin_uri, name)


@pytest.fixture(scope="session")
def ready_databases(pg_admin_uri: str, pg_template: str) -> Iterator[_ReadyDatabases]:
    pool = _ReadyDatabases(pg_admin_uri, pg_template)
    try:
        yield pool
    finally:
        pool.close()


def _new_db(admin_uri: str, template: str | None) -> str:
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    return name


def _drop_db(admin_uri: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_uri, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "empty_db: db_url (so engine and live_server too) is an empty, un-migrated database")


#: tests (node id endings) whose ``db_url`` must be an empty database, as if marked ``empty_db``: they
#: prove what migrating from nothing does
EMPTY_DB_TESTS = (
    "server/test_store.py::test_migrations_from_empty_create_every_table_and_are_idempotent",
)


@pytest.fixture
def empty_db_url(pg_admin_uri: str) -> Iterator[str]:
    """A fresh, empty (un-migrated) database for one test: for what migrating from nothing does."""
    name = _new_db(pg_admin_uri, None)
    yield _db_uri(pg_admin_uri, name)
    _drop_db(pg_admin_uri, name)


#: the URLs of this session's databases copied from the migrated template: at head already, so the
#: ``engine`` fixture and ``start_server`` do not run Alembic on them again (a no-op of ~0.035 s, ~800
#: times a session); every other database (``empty_db``, the Citus tier's) is migrated as before
AT_HEAD: set[str] = set()


@pytest.fixture
def db_url(request: pytest.FixtureRequest, pg_admin_uri: str) -> Iterator[str]:
    """A fresh database for one test, already migrated to head (a copy of the session's template);
    empty instead for a test marked ``empty_db`` (or listed in EMPTY_DB_TESTS)."""
    empty = request.node.get_closest_marker("empty_db") is not None or request.node.nodeid.endswith(EMPTY_DB_TESTS)
    name = _new_db(pg_admin_uri, None) if empty else request.getfixturevalue("ready_databases").take()
    url = _db_uri(pg_admin_uri, name)
    if not empty:
        AT_HEAD.add(url)
    try:
        yield url
    finally:
        AT_HEAD.discard(url)
        _drop_db(pg_admin_uri, name)


@pytest.fixture
def engine(db_url: str) -> Iterator[Any]:
    """An engine on a migrated fresh database (``upgrade`` on the template's copy is a no-op, ~0.04 s;
    it migrates an ``empty_db`` one)."""
    from fleetscope.server.db import make_engine, upgrade

    if db_url not in AT_HEAD:
        upgrade(db_url)
    eng = make_engine(db_url, pool_size=4)
    yield eng
    eng.dispose()


@dataclass
class LiveServer:
    url: str
    app: Any
    token: str
    db_url: str
    _server: Any
    _thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.fs

    def client(self, token: str | None = "__default__") -> Any:
        from fleetscope.client import Client

        return Client(self.url, self.token if token == "__default__" else token)

    def compact(self) -> Any:
        return self.state.compactor.run_once(force=True)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


@functools.cache
def _quick_stop_server_class() -> Any:
    import asyncio

    import uvicorn

    class QuickStopServer(uvicorn.Server):
        """uvicorn's server, noticing ``should_exit`` within 10 ms instead of its 100 ms tick: a test
        stops its server once or more, ~600 of them a session. The tick's work (``on_tick``) is
        uvicorn's own."""

        async def main_loop(self) -> None:
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                await asyncio.sleep(0.01)
                counter = (counter + 1) % 864000
                should_exit = await self.on_tick(counter)

    return QuickStopServer


def start_server(db_url: str, **overrides: Any) -> LiveServer:
    """Start the real app with uvicorn in a thread on a free loopback port, configured as ``fleetscope
    serve`` configures it (``server.serve.uvicorn_config``: uvicorn's own proxy-header handling off)."""
    from fleetscope.server.auth import create_token
    from fleetscope.server.serve import uvicorn_config
    from fleetscope.server.settings import Settings

    from fleetscope.webapp import create_web_app

    _QuickStopServer = _quick_stop_server_class()
    port = free_port()
    params: dict[str, Any] = {"database_url": db_url, "port": port, "compact_interval_s": 0.2, "compact_grace_s": 1.0,
                              "migrate": db_url not in AT_HEAD}
    params.update(overrides)
    settings = Settings(**params)
    app = create_web_app(settings)
    server = _QuickStopServer(uvicorn_config(app, settings, host="127.0.0.1", log_level="warning",
                                             timeout_graceful_shutdown=None))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not t.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    token = create_token(app.state.fs.engine, f"test-{port}", scope="admin")
    return LiveServer(f"http://127.0.0.1:{port}", app, token, db_url, server, t)


@pytest.fixture
def live_server(db_url: str) -> Iterator[LiveServer]:
    """The real server over HTTP on loopback, with a fresh database and a token."""
    srv = start_server(db_url)
    yield srv
    srv.stop()


@pytest.fixture
def tmp_data_dir() -> Iterator[Path]:
    # short path: Postgres unix socket paths are limited to ~107 bytes
    d = Path(tempfile.mkdtemp(prefix="fsd-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------- the browser
# The browser tests' one headless chromium (tests/dashboard/browser_util.py): started on first use and
# kept for the session (a start costs 1-2.5 s, and a session had ~15 of them), quit at its end, failing
# or not. Each test gets it on a blank page, in its first window, with the console log drained, so
# what a test reads of the console is its own; a browser that no longer answers is replaced.


@pytest.fixture(scope="session")
def _session_browser() -> Iterator[dict[str, Any]]:
    holder: dict[str, Any] = {"driver": None}
    try:
        yield holder
    finally:
        if holder["driver"] is not None:
            holder["driver"].quit()


def _reset_browser(d: Any) -> None:
    handles = d.window_handles
    for h in handles[1:]:
        d.switch_to.window(h)
        d.close()
    d.switch_to.window(handles[0])
    d.get("about:blank")
    d.get_log("browser")  # drained: the next test reads only its own entries


@pytest.fixture
def browser(_session_browser: dict[str, Any]) -> Iterator[Any]:
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "dashboard"))
    from browser_util import start_browser

    d = _session_browser["driver"]
    if d is not None:
        try:
            _reset_browser(d)
        except Exception:  # noqa: BLE001 - crashed or hung: a new one
            try:
                d.quit()
            except Exception:  # noqa: BLE001
                pass
            d = _session_browser["driver"] = None
    if d is None:
        try:
            d = start_browser()
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
        _session_browser["driver"] = d
    yield d
