"""The Citus tier: the server suite (``tests/citus/server`` is a link to ``tests/server``), the
dashboard tests that use the database (``tests/citus/dashboard`` → ``tests/dashboard``), the scale-out
tests (``test_scale_out_on_citus.py`` → ``tests/e2e/test_scale_out.py``: several ``serve`` processes and
``--compaction-workers``) and the Citus-specific tests (``test_citus.py``), against a coordinator and
two workers on loopback instead of plain Postgres.

Selected only with ``FLEETSCOPE_CITUS=1`` (``.ci/run`` sets it and runs ``pytest tests/citus`` after
the README's plain ``pytest``, so nothing runs twice). Then a failure to build or start Citus fails
the tier; it never skips. Without it, collection prints one line saying how to run it.

Every test here that asks for ``db_url`` (so ``engine`` and ``live_server`` too) gets the session's
database on the coordinator, migrated and distributed by ``fleetscope db distribute``'s code, with
every table emptied (``TRUNCATE ... RESTART IDENTITY CASCADE``) before the test. A test that changes
the schema itself (creates tables, migrates down) gets the database recreated after it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
ENABLED = os.environ.get("FLEETSCOPE_CITUS") == "1"

if not ENABLED:
    collect_ignore_glob = ["*"]



def _root_conftest() -> Any:
    """tests/conftest.py's module. The server tests do ``from conftest import start_server``; here
    ``conftest`` is this module (pytest imports every conftest.py as ``conftest``), so the names it
    lacks are looked up there (PEP 562 module ``__getattr__``)."""
    global _ROOT
    if _ROOT is not None:
        return _ROOT
    import gc
    import types

    path = str(HERE.parent / "conftest.py")
    for o in gc.get_objects():
        if isinstance(o, types.ModuleType) and getattr(o, "__file__", None) == path:
            _ROOT = o
            return o
    raise ImportError(f"{path} is not loaded")


_ROOT: Any = None


def __getattr__(name: str) -> Any:
    # pluggy asks every conftest for every hook name at every test: those are never borrowed (and a
    # scan of the heap per question made the whole suite several times slower)
    if name.startswith(("__", "pytest_")):
        raise AttributeError(name)
    return getattr(_root_conftest(), name)


#: server tests that cannot run on a distributed schema, and why (deselected in this tier, listed
#: in its header)
NOT_ON_CITUS = {
    "test_schema_catalog.py::test_migration_0003_keeps_queued_rows_and_downgrades_to_the_old_keys":
        "migrates down to 0002, whose keys Citus refuses by design (the migration is what made the schema distributable)",
}


def pytest_collection_finish(session: pytest.Session) -> None:
    if ENABLED:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    from cluster import VENDOR_TARBALL  # noqa: PLC0415

    src = "builds Citus from " + str(VENDOR_TARBALL) if VENDOR_TARBALL.is_file() else (
        f"needs Citus installed into pgserver's PostgreSQL, or its source at {VENDOR_TARBALL}")
    tr.write_line(f"Citus tier (tests/citus) not selected: run it with `FLEETSCOPE_CITUS=1 pytest tests/citus` ({src})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ENABLED:
        return
    keep, drop = [], []
    for item in items:
        if any(item.nodeid.endswith(k) for k in NOT_ON_CITUS) and "/citus/" in item.nodeid:
            drop.append(item)
        elif "/citus/dashboard/" in item.nodeid and "db_url" not in getattr(item, "fixturenames", ()):
            drop.append(item)  # a dashboard test without the database (figures, downsampling): nothing Citus changes
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not ENABLED:
        return []
    return ["citus tier: not run on Citus: " + "; ".join(f"{k}: {v}" for k, v in NOT_ON_CITUS.items())]


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[Any]:
    """Coordinator + two workers; built and started once per session, torn down failing or not."""
    import signal

    from cluster import CitusCluster

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # pytest then tears the fixtures down

    previous = signal.signal(signal.SIGTERM, _interrupt)  # `timeout` stops a hung run with SIGTERM
    t0 = time.monotonic()
    cluster = CitusCluster.start(workers=2)
    try:
        cluster.started_in = time.monotonic() - t0
        yield cluster
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


def new_distributed_db(cluster: Any) -> str:
    """A database on the cluster, migrated to head and distributed."""
    from fleetscope.server.db import make_engine, upgrade
    from fleetscope.server.store.citus import distribute

    url = cluster.create_database()
    upgrade(url)
    eng = make_engine(url, pool_size=1)
    try:
        distribute(eng)
    finally:
        eng.dispose()
    return url


_SCHEMA = """
SELECT (SELECT string_agg(relname, ',' ORDER BY relname) FROM pg_class
        WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p', 'v', 'm')),
       (SELECT string_agg(version_num, ',') FROM alembic_version),
       (SELECT count(*) FROM pg_dist_partition)
"""


class SessionDb:
    """The tier's database: reset before each test, recreated when a test changed its schema."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.url = new_distributed_db(cluster)
        self.signature = self._signature()
        self.resets = 0
        self.reset_s = 0.0

    def _signature(self) -> tuple[Any, ...]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as c:
            row = c.execute(_SCHEMA).fetchone()
        assert row is not None
        return tuple(row)

    def reset(self) -> str:
        import psycopg

        t0 = time.monotonic()
        if self._signature() != self.signature:
            self.cluster.drop_database(self.url.rsplit("/", 1)[1])
            self.url = new_distributed_db(self.cluster)
            self.signature = self._signature()
        else:
            with psycopg.connect(self.url, autocommit=True) as c:
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'")
                tables = [r[0] for r in c.execute(
                    "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind = 'r' "
                    "AND relname <> 'alembic_version'")]
                c.execute("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " RESTART IDENTITY CASCADE")
        self.resets += 1
        self.reset_s += time.monotonic() - t0
        return self.url


_STATS: dict[str, float] = {}


@pytest.fixture(scope="session")
def citus_session_db(citus_cluster: Any) -> Iterator[SessionDb]:
    t0 = time.monotonic()
    db = SessionDb(citus_cluster)
    _STATS["cluster_s"] = citus_cluster.started_in
    _STATS["db_s"] = time.monotonic() - t0
    try:
        yield db
    finally:
        _STATS["resets"], _STATS["reset_s"] = db.resets, db.reset_s


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if ENABLED and "cluster_s" in _STATS:
        n = _STATS.get("resets", 0)
        terminalreporter.write_line(
            f"citus tier: cluster started in {_STATS['cluster_s']:.1f}s, database migrated + distributed in "
            f"{_STATS['db_s']:.1f}s, {n:.0f} resets between tests took {_STATS.get('reset_s', 0):.1f}s "
            f"({1e3 * _STATS.get('reset_s', 0) / max(n, 1):.0f} ms each)")


@pytest.fixture
def db_url(citus_session_db: SessionDb) -> Iterator[str]:
    """The session's distributed database on the coordinator, emptied (overrides tests/conftest.py)."""
    yield citus_session_db.reset()
