"""The gauges ``/metrics`` reads at scrape time, in groups (``metrics.ServiceMetrics``):

* ``instance`` — this process's pool, ingest queue and writers, the compaction backlog it admits by
  (no database access);
* ``database`` — one round trip: ``fleetscope_db_up`` is 1, else 0 and the groups below are left out;
* ``cluster`` — ``fleetscope_cluster_runs{status}`` (a zero for every status) and
  ``fleetscope_cluster_active_ranks``, read from the shared database (``--no-cluster-metrics`` turns
  this and ``runs`` off, for all instances but one);
* ``runs`` — per-run gauges of the runs that are running, stalled or hung: at most
  ``metrics_max_runs`` of them, the most recently active first, labelled ``run`` (its name) and
  ``family`` only — never a rank. Two queries and the per-run figures the pages already cache.
  Runs that ended (failed, finished, aborted) while one of their alerts still fires — a failure
  alert above all — keep ``fleetscope_run_state``, ``fleetscope_run_state_code`` and
  ``fleetscope_run_alerts_firing`` (not the step figures, nor the stall gauge) until the alert is
  acknowledged or resolved: at most ``metrics_max_runs`` more, those with a firing hang, node-lost or
  failure alert first, then the most recently active. Two more queries. The Prometheus rules
  (docs/prometheus-rules.yml) page on these alert gauges, so a failed run pages although it is not
  live any more.
* ``devices`` — GPU trouble per node from the agents' device telemetry (``prom_devices``: label ``node`` only,
  at most 50 nodes, the rest as ``_other``); ``utilisation`` — GPU-hours per team and family (``prom_utilisation``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .metrics import RUN_STATES, Group
from .reports.runs import figures
from .store import alert_gauges
from .store import runs as run_store
from .store.rows import RunRow

__all__ = ["scrape_groups", "LIVE_STATES", "STATE_CODES", "PAGING_KINDS", "run_gauges"]

log = logging.getLogger(__name__)

#: the statuses whose runs get per-run gauges
LIVE_STATES = ("running", "stalled", "hung")
#: ``fleetscope_run_state_code``: one number per state (alert rules compare ``== 2`` for hung, …)
STATE_CODES = {"running": 0, "stalled": 1, "hung": 2, "failed": 3, "finished": 4, "aborted": 5}
#: the alert kinds the run rules page on: an ended run with one of these firing is exported first
PAGING_KINDS = ("hang", "node_lost", "failure")

def scrape_groups(get_state: Callable[[], Any]) -> Callable[[], dict[str, Group]]:
    """The groups of one scrape, for ``ServiceMetrics(groups=...)``."""

    def groups() -> dict[str, Group]:
        st = get_state()
        if st is None:
            return {}
        db_ok = [False]

        def instance() -> dict[str, Any]:
            pool = st.engine.pool
            return {
                "fleetscope_db_pool_checked_out": ("DB connections in use (this instance)",
                                                   float(getattr(pool, "checkedout", lambda: 0)()), None),
                "fleetscope_ingest_queue_depth": ("Batches waiting for a writer", float(st.ingest.admission.waiting), None),
                "fleetscope_ingest_active_writers": ("Batches being written", float(st.ingest.admission.active), None),
                "fleetscope_compaction_backlog_rows": ("Landed rank-steps not yet compacted, as this instance last saw "
                                                       "them (shared database: use max across instances)",
                                                       float(st.ingest.backlog_rows), None),
            }

        def database() -> dict[str, Any]:
            try:
                run_store.ping(st.engine)
                db_ok[0] = True
            except Exception as e:  # noqa: BLE001 - the database is down: say so, keep the target up
                log.debug("metrics: database unreachable: %s", type(e).__name__)
                st.metrics.collection_errors.labels("database").inc()
            return {"fleetscope_db_up": ("1 when this scrape reached the database, else 0", float(db_ok[0]), None)}

        def cluster() -> dict[str, Any]:
            if not db_ok[0]:
                return {}
            rows = run_store.runs_by_status(st.engine)
            counts = dict.fromkeys(RUN_STATES, 0.0)
            for status, n, _ in rows:
                counts[status] = float(n)
            return {
                "fleetscope_cluster_runs": ("Runs by status (cluster-wide: the same on every instance)",
                                            [((k,), v) for k, v in counts.items()], ("status",)),
                "fleetscope_cluster_active_ranks": ("Ranks of runs that are running, stalled or hung (cluster-wide)",
                                                    float(sum(r[2] for r in rows if r[0] in LIVE_STATES)), None),
            }

        def runs() -> dict[str, Any]:
            if not db_ok[0]:
                return {}
            return run_gauges(st.engine, int(st.settings.metrics_max_runs))

        def utilisation() -> dict[str, Any]:
            if not db_ok[0]:
                return {}
            from .prom_utilisation import utilisation_gauges  # GPU-hours per team / family, last 24 h

            return utilisation_gauges(st.engine)

        def devices() -> dict[str, Any]:
            if not db_ok[0]:
                return {}
            from .prom_devices import device_gauges  # GPU trouble per node (throttling, XID, ECC), last 24 h

            return device_gauges(st.engine)

        out: dict[str, Group] = {"instance": instance, "database": database}
        if st.settings.cluster_metrics:
            out["cluster"] = cluster
            out["runs"] = runs
            out["utilisation"] = utilisation
            out["devices"] = devices
        return out

    return groups


def run_gauges(engine: Any, cap: int, now: float | None = None) -> dict[str, Any]:
    """The per-run gauge families of the ``cap`` most recently active running, stalled or hung runs,
    and the state and alert gauges of at most ``cap`` ended runs whose alerts still fire. A name shared
    by two such runs (other owners, attempts) is exported once, for the live or more recent one; the
    firing alerts of the runs sharing it are added up (a failed attempt's failure still pages)."""
    names = {
        "fleetscope_run_step_seconds": "Median step time of the run (seconds, cross-rank median)",
        "fleetscope_run_steps": "Steps compacted so far",
        "fleetscope_run_mfu": "Model FLOPs utilisation (0-1)",
        "fleetscope_run_tokens_per_second": "Tokens per second, whole run",
        "fleetscope_run_last_step_timestamp_seconds": "Unix time of the last compacted step",
        "fleetscope_run_seconds_since_last_step": "Seconds since the last compacted step (the stall gauge)",
        "fleetscope_run_state_code": "The run's state: " + ", ".join(f"{k}={v}" for k, v in STATE_CODES.items()),
        "fleetscope_run_state": "1 for the run's current state (label state)",
        "fleetscope_run_alerts_firing": "Firing alerts of the run, by kind (live runs, and ended runs while one fires)",
    }
    series: dict[str, list[tuple[tuple[str, ...], float]]] = {n: [] for n in names}
    if cap > 0:
        ids, firing = run_store.live_runs_and_firing(engine, LIVE_STATES, cap)
        ended, ended_firing = _ended_runs_firing(engine, cap)
        found = run_store.runs_by_ids(engine, ids + ended) if ids or ended else {}
        rows: list[RunRow] = [found[i] for i in ids if i in found]
        ended_rows: list[RunRow] = [found[i] for i in ended if i in found]
        figs = figures(engine, rows) if rows else {}
        alerts: dict[int, dict[str, int]] = {}
        for rid, kind, n in (*firing, *ended_firing):
            alerts.setdefault(int(rid), {})[str(kind)] = int(n)
        by_labels: dict[tuple[str, str], dict[str, int]] = {}
        now = time.time() if now is None else now
        for r in rows:
            lv = (r.name, r.model_family or "")
            if lv in by_labels:
                _add(by_labels[lv], alerts.get(r.id, {}))
                continue
            by_labels[lv] = dict(alerts.get(r.id, {}))
            f = figs.get(r.id)
            if f is not None:
                for name, v in (("fleetscope_run_step_seconds", f.step_s), ("fleetscope_run_mfu", f.mfu),
                                ("fleetscope_run_tokens_per_second", f.tokens_per_s),
                                ("fleetscope_run_last_step_timestamp_seconds", f.last_ts)):
                    if v is not None:
                        series[name].append((lv, float(v)))
            series["fleetscope_run_steps"].append((lv, float(max(r.steps, f.steps if f is not None else 0))))
            last = f.last_ts if f is not None and f.last_ts is not None else _unix(r.started_at)
            if last is not None:
                series["fleetscope_run_seconds_since_last_step"].append((lv, max(0.0, now - last)))
            series["fleetscope_run_state_code"].append((lv, float(STATE_CODES.get(r.status, -1))))
            series["fleetscope_run_state"].append(((*lv, r.status), 1.0))
        # ended runs whose alerts fire: their state and alerts only (no stall gauge: they are not late)
        for r in ended_rows:
            lv = (r.name, r.model_family or "")
            if lv in by_labels:
                _add(by_labels[lv], alerts.get(r.id, {}))
                continue
            by_labels[lv] = dict(alerts.get(r.id, {}))
            series["fleetscope_run_state_code"].append((lv, float(STATE_CODES.get(r.status, -1))))
            series["fleetscope_run_state"].append(((*lv, r.status), 1.0))
        for lv, kinds in by_labels.items():
            for kind, n in sorted(kinds.items()):
                series["fleetscope_run_alerts_firing"].append(((*lv, kind), float(n)))
    out: dict[str, Any] = {}
    for name, doc in names.items():
        labels: tuple[str, ...] = ("run", "family")
        if name == "fleetscope_run_state":
            labels = (*labels, "state")
        elif name == "fleetscope_run_alerts_firing":
            labels = (*labels, "kind")
        out[name] = (doc, series[name], labels)
    return out


def _ended_runs_firing(engine: Any, cap: int) -> tuple[list[int], list[tuple[int, str, int]]]:
    """The ids of at most ``cap`` ended runs with a firing alert (paging kinds first, then the most
    recently active) and their firing alerts as (run id, kind, count)."""
    return alert_gauges.ended_runs_firing(engine, cap, LIVE_STATES, PAGING_KINDS)


def _add(into: dict[str, int], more: dict[str, int]) -> None:
    for kind, n in more.items():
        into[kind] = into.get(kind, 0) + n


def _unix(iso: str | None) -> float | None:
    if not iso:
        return None
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None
