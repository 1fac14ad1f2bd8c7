"""The migrated schema is distributable on Citus by ``run_id``; checked on the live catalog.

A per-run table is one with a NOT NULL ``run_id`` column (``alerts.run_id`` is nullable: a
reference table). Citus refuses a distributed table whose PRIMARY KEY / UNIQUE / EXCLUDE index does
not contain the distribution column, and a foreign key between two distributed tables that does not
pair their distribution columns; a reference table may not reference a distributed one. We also
require a primary key on every per-run table, with run_id first (shard moves replicate by logical
replication, which needs one). ``fleetscope db distribute``'s plan (server/store/citus.py) must name exactly these tables;
tests/citus runs it on a real cluster.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

LOCAL_ONLY = {"alembic_version"}  # stays a plain table on the coordinator

_TABLES = """
SELECT c.relname::text, a.attnotnull
FROM pg_class c
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'run_id' AND NOT a.attisdropped
WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p')
"""
# every PRIMARY KEY, UNIQUE and EXCLUDE index with its key columns (not INCLUDE ones) in order;
# an expression column shows as NULL
_UNIQUE_INDEXES = """
SELECT c.relname::text, i.relname::text, x.indisprimary,
       ARRAY(SELECT a.attname::text FROM unnest(x.indkey[0:x.indnkeyatts - 1]) WITH ORDINALITY AS k(attnum, ord)
             LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum ORDER BY k.ord)
