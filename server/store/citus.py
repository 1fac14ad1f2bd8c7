"""Citus: detect a coordinator, and distribute the migrated schema (``fleetscope db distribute``).

The plan is read from the catalog, so tables added by later migrations are included:

- a **per-run table** (a ``NOT NULL run_id`` column) is hash-distributed by ``run_id``, all of them
  in one co-location group (a run's rows of every table live on one worker);
- every other table of the schema is a **reference table** (a copy on every node), except
  ``alembic_version``, which stays a plain table on the coordinator.

Reference tables come first, and a table referenced by a foreign key before the tables that
reference it (Citus accepts a foreign key only to a table that is already distributed).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, text

__all__ = ["NotCitus", "Plan", "plan", "distribute", "is_citus", "citus_version"]

LOCAL_ONLY = frozenset({"alembic_version"})

_TABLES = """
SELECT c.relname::text, coalesce(a.attnotnull, false)
FROM pg_class c
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'run_id' AND NOT a.attisdropped
WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p') AND NOT c.relispartition
ORDER BY 1
"""
_FOREIGN_KEYS = """
SELECT src.relname::text, dst.relname::text
FROM pg_constraint k JOIN pg_class src ON src.oid = k.conrelid JOIN pg_class dst ON dst.oid = k.confrelid
WHERE k.contype = 'f' AND src.relnamespace = current_schema()::regnamespace AND src.oid <> dst.oid
"""
# what Citus already has: partmethod 'h' = hash-distributed, 'n' + repmodel 't' = reference table
_DISTRIBUTED = """
SELECT c.relname::text, p.partmethod::text, p.repmodel::text, p.colocationid,
       column_to_column_name(p.logicalrelid, p.partkey)
FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
WHERE c.relnamespace = current_schema()::regnamespace
"""


class NotCitus(RuntimeError):
    """The database is not a Citus coordinator."""


def citus_version(conn: Connection) -> str | None:
    """The installed citus extension's version in this database, or None."""
    v = conn.execute(text("SELECT extversion FROM pg_extension WHERE extname = 'citus'")).scalar()
    return str(v) if v is not None else None


_CITUS: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def is_citus(bind: Engine | Connection) -> bool:
    """Whether the database behind ``bind`` has the citus extension; detected once per engine."""
    engine = bind if isinstance(bind, Engine) else bind.engine
    found = _CITUS.get(engine)
    if found is None:
        if isinstance(bind, Connection):
            found = citus_version(bind) is not None
        else:
            with engine.connect() as c:
                found = citus_version(c) is not None
        _CITUS[engine] = found
    return found


#: on a Citus coordinator, every connection of the server runs multi-shard modifications over one
#: connection per worker. Citus otherwise refuses, in one transaction, a write to a reference table
#: (``runs``: the compactor's counters, retention's marks) after a parallel multi-shard one (the
#: compactor's delete of fragments by id across shards, retention's deletes), with "cannot modify
#: table ... because there was a parallel operation on a distributed table". Our per-run writes are
#: single-shard anyway; only the fragment queue's scan and delete span shards.
SESSION_SETTINGS = ("SET citus.multi_shard_modify_mode TO 'sequential'",)


