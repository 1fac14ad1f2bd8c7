"""Device telemetry from outside the job: the server reads ``dcgm-exporter`` (each node's scrape URL, or
Prometheus' HTTP API holding its series) and joins each GPU to the ranks of running runs on that node that
send no device telemetry of their own (no agent window in the last ``AGENT_RECENT_S``) (docs/operations.md "GPU telemetry from dcgm-exporter").

- Sources: ``dcgm_targets`` (``node=url`` each, or ``@file`` with one per line: the node name is the one the
  job's ranks report — ``FLEETSCOPE_NODE``, else the host) scraped as the Prometheus text exposition format
  (``prometheus_client.parser``); or ``dcgm_prometheus_url``: one instant query for every DCGM series, the
  node taken from the ``dcgm_node_label`` label (default ``Hostname``; ``kubernetes_node`` / ``node`` under
  Kubernetes, where ``Hostname`` is the exporter pod's).
- Join: a rank's GPU on its node is the ``gpu`` label equal to its local rank (``ranks.local_rank``), else
  the rank's position among the run's ranks on that node in rank order — the assumption that local rank i
  drives GPU i (no remapping by ``CUDA_VISIBLE_DEVICES``). A node name matches exactly, else by its short
  host name (before the first dot).
- Windows: one ``run_devices`` row per (rank, pass window) with ``source = 'dcgm'`` (``store/dcgm.py``): an
  instant reading held for the window (``samples`` = 1, min = mean = max) — an estimate, coarser than the
  agent's per-second sampling; the throttle reasons set at the reading count as active for the whole window.
  ECC: the new double-bit (uncorrectable) errors since the previous reading; XID: the last XID code when it
  changed. PCIe / NVLink counters are not stored (``run_devices`` has no column for them).
- The pass (:class:`DcgmReader`): a background thread every ``dcgm_interval_s``, bounded (at most
  ``MAX_TARGETS`` targets scraped by ``SCRAPE_THREADS`` threads, each within ``dcgm_timeout_s``, the whole
  pass within its budget; at most ``MAX_RANKS`` ranks joined), on the connections of the background passes, its failures logged once a minute per cause. :meth:`DcgmReader.collect_once`
  is one pass in the calling thread.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

from .device_wire import THROTTLING, reason_mask
from .logutil import Throttle, log_throttled
from .store import dcgm as store

__all__ = ["GpuReading", "DcgmReader", "parse_exposition", "parse_prometheus_result", "parse_targets",
           "join_ranks", "window_rows", "FIELDS", "NVML_REASON_BITS", "MAX_TARGETS", "MAX_RANKS"]

log = logging.getLogger(__name__)

#: dcgm-exporter series read → the figure they give (units converted in :func:`window_rows`)
FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MEM_CLOCK": "mem_clock_mhz",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_FB_USED": "fb_used_mib",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "reasons",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe",
}
#: NVML clocksEventReasons bits (what DCGM_FI_DEV_CLOCKS_EVENT_REASONS holds) → the reason names of
#: ``device_wire.REASONS`` (as the agent names them: agent/fake_nvml.THROTTLE_REASONS)
NVML_REASON_BITS: dict[int, str] = {0x001: "idle", 0x002: "applications_clocks", 0x004: "power", 0x008: "hw_slowdown",
                                    0x010: "sync_boost", 0x020: "thermal", 0x040: "thermal", 0x080: "power_brake",
                                    0x100: "display_clocks"}
MAX_TARGETS = 4_096
MAX_RANKS = 100_000
SCRAPE_THREADS = 8
#: a rank with agent telemetry this recent (a window's start) is left to the agent
AGENT_RECENT_S = 3600.0
MAX_PAGE_BYTES = 8 * 1024 * 1024


@dataclass
class GpuReading:
    """One GPU's figures at one reading: ``values`` {figure: value} (``FIELDS``' names)."""

    node: str
    gpu: int | None
    uuid: str | None = None
    values: dict[str, float] = field(default_factory=dict)


def _gpu_index(labels: dict[str, str]) -> int | None:
    v = labels.get("gpu")
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _add(out: dict[tuple[str, int | None, str | None], GpuReading], name: str, labels: dict[str, str], value: float,
         node: str | None, node_label: str) -> None:
    fig = FIELDS.get(name)
    if fig is None or value != value:  # NaN: no reading
        return
    n = node or labels.get(node_label) or labels.get("Hostname")
    if not n:
        return
    gpu, uuid = _gpu_index(labels), labels.get("UUID") or labels.get("uuid")
    key = (n, gpu, uuid)
    r = out.get(key)
    if r is None:
        r = out[key] = GpuReading(n, gpu, uuid)
    r.values[fig] = float(value)


def parse_exposition(page: str, *, node: str | None = None, node_label: str = "Hostname") -> list[GpuReading]:
    """The GPUs of one dcgm-exporter page (Prometheus text format). ``node``: the node it was scraped from
    (overrides the labels); else the ``node_label`` label, else ``Hostname``. Unknown series are ignored;
    a malformed page raises ``ValueError``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, int | None, str | None], GpuReading] = {}
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            _add(out, s.name, dict(s.labels), float(s.value), node, node_label)
    return list(out.values())


