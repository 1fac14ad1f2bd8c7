"""The run summary's ``network`` (``analysis.network``) and the per-(run, node) health rows it leaves
for the node history (``reports.nodes``, ``GET /api/v1/nodes``).

Cost: the network health is computed from the collective blocks of a **sample of the run's steps**
— at most ``SAMPLE_STEPS`` steps, fewer when a step holds many records (about ``SAMPLE_RECORDS``
records in all, never fewer than ``MIN_SAMPLE_STEPS`` steps), spread evenly over the run (every
k-th of its compacted steps counted from the latest, which is always in) — so a cold computation
is bounded whatever the run's length (about 0.1–0.3 s on 1,024 ranks); it is cached per process by
the run's version like every report of a run, and its per-node rows are stored in
``run_node_health`` at the same time.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ..analysis.network import NetworkHealth, network_health, node_health_rows, summary_network
from ..store import nodes as node_store
from ..store import ranks
from ..store.rows import RunRow
from . import _cache

__all__ = ["run_network", "network_findings", "sample_plan", "SAMPLE_STEPS", "SAMPLE_RECORDS", "MIN_SAMPLE_STEPS"]

log = logging.getLogger(__name__)

SAMPLE_STEPS = 200
SAMPLE_RECORDS = 262_144
MIN_SAMPLE_STEPS = 16


def sample_plan(run: RunRow) -> tuple[int, int]:
    """(stride, steps): every ``stride``-th of the run's compacted steps from the latest, ``steps`` of them."""
    per_step = run.collective_records / max(run.steps, 1)
    n = int(min(SAMPLE_STEPS, max(MIN_SAMPLE_STEPS, SAMPLE_RECORDS // max(per_step, 1.0))))
    return max(1, math.ceil(run.steps / n)), n


def _health(engine: Engine, run: RunRow) -> tuple[NetworkHealth, dict[int, tuple[str | None, str | None]], str | None]:
    hosts = _cache.cached("hosts", engine, run, lambda: ranks.hosts(engine, run.id))
    if run.collective_records <= 0 or run.steps <= 0:
        return network_health([], hosts), hosts, None
    stride, n = sample_plan(run)
    blocks = node_store.sampled_comm_blocks(engine, run.id, stride=stride, limit=n)
    src = f"{len(blocks)} steps sampled (every {stride})" if stride > 1 else f"last {len(blocks)} steps"
    return network_health(blocks, hosts), hosts, src if blocks else None


def _cached_health(engine: Engine, run: RunRow) -> tuple[NetworkHealth, dict[int, tuple[str | None, str | None]],
                                                          str | None]:
    return _cache.cached("network_health", engine, run, lambda: _health(engine, run))


def network_findings(engine: Engine, run: RunRow) -> tuple[dict[str, Any], dict[int, tuple[str | None, str | None]]]:
    """(the summary's ``network`` of ``run``, its {rank: (host, node)}) for the alert worker's ``slow_node``
    alerts: the same health (cached per run version) without storing node rows — those are the
    summary's and ``GET /api/v1/nodes``' to write."""
    h, hosts, src = _cached_health(engine, run)
    return summary_network(h, source=src), hosts


def run_network(engine: Engine, run: RunRow, stragglers: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's ``network`` of ``run`` (``stragglers``: its straggler report, counted into the node
    rows); computed once per run version and process, which also stores the run's node health rows."""

    def compute() -> dict[str, Any]:
        h, hosts, src = _cached_health(engine, run)
        try:
            save_health(engine, run, h, hosts, stragglers, measured=src is not None)
        except SQLAlchemyError:  # the node history is kept best-effort: the summary never fails for it
            log.warning("run %s: node health rows not saved", run.id, exc_info=True)
        return summary_network(h, source=src)

    return _cache.cached("network", engine, run, compute)


def save_health(engine: Engine, run: RunRow, h: NetworkHealth, hosts: dict[int, tuple[str | None, str | None]],
                stragglers: dict[str, Any] | None, *, measured: bool) -> None:
    """Store the run's per-node rows. A run whose collectives were recorded but whose blocks are gone
    now (retention) keeps the rows measured before, marked current."""
    if not measured and run.collective_records > 0 and node_store.has_node_health(engine, run.id):
        node_store.touch_node_health(engine, run.id, run.rank_steps, run.status)
        return
    strag = [int(it["rank"]) for it in (stragglers or {}).get("stragglers", [])]
    node_store.save_node_health(engine, run.id, run.rank_steps, run.status, node_health_rows(h, hosts, strag))
