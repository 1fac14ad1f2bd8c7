"""Node health: the sampled collective blocks a run's network health is computed from, the per-(run,
node) ``run_node_health`` rows kept when it is, the node history read from them, and the latest
per-node microbenchmarks (``benchmark_series`` whose params name a ``node``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Engine, text

from ..codec import COLL_BLOCK_FIELDS, decode_block
from ..db import raw_connection

__all__ = [
    "NodeHistoryRow",
    "sampled_comm_blocks",
    "save_node_health",
    "touch_node_health",
    "has_node_health",
    "stale_runs",
    "node_history",
    "node_page",
    "node_runs",
    "node_microbench",
    "microbench_peers",
]


def sampled_comm_blocks(engine: Engine, run_id: int, *, stride: int, limit: int) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Decoded collective blocks of every ``stride``-th of the run's compacted steps that have one,
    counted from the latest (which is always in), at most ``limit`` of them, in step order. By position,
    not by step number, so sparse step numbers sample as well (binary protocol: bytea arrives as bytes;
    the blocks of the steps not taken are never read)."""
    with raw_connection(engine) as conn, conn.cursor(binary=True) as cur:
        cur.execute(
            "SELECT step, coll_block FROM (SELECT step, coll_block, row_number() OVER (ORDER BY step DESC) AS rn "
            "FROM steps WHERE run_id = %s AND n_ranks > 0 AND coll_block IS NOT NULL) t "
            "WHERE (rn - 1) %% %s = 0 ORDER BY step DESC LIMIT %s",
            (run_id, max(int(stride), 1), max(int(limit), 0)),
        )
        rows = cur.fetchall()
    return [(int(s), decode_block(COLL_BLOCK_FIELDS, bytes(b))) for s, b in rows[::-1]]


_LOCK_KEY = 727277  # with the run id: pg_advisory_xact_lock(key, run_id) around a run's rows
_COLS = ("node", "ranks", "straggler_ranks", "slow_ranks", "slow_network", "busbw_ratio", "latency_ratio")


def save_node_health(engine: Engine, run_id: int, rank_steps: int, status: str, rows: Sequence[dict[str, Any]]) -> None:
    """Replace the run's ``run_node_health`` rows (one per node: ``_COLS``) computed at the run's
    ``rank_steps`` / ``status``; ``seen_at`` is the run's last activity. An upsert, so two readers
    computing the same run at once both succeed: one after the other, under the run's advisory lock
    (concurrent multi-row upserts of the same keys would deadlock)."""
    with engine.begin() as c:
        c.execute(text("SELECT pg_advisory_xact_lock(:k, :r)"), {"k": _LOCK_KEY, "r": run_id})
        c.execute(text("DELETE FROM run_node_health WHERE run_id = :r AND node NOT IN "  # a hashed subplan:
                       "(SELECT unnest(CAST(:nodes AS text[])))"),  # not every row against every name
                  {"r": run_id, "nodes": [row["node"] for row in rows]})
        if rows:
            # one statement whatever the number of nodes (32,768 nodes one row at a time took seconds)
            c.execute(
                text(
                    "INSERT INTO run_node_health (run_id, node, ranks, straggler_ranks, slow_ranks, slow_network, "
                    "busbw_ratio, latency_ratio, rank_steps, status, seen_at, computed_at) "
                    "SELECT :r, u.node, u.ranks, u.straggler_ranks, u.slow_ranks, u.slow_network, u.busbw_ratio, "
                    "u.latency_ratio, :rank_steps, :status, coalesce(r.last_seen_at, r.finished_at, r.started_at), now() "
                    "FROM runs r, unnest(CAST(:node AS text[]), CAST(:ranks AS int[]), CAST(:straggler_ranks AS int[]), "
                    "CAST(:slow_ranks AS int[]), CAST(:slow_network AS boolean[]), CAST(:busbw_ratio AS float8[]), "
                    "CAST(:latency_ratio AS float8[])) AS u(node, ranks, straggler_ranks, slow_ranks, slow_network, "
                    "busbw_ratio, latency_ratio) WHERE r.id = :r "
                    "ON CONFLICT (run_id, node) DO UPDATE SET ranks = excluded.ranks, "
                    "straggler_ranks = excluded.straggler_ranks, slow_ranks = excluded.slow_ranks, "
                    "slow_network = excluded.slow_network, busbw_ratio = excluded.busbw_ratio, "
                    "latency_ratio = excluded.latency_ratio, rank_steps = excluded.rank_steps, "
                    "status = excluded.status, seen_at = excluded.seen_at, computed_at = excluded.computed_at"
                ),
                {"r": run_id, "rank_steps": rank_steps, "status": status,
                 **{k: [row[k] for row in rows] for k in _COLS}},
            )