def parse_prometheus_result(doc: Any, *, node_label: str = "Hostname") -> list[GpuReading]:
    """The GPUs of a Prometheus instant-query answer (``{"status": "success", "data": {"resultType": "vector",
    "result": [{"metric": {...}, "value": [ts, "v"]}]}}``); raises ``ValueError`` for anything else."""
    if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
        raise ValueError(f"not a successful Prometheus answer: {str(doc)[:120]}")
    out: dict[tuple[str, int | None, str | None], GpuReading] = {}
    for item in doc["data"].get("result") or []:
        labels = {str(k): str(v) for k, v in (item.get("metric") or {}).items()}
        try:
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        _add(out, labels.get("__name__", ""), labels, value, None, node_label)
    return list(out.values())


def parse_targets(values: Iterable[str]) -> list[tuple[str, str]]:
    """``node=url`` entries (``@path``: a file of them, one per line, ``#`` comments) → [(node, url)]; a
    ``ValueError`` naming a bad entry."""
    out: list[tuple[str, str]] = []
    for v in values:
        v = v.strip()
        if not v:
            continue
        if v.startswith("@"):
            lines = Path(v[1:]).read_text().splitlines()
            out += parse_targets(ln.split("#", 1)[0] for ln in lines)
            continue
        node, sep, url = v.partition("=")
        if not sep or not node.strip() or not re.match(r"^https?://", url.strip()):
            raise ValueError(f"dcgm_targets: {v[:120]!r} is not NODE=URL (e.g. node0001=http://node0001:9400/metrics)")
        out.append((node.strip(), url.strip()))
    if len(out) > MAX_TARGETS:
        raise ValueError(f"dcgm_targets: {len(out)} targets, more than {MAX_TARGETS}; use dcgm_prometheus_url")
    return out


def _short(node: str) -> str:
    return node.split(".", 1)[0]


def join_ranks(readings: Sequence[GpuReading],
               ranks: Sequence[tuple[int, int, str, int | None]]) -> list[tuple[int, int, GpuReading]]:
    """(run id, rank, its GPU's reading) for each rank whose node and GPU were read. A rank's GPU is the one
    whose index is its local rank, else its position among the run's ranks on that node (in rank order)."""
    by_node: dict[str, dict[int, GpuReading]] = {}
    for r in readings:
        if r.gpu is not None:
            by_node.setdefault(r.node, {})[r.gpu] = r
    short: dict[str, str] = {}
    for n in by_node:
        short.setdefault(_short(n), n)
    placed: dict[tuple[int, str], list[tuple[int, int | None]]] = {}
    for run_id, rank, node, local in ranks:
        placed.setdefault((run_id, node), []).append((rank, local))
    out: list[tuple[int, int, GpuReading]] = []
    for (run_id, node), rs in placed.items():
        gpus = by_node.get(node) or by_node.get(short.get(_short(node), ""))
        if not gpus:
            continue
        rs.sort()
        locals_ = [lr for _, lr in rs]
        use_local = all(lr is not None for lr in locals_) and len(set(locals_)) == len(locals_)
        for i, (rank, local) in enumerate(rs):
            g = gpus.get(int(local) if use_local and local is not None else i)
            if g is not None:
                out.append((run_id, rank, g))
    return out


