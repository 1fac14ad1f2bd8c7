"""Prometheus metrics of the service itself (one registry per app, so tests can build many apps).

Two kinds of figures, under different names (docs/operations.md, "Prometheus"):

* **per instance** (``fleetscope_ingest_*``, ``fleetscope_compact*``, ``fleetscope_db_*``, the pool and
  queue gauges, ``process_*``, ``python_*``, ``fleetscope_build_info``): what this server process did
  or holds — summing them across instances is right;
* **cluster-wide** (``fleetscope_cluster_*`` and the per-run ``fleetscope_run_*`` gauges): read from the
  shared database, the same on every instance — aggregate them with ``max``, not ``sum``, or export
  them from one instance only (``--no-cluster-metrics`` on the others).

Gauges read at scrape time are collected in groups; a group whose reading fails (the database is
down) is left out of that scrape and counted in ``fleetscope_metrics_collection_errors_total``,
``fleetscope_db_up`` says 0, and every other family is still exported — the target stays up.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from fleetscope import __version__

__all__ = ["ServiceMetrics", "RUN_STATES", "REJECT_REASONS", "Group"]

log = logging.getLogger(__name__)

#: every run status, exported with a zero when no run has it (``fleetscope_cluster_runs``)
RUN_STATES = ("running", "stalled", "hung", "failed", "finished", "aborted")
#: the ``reason`` label of ``fleetscope_ingest_rejections_total`` / ``..._rejected_records_total``
REJECT_REASONS = ("auth", "auth_limited", "forbidden", "malformed", "invalid", "too_large", "unsupported",
                  "backlog", "queue_full", "writers_busy", "db_unavailable", "starting")

#: one group of scrape-time gauges: {name: (help, value, label names or None)}; value is a float, or
#: [(label values, float), ...] with label names
Group = Callable[[], dict[str, Any]]


class _Live(Collector):
    """Gauges read at scrape time, group by group; a failing group is left out and counted."""

    def __init__(self, groups: Callable[[], dict[str, Group]], errors: Counter) -> None:
        self._groups = groups
        self._errors = errors

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            groups = self._groups()
        except Exception:  # noqa: BLE001 - a scrape must not fail
            log.debug("metrics: no groups", exc_info=True)
            return
        for group, sample in groups.items():
            try:
                s = sample()
            except Exception as e:  # noqa: BLE001 - the database blinked: leave this group out, keep the rest
                log.debug("metrics: group %s failed: %s", group, type(e).__name__)
                self._errors.labels(group).inc()
                continue
            yield from _families(s)


def _families(s: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    for name, (doc, value, labels) in s.items():
        if labels:
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            for lv, v in value:
                g.add_metric([str(x) for x in lv], v)
        else:
            g = GaugeMetricFamily(name, doc, value=value)
        yield g


class _AlertSinks(Collector):
    """The notifier's per-sink counters and queue gauges, read at scrape time (never fails a scrape)."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, float]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        try:
            stats = self._stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail
            log.debug("metrics: no alert sink figures", exc_info=True)
            return
        done = CounterMetricFamily("fleetscope_alert_deliveries", "Alert deliveries by sink and outcome: sent, "
                                   "failed (after retries), dropped (the sink's queue was full)",
                                   labels=["sink", "outcome"])
        depth = GaugeMetricFamily("fleetscope_alert_queue_depth", "Alert events waiting in a sink's queue", labels=["sink"])
        backlog = GaugeMetricFamily("fleetscope_alert_backlog", "Deliveries due for a sink at its last scan of the "
                                    "alerts table", labels=["sink"])
        for sink, s in sorted(stats.items()):
            for outcome in ("sent", "failed", "dropped"):
                done.add_metric([sink, outcome], float(s.get(outcome, 0)))
            depth.add_metric([sink], float(s.get("queue", 0)))
            backlog.add_metric([sink], float(s.get("backlog", 0)))
        yield done
        yield depth
        yield backlog


class ServiceMetrics:
    """Ingest throughput, latency, rejections (batches and records), pool/queue depth, compaction (in
    this process or reported by worker processes), database reachability, build info, the process and
    platform collectors, and the scrape-time groups (cluster counts, per-run gauges)."""

    def __init__(self, groups: Callable[[], dict[str, Group]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.records = Counter("fleetscope_ingest_records_total", "Records accepted, by kind", ["kind"], registry=r)
        self.batches = Counter("fleetscope_ingest_batches_total", "Batches accepted", registry=r)
        self.batch_seconds = Histogram(
            "fleetscope_ingest_batch_seconds",
            "Time to validate and write one batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.rejections = Counter("fleetscope_ingest_rejections_total",
                                  "Requests (ingest batches, other writes) refused, by reason", ["reason"], registry=r)
        self.rejected_records = Counter(
            "fleetscope_ingest_rejected_records_total",
            "Records in refused ingest batches, by reason (counted where the batch was decoded)", ["reason"], registry=r)
        for reason in REJECT_REASONS:  # every reason present from the start (0), so rate() works at once
            self.rejections.labels(reason)
            self.rejected_records.labels(reason)
        self.compaction_seconds = Histogram(
            "fleetscope_compaction_seconds", "Duration of a compaction pass (this process or its compaction workers)",
            registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.compacted = Counter("fleetscope_compacted_records_total", "Records folded into step blocks", ["kind"], registry=r)
        for kind in ("rank_step", "collective"):
            self.compacted.labels(kind)
        self.duplicates = Counter("fleetscope_duplicate_records_total", "Re-sent records dropped as duplicates", registry=r)
        self.collection_errors = Counter(
            "fleetscope_metrics_collection_errors_total",
            "Scrape-time metric groups that could not be read (the group is left out of that scrape)", ["group"],
            registry=None)  # registered after the groups' collector: a failure shows in the same scrape
        for group in ("instance", "database", "cluster", "runs", "devices"):
            self.collection_errors.labels(group)
        build = Gauge("fleetscope_build_info", "fleetscope version and Python version (always 1)",
                      ["version", "python_version"], registry=r)
        build.labels(__version__, platform.python_version()).set(1)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        r.register(_Live(groups, self.collection_errors))
        r.register(self.collection_errors)

    def watch_alert_sinks(self, stats: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Export the notifier's per-sink figures (``Notifier.stats``) at scrape time: deliveries sent,
        failed (after retries) and dropped (queue full) as counters, the queue depth and the backlog due
        at its last scan of the alerts table as gauges (per instance)."""
        self.registry.register(_AlertSinks(stats))

    def reject(self, reason: str, records: int = 0) -> None:
        """Count one refused request (and the records it carried, when known)."""
        self.rejections.labels(reason).inc()
        if records:
            self.rejected_records.labels(reason).inc(records)

    def compaction_pass(self, seconds: float, rank_steps: int, collectives: int, duplicates: int) -> None:
        """Count one compaction pass that folded steps (in this process, or reported by a worker)."""
        self.compaction_seconds.observe(seconds)
        self.compacted.labels("rank_step").inc(rank_steps)
        self.compacted.labels("collective").inc(collectives)
        self.duplicates.inc(duplicates)