def configure_engine(engine: Engine) -> None:
    """Detect Citus on each new connection of ``engine`` (one catalog query per pooled connection)
    and apply :data:`SESSION_SETTINGS` there; :func:`is_citus` then answers from the cache."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'")
            found = cur.fetchone() is not None
            if found:
                for stmt in SESSION_SETTINGS:
                    cur.execute(stmt)
            _CITUS[engine] = found
        finally:
            cur.close()
        dbapi_conn.commit()


@dataclass
class Plan:
    """What ``distribute`` does: reference tables and per-run tables in creation order."""

    reference: list[str] = field(default_factory=list)
    distributed: list[str] = field(default_factory=list)
    colocate_with: str | None = None
    #: tables already distributed as planned (skipped)
    done: set[str] = field(default_factory=set)

    def statements(self) -> list[str]:
        out = [f"SELECT create_reference_table('{t}')" for t in self.reference if t not in self.done]
        for t in self.distributed:
            if t in self.done:
                continue
            if t == self.colocate_with:
                out.append(f"SELECT create_distributed_table('{t}', 'run_id')")
            else:
                out.append(f"SELECT create_distributed_table('{t}', 'run_id', colocate_with => '{self.colocate_with}')")
        return out


def _topo(tables: list[str], refs: dict[str, set[str]]) -> list[str]:
    """``tables`` (sorted by name) reordered so that a referenced table precedes its referrers."""
    out: list[str] = []
    seen: set[str] = set()

    def visit(t: str, path: tuple[str, ...]) -> None:
        if t in seen or t in path:
            return
        for dst in sorted(refs.get(t, ())):
            if dst in tables:
                visit(dst, (*path, t))
        seen.add(t)
        out.append(t)

    for t in tables:
        visit(t, ())
    return out


def layout(conn: Connection) -> Plan:
    """The distribution the catalog of the current schema calls for (works on plain Postgres too):
    per-run tables and reference tables, each list in foreign-key order."""
    per_run: list[str] = []
    other: list[str] = []
    for name, run_id_not_null in conn.execute(text(_TABLES)):
        if name in LOCAL_ONLY:
            continue
        (per_run if run_id_not_null else other).append(name)
    refs: dict[str, set[str]] = {}
    for src, dst in conn.execute(text(_FOREIGN_KEYS)):
        refs.setdefault(src, set()).add(dst)
    return Plan(reference=_topo(other, refs), distributed=_topo(per_run, refs))


def plan(conn: Connection) -> Plan:
    """The distribution of the current schema, from its catalog and Citus' metadata.

    Raises :class:`NotCitus` on a database without the citus extension, and ``ValueError`` when a
    table is already distributed differently than planned (a manual change to reconcile by hand)."""
    if citus_version(conn) is None:
        raise NotCitus("CREATE EXTENSION citus")
    p = layout(conn)
    existing = {name: (method, rep, coloc, col) for name, method, rep, coloc, col in conn.execute(text(_DISTRIBUTED))}
    wrong = []
    group: int | None = None
    # a table a later migration created after the distribution, with a foreign key to a reference
    # table, is already a "Citus local table" (method 'n', replication 's'): it is distributed (or
    # made a reference table) like a plain one
    existing = {t: v for t, v in existing.items() if not (v[0] == "n" and v[1] == "s")}
    for t in p.reference:
        if t in existing:
            method, rep, _c, _col = existing[t]
            if method == "n" and rep == "t":
                p.done.add(t)
            else:
                wrong.append(f"{t} is distributed (method {method!r}) but should be a reference table")
    for t in p.distributed:
        if t not in existing:
            continue
        method, _rep, coloc, col = existing[t]
        if method != "h" or col != "run_id":
            wrong.append(f"{t} is a Citus table (method {method!r}, column {col!r}), not hash-distributed by run_id")
            continue
        if group is None:
            group, p.colocate_with = coloc, t
        elif coloc != group:
            wrong.append(f"{t} is distributed by run_id but not co-located with {p.colocate_with}")
            continue
        p.done.add(t)
    if wrong:
        raise ValueError("; ".join(wrong))
    if p.colocate_with is None and p.distributed:
        p.colocate_with = p.distributed[0]
    return p


def distribute(engine: Engine) -> tuple[Plan, list[str]]:
    """Apply :func:`plan` on the coordinator; returns the plan and the statements run (none when
    the schema was already distributed)."""
    with engine.connect() as conn:
        p = plan(conn)
        conn.rollback()
    done = []
    for stmt in p.statements():
        # one transaction per table: Citus copies a table's rows into its shards in its own
        # transaction, and a failure leaves the tables before it distributed (a rerun continues)
        with engine.begin() as conn:
            conn.execute(text(stmt))
        done.append(stmt)
    _CITUS[engine] = True
    return p, done


def is_distributed(conn: Connection) -> bool:
    """Citus is installed and at least one table of the schema is hash-distributed (``db distribute``
    ran): then :func:`fleetscope.server.db.upgrade` distributes what later migrations add."""
    if citus_version(conn) is None:
        return False
    return bool(conn.execute(text(
        "SELECT EXISTS (SELECT 1 FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid "
        "WHERE c.relnamespace = current_schema()::regnamespace AND p.partmethod = 'h')")).scalar())


def placement_summary(conn: Connection) -> dict[str, Any]:
    """Nodes and shard counts per node (for the CLI's report)."""
    rows = conn.execute(
        text("SELECT nodename, nodeport, count(*) FROM citus_shards GROUP BY 1, 2 ORDER BY 1, 2")
    ).all()
    return {f"{h}:{p}": int(n) for h, p, n in rows}


def distribute_database(url: str, *, make_engine: Any, upgrade: Any) -> tuple[Plan, list[str], dict[str, int]]:
    """Refuse a database without Citus (:class:`NotCitus`) before migrating anything, migrate
    (``upgrade(url)``), distribute, and report shards per node. Returns (the plan, the statements run —
    none when already distributed, {node: shards})."""
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as c:
            if citus_version(c) is None:
                raise NotCitus("CREATE EXTENSION citus")
        upgrade(url)
        plan, done = distribute(engine)
        with engine.connect() as c:
            nodes = placement_summary(c)
        return plan, done, nodes
    finally:
        engine.dispose()