FROM pg_index x
JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_class i ON i.oid = x.indexrelid
WHERE c.relnamespace = current_schema()::regnamespace AND (x.indisunique OR x.indisexclusion)
"""
_FOREIGN_KEYS = """
SELECT k.conname::text, src.relname::text, dst.relname::text, k.confdeltype::text, k.confupdtype::text,
       ARRAY(SELECT a.attname::text FROM unnest(k.conkey) WITH ORDINALITY AS u(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = u.attnum ORDER BY u.ord),
       ARRAY(SELECT a.attname::text FROM unnest(k.confkey) WITH ORDINALITY AS u(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = k.confrelid AND a.attnum = u.attnum ORDER BY u.ord)
FROM pg_constraint k
JOIN pg_class src ON src.oid = k.conrelid
JOIN pg_class dst ON dst.oid = k.confrelid
WHERE k.contype = 'f' AND src.relnamespace = current_schema()::regnamespace
"""


def tables(conn: Any) -> tuple[set[str], set[str]]:
    """(per-run tables, every other table) of the current schema."""
    per_run, other = set(), set()
    for name, run_id_not_null in conn.execute(text(_TABLES)):
        (per_run if run_id_not_null else other).add(name)
    return per_run, other


def citus_violations(conn: Any) -> list[str]:
    """Every reason ``create_distributed_table(<per-run table>, 'run_id')`` would refuse (or a
    shard move would fail), read from pg_index / pg_constraint. Empty when distributable."""
    per_run, _ = tables(conn)
    out = []
    pk_of = {}
    for table, index, is_pk, cols in conn.execute(text(_UNIQUE_INDEXES)):
        if table not in per_run:
            continue
        if is_pk:
            pk_of[table] = cols
            if cols[0] != "run_id":
                out.append(f"{table}: primary key {index} {cols} does not start with run_id")
        elif "run_id" not in cols:
            out.append(f"{table}: unique index {index} {cols} does not contain run_id")
    out += [f"{table}: no primary key" for table in sorted(per_run - set(pk_of))]
    for name, src, dst, on_delete, on_update, cols, ref_cols in conn.execute(text(_FOREIGN_KEYS)):
        pairs = set(zip(cols, ref_cols, strict=True))
        if src in per_run and dst in per_run and ("run_id", "run_id") not in pairs:
            out.append(
                f"{src}: foreign key {name} {cols} -> {dst}{ref_cols} does not pair run_id with run_id"
            )
        if src not in per_run and dst in per_run:
            out.append(f"{src}: foreign key {name} from a reference table to the per-run table {dst}")
        if src in per_run and "run_id" in cols and (on_delete in "nd" or on_update in "cnd"):
            out.append(
                f"{src}: foreign key {name} on run_id has ON DELETE {on_delete!r} / ON UPDATE {on_update!r}"
                " (Citus allows neither SET NULL/SET DEFAULT nor ON UPDATE CASCADE on it)"
            )
    return out


def test_every_per_run_table_has_run_id_in_its_primary_key_unique_indexes_and_foreign_keys(
    engine: Any,
) -> None:
    with engine.connect() as c:
        per_run, _ = tables(c)
        assert {"ranks", "steps", "ingest_fragments", "modality_raw", "rank_rollups", "run_stats"} <= per_run
        assert citus_violations(c) == []


def test_the_catalog_check_catches_each_kind_of_violation(engine: Any) -> None:
    """The check is not vacuous: tables breaking each rule are reported, each for its reason."""
    with engine.begin() as c:
        c.execute(text("CREATE TABLE bad_nopk (run_id int NOT NULL, x int)"))
        c.execute(text("CREATE TABLE bad_pk (id int PRIMARY KEY, run_id int NOT NULL)"))
        c.execute(text("CREATE TABLE bad_pk_order (run_id int NOT NULL, x int, PRIMARY KEY (x, run_id))"))
        c.execute(
            text("CREATE TABLE bad_uq (run_id int NOT NULL, x int, PRIMARY KEY (run_id, x), y int UNIQUE)")
        )
        c.execute(
            text("CREATE UNIQUE INDEX bad_uq_expr ON bad_uq (run_id, lower(x::text))")
        )  # fine: has run_id
        c.execute(
            text(
                "CREATE TABLE bad_fk (run_id int NOT NULL, y int REFERENCES bad_uq (y), PRIMARY KEY (run_id, y))"
            )
        )
        c.execute(
            text(
                "CREATE TABLE bad_ref (id int PRIMARY KEY, r int, s int, FOREIGN KEY (r, s) REFERENCES ranks)"
            )
        )
        c.execute(
            text(
                "CREATE TABLE bad_act (run_id int NOT NULL, rank int, PRIMARY KEY (run_id, rank), "
                "FOREIGN KEY (run_id, rank) REFERENCES ranks ON DELETE SET NULL)"
            )
        )
        v = "\n".join(citus_violations(c))
    assert "bad_nopk: no primary key" in v
    assert "bad_pk: primary key bad_pk_pkey ['id'] does not start with run_id" in v
    assert "bad_pk_order: primary key" in v
    assert "bad_uq: unique index bad_uq_y_key ['y'] does not contain run_id" in v
    assert "bad_uq_expr" not in v
    assert "bad_fk: foreign key" in v and "does not pair run_id" in v
    assert "bad_ref: foreign key" in v and "from a reference table" in v
    assert "bad_act: foreign key" in v and "ON DELETE 'n'" in v
    assert len(v.splitlines()) == 7, v


def test_citus_layout_of_db_distribute_names_exactly_the_catalogs_per_run_and_reference_tables(
    engine: Any,
) -> None:
    """``fleetscope db distribute`` (server/store/citus.py) reads its plan from the catalog: every per-run
    table distributed by run_id, every other table but alembic_version a reference table, a table
    referenced by a foreign key created before the tables that reference it."""
    from fleetscope.server.store.citus import layout

    with engine.connect() as c:
        per_run, other = tables(c)
        fks = [(src, dst) for _n, src, dst, *_ in c.execute(text(_FOREIGN_KEYS))]
        plan = layout(c)
    names = plan.reference + plan.distributed
    assert len(names) == len(set(names)), f"a table is named twice: {names}"
    assert set(plan.distributed) == per_run
    assert set(plan.reference) == other - LOCAL_ONLY
    first = plan.distributed[0]
    assert plan.colocate_with is None  # set by plan() on a Citus coordinator; layout() is the catalog's part
    plan.colocate_with = first
    statements = plan.statements()
    assert statements[: len(plan.reference)] == [f"SELECT create_reference_table('{t}')" for t in plan.reference]
    assert statements[len(plan.reference)] == f"SELECT create_distributed_table('{first}', 'run_id')"
    assert all(f"'run_id', colocate_with => '{first}')" in st for st in statements[len(plan.reference) + 1:])
    # Citus accepts a foreign key only to a table that is already distributed / a reference table
    pos = {t: i for i, t in enumerate(names)}
    for src, dst in fks:
        if src in pos and src != dst:
            assert pos[dst] < pos[src], f"{src} references {dst}, which the plan creates later"


def test_models_mirror_the_migrated_schema_including_primary_key_column_order(engine: Any) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from fleetscope.server.models import Base

    with engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata)
        assert diff == []
        # Alembic does not compare primary keys: do it here, column order included
        live = {t: cols for t, _i, is_pk, cols in c.execute(text(_UNIQUE_INDEXES)) if is_pk}
    models = {t.name: [col.name for col in t.primary_key.columns] for t in Base.metadata.sorted_tables}
    assert models == {t: cols for t, cols in live.items() if t not in LOCAL_ONLY}


def test_migration_0003_keeps_queued_rows_and_downgrades_to_the_old_keys(db_url: str, engine: Any) -> None:
    """Downgrade to 0002 restores the keys the check rejects; rows queued then (duplicate modality
    rows included: the compactor dedups them) survive the upgrade and get ids."""
    from alembic import command
    from fleetscope.server.db import _alembic_config, upgrade

    engine.dispose()
    command.downgrade(_alembic_config(db_url), "0002")
    with engine.begin() as c:
        v = citus_violations(c)
        assert "ingest_fragments: primary key pk_ingest_fragments ['id'] does not start with run_id" in v
        assert "modality_raw: no primary key" in v
        c.execute(text("INSERT INTO runs (name) VALUES ('r1'), ('r2')"))
        c.execute(
            text(
                "INSERT INTO ingest_fragments (run_id, n_rank_steps, n_collectives, step_min, step_max) "
                "VALUES (1, 1, 0, 0, 0), (2, 2, 0, 0, 1)"
            )
        )
        c.execute(
            text(
                "INSERT INTO modality_raw (run_id, step, rank, modality, tokens) "
                "VALUES (1, 0, 0, 'text', 5), (1, 0, 0, 'text', 5), (2, 3, 1, 'image', 7)"
            )
        )
    engine.dispose()
    upgrade(db_url)
    with engine.begin() as c:
        assert citus_violations(c) == []
        frags = c.execute(text("SELECT run_id, id FROM ingest_fragments ORDER BY id")).all()
        assert [tuple(r) for r in frags] == [(1, 1), (2, 2)]
        mods = c.execute(
            text("SELECT run_id, id, step, rank, modality, tokens FROM modality_raw ORDER BY id")
        ).all()
        assert [r[0] for r in mods] == [1, 1, 2] and len({r[1] for r in mods}) == 3
        # new rows draw ids from the sequences
        new_frag = c.execute(
            text(
                "INSERT INTO ingest_fragments (run_id, n_rank_steps, n_collectives, step_min, "
                "step_max) VALUES (1, 1, 0, 5, 5) RETURNING id"
            )
        ).scalar_one()
        new_mod = c.execute(
            text(
                "INSERT INTO modality_raw (run_id, step, rank, modality, tokens) "
                "VALUES (1, 0, 0, 'text', 5) RETURNING id"
            )
        ).scalar_one()
        assert new_frag > 2 and new_mod > max(r[1] for r in mods)
