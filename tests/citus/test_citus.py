"""fleetscope on a running Citus cluster (coordinator + two workers on loopback): ``fleetscope db
distribute`` from the catalog, idempotent, refused on plain Postgres; a later migration on a
distributed schema; runs spread over both workers, a per-run query routed to one; the same answers
as plain Postgres for the same data."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import text

from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows


def _fleetscope(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETSCOPE_DATABASE_URL"}
    return subprocess.run([sys.executable, "-m", "fleetscope", *args], capture_output=True, text=True,
                          timeout=300, env=env, check=False)


@pytest.fixture
def fresh_db(citus_cluster: Any) -> Iterator[str]:
    """A database of its own on the cluster (citus extension, workers registered), not migrated."""
    url = citus_cluster.create_database()
    yield url
    citus_cluster.drop_database(url.rsplit("/", 1)[1])


_PARTITION = """
SELECT c.relname::text, p.partmethod::text, p.repmodel::text, p.colocationid,
       column_to_column_name(p.logicalrelid, p.partkey)
FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
WHERE c.relnamespace = 'public'::regnamespace ORDER BY 1
"""


def _catalog(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as c:
        return [tuple(r) for r in c.execute(_PARTITION)]


def _tables(url: str) -> tuple[set[str], set[str]]:
    """(tables with a NOT NULL run_id, every other table but alembic_version) of the schema."""
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT c.relname, coalesce(a.attnotnull, false) FROM pg_class c LEFT JOIN pg_attribute a "
            "ON a.attrelid = c.oid AND a.attname = 'run_id' AND NOT a.attisdropped "
            "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND c.relname <> 'alembic_version' "
            "AND c.relname NOT LIKE '%\\_1%'").fetchall()  # (shard names look like steps_102008; none on the coordinator)
    return {n for n, nn in rows if nn}, {n for n, nn in rows if not nn}


def test_db_distribute_distributes_every_per_run_table_by_run_id_and_is_idempotent(fresh_db: str) -> None:
    from fleetscope.server.db import upgrade

    upgrade(fresh_db)
    per_run, other = _tables(fresh_db)
    assert {"ranks", "steps", "ingest_fragments", "runs", "api_tokens"} <= per_run | other
    assert _catalog(fresh_db) == []

    first = _fleetscope("db", "distribute", "--database-url", fresh_db)
    assert first.returncode == 0, first.stderr
    assert f"distributed {len(per_run) + len(other)} tables" in first.stdout
    cat = _catalog(fresh_db)
    hashed = {t: (coloc, col) for t, m, _r, coloc, col in cat if m == "h"}
    reference = {t for t, m, r, _c, _col in cat if m == "n" and r == "t"}
    assert set(hashed) == per_run, "every table with a NOT NULL run_id, nothing else, is distributed"
    assert reference == other, "every other table (runs, alerts, tokens, benchmarks) is a reference table"
    assert {col for _c, col in hashed.values()} == {"run_id"}
    assert len({coloc for coloc, _col in hashed.values()}) == 1, "all per-run tables in one co-location group"
    assert "alembic_version" not in {t for t, *_ in cat}
    # the shards are on both workers
    with psycopg.connect(fresh_db) as c:
        nodes = {p for (p,) in c.execute("SELECT DISTINCT nodeport FROM citus_shards WHERE citus_table_type = 'distributed'")}
        workers = {p for (p,) in c.execute("SELECT nodeport FROM pg_dist_node WHERE groupid <> 0")}
    assert nodes == workers and len(workers) == 2

    again = _fleetscope("db", "distribute", "--database-url", fresh_db)
    assert again.returncode == 0, again.stderr
    assert "already distributed: nothing to do" in again.stdout
    assert _catalog(fresh_db) == cat


def test_db_distribute_refuses_plain_postgres_with_one_clear_line(pg_admin_uri: str) -> None:
    import uuid

    from conftest import _db_uri  # tests/conftest.py (this directory's conftest forwards to it)

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    try:
        r = _fleetscope("db", "distribute", "--database-url", _db_uri(pg_admin_uri, name))
        with psycopg.connect(_db_uri(pg_admin_uri, name)) as c:  # refused before migrating anything
            assert c.execute("SELECT to_regclass('alembic_version')").fetchone() == (None,)
    finally:
        with psycopg.connect(pg_admin_uri, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not a Citus coordinator: CREATE EXTENSION citus" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_later_migration_on_a_distributed_schema_is_distributed_too(fresh_db: str) -> None:
    """Distribute at the revision before head, then `db upgrade` to head: the migration's DDL runs
    on the shards, and a table it adds is distributed (or made a reference table) by the upgrade."""
    from alembic.script import ScriptDirectory
    from fleetscope.server.db import _alembic_config, make_engine, upgrade

    script = ScriptDirectory.from_config(_alembic_config(fresh_db))
    head = script.get_current_head()
    assert head is not None
    before = script.get_revision(head).down_revision
    assert isinstance(before, str)
    upgrade(fresh_db, before)
    assert _fleetscope("db", "distribute", "--database-url", fresh_db).returncode == 0
    per_run_before, _ = _tables(fresh_db)

    r = _fleetscope("db", "upgrade", "--database-url", fresh_db)
    assert r.returncode == 0, r.stderr
    per_run, other = _tables(fresh_db)
    cat = _catalog(fresh_db)
    assert {t for t, m, *_ in cat if m == "h"} == per_run
    assert {t for t, m, rep, *_ in cat if m == "n" and rep == "t"} == other
    assert len({coloc for _t, m, _r, coloc, _c in cat if m == "h"}) == 1
    assert "already distributed" in _fleetscope("db", "distribute", "--database-url", fresh_db).stdout
    # and the schema works: a run lands, compacts and reads back on the upgraded cluster
    from conftest import start_server

    srv = start_server(fresh_db)
    try:
        rid = _load(srv, RunSpec(name="after-upgrade", family="vla-7b", world_size=4, steps=3))
        s = httpx.get(f"{srv.url}/api/v1/runs/{rid}/summary").json()
        assert s["rank_steps"] == 12 and s["decomposition"]["step_s"] > 0
    finally:
        srv.stop()
    assert per_run_before <= per_run
    eng = make_engine(fresh_db, pool_size=1)
    try:
        with eng.connect() as c:
            assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
    finally:
        eng.dispose()


def _load(srv: Any, spec: RunSpec) -> int:
    with srv.client() as c:
        rid = c.register_run(spec.run_info())
        for step, rows in rank_step_rows(spec):
            c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
    srv.compact()
    return int(rid)


def test_runs_spread_over_both_workers_and_a_per_run_query_touches_one(live_server: Any, citus_cluster: Any) -> None:
    ids = [_load(live_server, RunSpec(name=f"r{i}", family="vla-7b", world_size=2, steps=2, seed=i)) for i in range(8)]
    worker_of: dict[int, int] = {}
    with psycopg.connect(live_server.db_url) as c:
        for rid in ids:
            placements = c.execute(
                "SELECT DISTINCT s.nodeport FROM citus_shards s JOIN pg_dist_shard d ON d.shardid = s.shardid "
                "WHERE s.citus_table_type = 'distributed' AND d.shardid IN "
                "(SELECT get_shard_id_for_distribution_column(t, %s) FROM unnest(ARRAY['steps', 'ranks', "
                "'run_collectives']::regclass[]) t)", (rid,)).fetchall()
            assert len(placements) == 1, f"run {rid}'s co-located shards are on {placements}"
            worker_of[rid] = placements[0][0]
        assert set(worker_of.values()) == {w.port for w in citus_cluster.workers}, worker_of
        # the run's rows are physically in that worker's shard
        rid = ids[0]
        shard = c.execute("SELECT get_shard_id_for_distribution_column('steps', %s)", (rid,)).fetchone()
        assert shard is not None
        plan = "\n".join(r[0] for r in c.execute(
            "EXPLAIN SELECT step, step_s FROM steps WHERE run_id = %s ORDER BY step", (rid,)))
        assert "Task Count: 1" in plan and "Citus Adaptive" in plan, plan
        assert f"port={worker_of[rid]}" in plan, plan
        # a cross-run query fans out to every shard
        fan = "\n".join(r[0] for r in c.execute("EXPLAIN SELECT count(*) FROM steps"))
        assert f"Task Count: {citus_cluster.shard_count}" in fan, fan
    worker = next(w for w in citus_cluster.workers if w.port == worker_of[rid])
    with worker.connect(live_server.db_url.rsplit("/", 1)[1]) as wc:
        n = wc.execute(f"SELECT count(*) FROM steps_{shard[0]} WHERE run_id = %s", (rid,)).fetchone()
    assert n == (2,)


def _strip(x: Any) -> Any:
    """A summary without what differs between two databases by construction (ids, wall-clock times)."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items()
                if k not in {"id", "run_id", "started_at", "finished_at", "last_seen_at", "computed_at", "created_at",
                             "updated_at", "url", "href"}}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def test_same_summaries_stragglers_and_collectives_as_plain_postgres(live_server: Any, pg_admin_uri: str) -> None:
    """The same runs (one with a straggler, one comm-bound) into plain Postgres and into Citus: the
    read API answers the same."""
    import uuid

    from conftest import _db_uri, start_server

    specs = [RunSpec(name="straggle", family="vla-7b", world_size=8, steps=6, straggler={5: 1.6}),
             RunSpec(name="comm", family="vit-h", world_size=4, steps=5, comm_bound=True, seed=3)]
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_admin_uri, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    plain = start_server(_db_uri(pg_admin_uri, name))
    try:
        answers = []
        for srv in (plain, live_server):
            ids = [_load(srv, s) for s in specs]
            got = {}
            for rid, spec in zip(ids, specs, strict=True):
                for route in ("summary", "collectives", "steps", "overlap", "check"):
                    r = httpx.get(f"{srv.url}/api/v1/runs/{rid}/{route}")
                    got[(spec.name, route)] = (r.status_code, _strip(r.json()))
            got[("list", "runs")] = (200, _strip(httpx.get(f"{srv.url}/api/v1/runs").json()))
            answers.append(got)
    finally:
        plain.stop()
        with psycopg.connect(pg_admin_uri, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    pg, citus = answers
    s = citus[("straggle", "summary")][1]
    assert s["decomposition"]["step_s"] > 0 and s["stragglers"], s
    assert any(x.get("rank") == 5 for x in s["stragglers"]), s["stragglers"]
    for key in pg:
        assert citus[key] == pg[key], key