def touch_node_health(engine: Engine, run_id: int, rank_steps: int, status: str) -> int:
    """Mark the run's stored rows as current for ``rank_steps`` / ``status`` without changing their
    figures (the run's blocks were removed since: what was measured stays); rows updated."""
    with engine.begin() as c:
        c.execute(text("SELECT pg_advisory_xact_lock(:k, :r)"), {"k": _LOCK_KEY, "r": run_id})
        return int(c.execute(
            text("UPDATE run_node_health SET rank_steps = :s, status = :st, computed_at = now() WHERE run_id = :r"),
            {"r": run_id, "s": rank_steps, "st": status}).rowcount or 0)


def has_node_health(engine: Engine, run_id: int) -> bool:
    with engine.connect() as c:
        return c.execute(text("SELECT 1 FROM run_node_health WHERE run_id = :r LIMIT 1"), {"r": run_id}).first() is not None


# a run needs its rows (re)computed when it has a rank on a known node and compacted steps, and no row
# of the same status — or, once it is no longer running, of the same rank_steps (a live run's rows are
# refreshed by its own summary, not by every read of the node history). Uncorrelated IN / NOT IN
# subqueries, not EXISTS on r.id: on Citus `runs` is a reference table and a subquery on a distributed
# table correlated with it is refused ("complex joins are only supported ..."); uncorrelated ones are
# planned on their own (the same semi-/anti-join on plain Postgres)
_STALE = """
FROM runs r
WHERE r.steps > 0
  AND r.id IN (SELECT k.run_id FROM ranks k WHERE coalesce(k.node, k.host) IS NOT NULL)
  AND r.id NOT IN (SELECT h.run_id FROM run_node_health h JOIN runs f ON f.id = h.run_id
                   WHERE h.status = f.status AND (f.status IN ('running', 'stalled', 'hung') OR h.rank_steps = f.rank_steps))
"""


def stale_runs(engine: Engine, limit: int) -> tuple[list[int], int]:
    """(ids of up to ``limit`` runs whose node health is missing or stale, newest first; how many there are)."""
    with engine.connect() as c:
        ids = [int(r[0]) for r in c.execute(text(f"SELECT r.id {_STALE} ORDER BY r.id DESC LIMIT :k"), {"k": limit})]
        n = int(c.execute(text(f"SELECT count(*) {_STALE}")).scalar() or 0)
    return ids, n


@dataclass(frozen=True, slots=True)
class NodeHistoryRow:
    """One node over the runs it served (``run_node_health``)."""

    node: str
    runs: int
    straggler_runs: int  # runs where a rank of it was a straggler
    slow_network_runs: int  # runs where the node was network-slow
    slowed_runs: int  # runs with either
    busbw_ratio_median: float | None  # median over runs of the node's busbw ratio
    latency_ratio_median: float | None
    last_seen: dt.datetime | None


def node_history(engine: Engine, *, node: str | None = None) -> list[NodeHistoryRow]:
    """Every node's history (or one node's), in no particular order."""
    where = "WHERE node = :node" if node is not None else ""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT node, count(*), count(*) FILTER (WHERE straggler_ranks > 0), count(*) FILTER (WHERE slow_network), "
            "count(*) FILTER (WHERE straggler_ranks > 0 OR slow_network), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY busbw_ratio), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ratio), max(seen_at) "
            f"FROM run_node_health {where} GROUP BY node"), {"node": node}).fetchall()
    return [NodeHistoryRow(str(n), int(a), int(b), int(s), int(w), None if m is None else float(m),
                           None if lt is None else float(lt), t) for n, a, b, s, w, m, lt, t in rows]


_NODE_ROWS = """
WITH h AS (
  SELECT node, count(*) AS runs, count(*) FILTER (WHERE straggler_ranks > 0) AS straggler_runs,
         count(*) FILTER (WHERE slow_network) AS slow_network_runs,
         count(*) FILTER (WHERE straggler_ranks > 0 OR slow_network) AS slowed_runs,
         percentile_cont(0.5) WITHIN GROUP (ORDER BY busbw_ratio) AS busbw,
         percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ratio) AS latency, max(seen_at) AS last_seen
  FROM run_node_health GROUP BY node),
m AS (SELECT DISTINCT params->>'node' AS node FROM benchmark_series
      WHERE name LIKE :pre AND params->>'node' IS NOT NULL),
a AS (SELECT coalesce(h.node, m.node) AS node, coalesce(h.runs, 0) AS runs,
             coalesce(h.straggler_runs, 0) AS straggler_runs, coalesce(h.slow_network_runs, 0) AS slow_network_runs,
             coalesce(h.slowed_runs, 0) AS slowed_runs, h.busbw, h.latency, h.last_seen
      FROM h FULL JOIN m ON m.node = h.node)
"""
# worst first: most runs slowed, then the larger share of its runs, the lower busbw ratio (both as the
# API rounds them), the name (code-point order)
_NODE_ORDER = ("ORDER BY slowed_runs DESC, coalesce(round(slowed_runs::numeric / nullif(runs, 0), 4), 0) DESC, "
               "round(busbw::numeric, 4) ASC NULLS LAST, node COLLATE \"C\"")