def window_rows(joined: Sequence[tuple[int, int, GpuReading]], *, t_ms: int, window_s: float,
                ecc_new: Callable[[GpuReading], int | None] = lambda g: None,
                xid_new: Callable[[GpuReading], list[int]] = lambda g: []) -> dict[int, list[dict[str, Any]]]:
    """{run id: [``run_devices`` window row]} of these joined readings (``store.dcgm.WINDOW_COLUMNS``)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for run_id, rank, g in joined:
        v = g.values
        mask = int(v.get("reasons", 0) or 0)
        names = sorted({n for bit, n in NVML_REASON_BITS.items() if mask & bit})
        slowed = any(n in THROTTLING for n in names)
        util = v.get("util_pct")
        mem = v.get("fb_used_mib")
        out.setdefault(run_id, []).append({
            "rank": rank, "t_ms": t_ms, "window_s": float(window_s), "samples": 1,
            "sm_clock_min": v.get("sm_clock_mhz"), "sm_clock_mean": v.get("sm_clock_mhz"),
            "sm_clock_max": v.get("sm_clock_mhz"), "mem_clock_mean": v.get("mem_clock_mhz"),
            "power_mean": v.get("power_w"), "power_max": v.get("power_w"), "power_limit": v.get("power_limit_w"),
            "temp_mean": v.get("temp_c"), "temp_max": v.get("temp_c"),
            "util_mean": None if util is None else max(0.0, min(1.0, util / 100.0)),
            "mem_used_max": None if mem is None else int(mem * 1024 * 1024),
            "throttle": reason_mask(names), "throttled_s": float(window_s) if slowed else 0.0,
            "throttle_s": {n: float(window_s) for n in names} or None,
            "ecc_errors": ecc_new(g), "xid": xid_new(g) or None,
        })
    return out


class DcgmReader:
    """The periodic pass reading dcgm-exporter (see the module doc). Never raises into the server."""

    def __init__(self, engine: Engine, *, targets: Sequence[tuple[str, str]] = (), prometheus_url: str | None = None,
                 node_label: str = "Hostname", interval_s: float = 30.0, timeout_s: float = 5.0,
                 budget_s: float | None = None, max_ranks: int = MAX_RANKS, log_interval_s: float = 60.0) -> None:
        self.engine = engine
        self.targets = list(targets)[:MAX_TARGETS]
        self.prometheus_url = prometheus_url.rstrip("/") if prometheus_url else None
        self.node_label = node_label
        self.interval_s = max(float(interval_s), 1.0)
        self.timeout_s = float(timeout_s)
        self.budget_s = float(budget_s) if budget_s is not None else max(self.interval_s * 0.8, self.timeout_s)
        self.max_ranks = max_ranks
        self._throttle = Throttle(log_interval_s)
        self._ecc: dict[tuple[str, int | None], float] = {}
        self._xid: dict[tuple[str, int | None], float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.errors = 0
        self.last: dict[str, Any] = {}

    @classmethod
    def from_settings(cls, engine: Engine, settings: Any) -> DcgmReader | None:
        """The reader the settings ask for (``dcgm_targets`` / ``dcgm_prometheus_url``), else None."""
        targets = parse_targets(settings.dcgm_targets or [])
        if not targets and not settings.dcgm_prometheus_url:
            return None
        return cls(engine, targets=targets, prometheus_url=settings.dcgm_prometheus_url,
                   node_label=settings.dcgm_node_label, interval_s=settings.dcgm_interval_s,
                   timeout_s=settings.dcgm_timeout_s)

    # ------------------------------------------------------------------------------------------- reading

    def _scrape(self, client: httpx.Client, node: str, url: str) -> list[GpuReading]:
        with client.stream("GET", url) as r:
            r.raise_for_status()
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_PAGE_BYTES:
                    raise ValueError(f"the page of {url} is larger than {MAX_PAGE_BYTES} bytes")
        return parse_exposition(body.decode("utf-8", "replace"), node=node, node_label=self.node_label)

    def read(self) -> tuple[list[GpuReading], list[str]]:
        """Every GPU read this pass, and what failed (one line per target)."""
        readings: list[GpuReading] = []
        errors: list[str] = []
        t_end = time.monotonic() + self.budget_s
        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            if self.prometheus_url:
                query = '{__name__=~"' + "|".join(FIELDS) + '"}'
                try:
                    r = client.get(f"{self.prometheus_url}/api/v1/query", params={"query": query})
                    r.raise_for_status()
                    readings += parse_prometheus_result(r.json(), node_label=self.node_label)
                except (httpx.HTTPError, ValueError) as e:
                    errors.append(f"prometheus {self.prometheus_url}: {type(e).__name__}: {str(e)[:200]}")
            if self.targets:
                pool = ThreadPoolExecutor(max_workers=min(SCRAPE_THREADS, len(self.targets)),
                                          thread_name_prefix="fleetscope-dcgm")
                futs = {pool.submit(self._scrape, client, n, u): (n, u) for n, u in self.targets}
                try:
                    for f in as_completed(futs, timeout=max(t_end - time.monotonic(), 0.1)):
                        n, u = futs[f]
                        try:
                            readings += f.result()
                        except Exception as e:  # noqa: BLE001 - one bad node never stops the others
                            errors.append(f"{n} {u}: {type(e).__name__}: {str(e)[:200]}")
                except FuturesTimeout:
                    errors.append(f"{sum(not f.done() for f in futs)} targets not read within the pass budget "
                                  f"({self.budget_s:g} s)")
                finally:
                    pool.shutdown(wait=False, cancel_futures=True)
        return readings, errors

    def _ecc_new(self, g: GpuReading) -> int | None:
        v = g.values.get("ecc_dbe")
        if v is None:
            return None
        key = (g.node, g.gpu)
        prev = self._ecc.get(key)
        self._ecc[key] = v
        return None if prev is None else max(int(v - prev), 0)

    def _xid_new(self, g: GpuReading) -> list[int]:
        v = g.values.get("xid")
        if v is None:
            return []
        key = (g.node, g.gpu)
        prev = self._xid.get(key)
        self._xid[key] = v
        return [int(v)] if v > 0 and v != prev else []

    # --------------------------------------------------------------------------------------------- pass

    def collect_once(self, now: float | None = None) -> dict[str, Any]:
        """One pass in the calling thread: the ranks to fill, the readings, the join, the rows stored.
        Returns ``{"ranks", "gpus", "joined", "stored", "errors"}``."""
        now = time.time() if now is None else float(now)
        t_ms = int(now // self.interval_s * self.interval_s * 1000)
        ranks = store.ranks_without_agent_telemetry(self.engine, max_ranks=self.max_ranks,
                                                    since_ms=int((now - max(AGENT_RECENT_S, 10 * self.interval_s)) * 1000))
        out: dict[str, Any] = {"ranks": len(ranks), "gpus": 0, "joined": 0, "stored": 0, "errors": []}
        if ranks:
            readings, errors = self.read()
            joined = join_ranks(readings, ranks)
            rows = window_rows(joined, t_ms=t_ms, window_s=self.interval_s, ecc_new=self._ecc_new,
                               xid_new=self._xid_new)
            out.update(gpus=len(readings), joined=len(joined), errors=errors,
                       stored=store.land_dcgm_windows(self.engine, rows))
            for e in errors:
                log_throttled(log, logging.WARNING, f"dcgm:{e.split(':', 1)[0][:120]}", "dcgm reader: %s", e,
                              throttle=self._throttle)
        self.passes += 1
        self.last = out
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetscope-dcgm", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.collect_once()
            except Exception as e:  # noqa: BLE001 - the pass must never take the server down
                self.errors += 1
                log_throttled(log, logging.WARNING, f"dcgm:pass:{type(e).__name__}", "dcgm reader: pass failed: %s",
                              str(e).splitlines()[0][:200] if str(e) else type(e).__name__, exc_info=True,
                              throttle=self._throttle)
