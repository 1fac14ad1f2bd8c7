"""Prometheus metrics of the service itself (one registry per app, so tests can build many apps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServiceMetrics"]


class _Live(Collector):
    def __init__(self, sample: Callable[[], dict[str, Any]]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            s = self._sample()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the DB blinked
            return
        for name, (doc, value, labels) in s.items():
            if labels:
                g = GaugeMetricFamily(name, doc, labels=list(labels))
                for lv, v in value:
                    g.add_metric(list(lv), v)
            else:
                g = GaugeMetricFamily(name, doc, value=value)
            yield g


class ServiceMetrics:
    """Ingest throughput, latency, rejections, pool/queue depth, compaction, live fleet gauges."""

    def __init__(self, sample: Callable[[], dict[str, Any]]) -> None:
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
        self.rejections = Counter("fleetscope_ingest_rejections_total", "Batches refused, by reason", ["reason"], registry=r)
        self.compaction_seconds = Histogram(
            "fleetscope_compaction_seconds", "Duration of a compaction pass", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.compacted = Counter("fleetscope_compacted_records_total", "Records folded into step blocks", ["kind"], registry=r)
        self.duplicates = Counter("fleetscope_duplicate_records_total", "Re-sent records dropped as duplicates", registry=r)
        r.register(_Live(sample))