def node_page(engine: Engine, *, limit: int, offset: int = 0,
              prefix: str = "node_") -> tuple[list[NodeHistoryRow], tuple[int, int, int]]:
    """(one page of every node seen in a run (``run_node_health``) or a per-node microbenchmark series
    named ``prefix…``, worst first; (how many nodes there are, how many slowed a run, how many were
    network-slow in one)). A node seen only in a microbenchmark has 0 runs."""
    pre = prefix.replace("_", "\\_") + "%"
    with engine.connect() as c:
        totals = c.execute(text(
            f"{_NODE_ROWS} SELECT count(*), count(*) FILTER (WHERE slowed_runs > 0), "
            "count(*) FILTER (WHERE slow_network_runs > 0) FROM a"), {"pre": pre}).one()
        rows = c.execute(text(
            f"{_NODE_ROWS} SELECT node, runs, straggler_runs, slow_network_runs, slowed_runs, busbw, latency, "
            f"last_seen FROM a {_NODE_ORDER} LIMIT :k OFFSET :o"),
            {"pre": pre, "k": int(limit), "o": int(offset)}).fetchall()
    return ([NodeHistoryRow(str(n), int(a), int(b), int(s), int(w), None if m is None else float(m),
                            None if lt is None else float(lt), t) for n, a, b, s, w, m, lt, t in rows],
            (int(totals[0]), int(totals[1]), int(totals[2])))


def node_runs(engine: Engine, node: str, limit: int = 50) -> list[dict[str, Any]]:
    """The node's runs, newest first: run id and name and the node's figures in it."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT h.run_id, r.name, h.ranks, h.straggler_ranks, h.slow_ranks, h.slow_network, h.busbw_ratio, "
            "h.latency_ratio, h.seen_at FROM run_node_health h JOIN runs r ON r.id = h.run_id WHERE h.node = :n "
            "ORDER BY h.seen_at DESC NULLS LAST, h.run_id DESC LIMIT :k"), {"n": node, "k": limit}).fetchall()
    return [dict(r._mapping) for r in rows]


def node_microbench(engine: Engine, prefix: str = "node_", *, nodes: Sequence[str] | None = None) -> list[
        tuple[str, str, str, dict[str, Any], str, dt.datetime, float, str]]:
    """(node, name, cluster, params, unit, ts, value, peer key) of the latest point of every benchmark
    series named ``prefix…`` whose params name a node (one of ``nodes`` when given); the peer key is the
    params without the node (``microbench_peers``)."""
    only = "" if nodes is None else "AND s.params->>'node' = ANY(:nodes) "
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT s.params->>'node', s.name, s.cluster, s.params, s.unit, p.ts, p.value, (s.params - 'node')::text "
            "FROM benchmark_series s "
            "JOIN LATERAL (SELECT ts, value FROM benchmark_points WHERE series_id = s.id ORDER BY ts DESC LIMIT 1) p "
            f"ON true WHERE s.name LIKE :pre AND s.params->>'node' IS NOT NULL {only}ORDER BY s.id"),
            {"pre": prefix.replace("_", "\\_") + "%", "nodes": list(nodes or [])}).fetchall()
    return [(str(n), nm, cl, p or {}, u, t, float(v), str(k)) for n, nm, cl, p, u, t, v, k in rows]


def microbench_peers(engine: Engine, prefix: str = "node_") -> dict[tuple[str, str, str], tuple[float, int]]:
    """{(name, cluster, params without the node as JSON text): (median of the series' latest values, how
    many series)} over every node's series named ``prefix…``: what a node's figure is compared with."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT s.name, s.cluster, (s.params - 'node')::text, percentile_cont(0.5) WITHIN GROUP (ORDER BY p.value), "
            "count(*) FROM benchmark_series s "
            "JOIN LATERAL (SELECT value FROM benchmark_points WHERE series_id = s.id ORDER BY ts DESC LIMIT 1) p "
            "ON true WHERE s.name LIKE :pre AND s.params->>'node' IS NOT NULL GROUP BY 1, 2, 3"),
            {"pre": prefix.replace("_", "\\_") + "%"}).fetchall()
    return {(str(n), str(cl), str(k)): (float(m), int(cnt)) for n, cl, k, m, cnt in rows}
