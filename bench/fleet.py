"""The fleet soak (issues #13, #22): R ranks at 1 step/s, 4 collectives per rank-step, for D seconds,
through ``fleetscope simulate --realtime`` (one sender process per run of ``--ranks-per-run`` ranks)
into a real ``fleetscope serve`` on a real Postgres — bounded, loopback only.

    python bench/fleet.py [--ranks 4096] [--duration 600] [--ranks-per-run 1024]
                          [--compaction-workers 0] [--sample-s 5] [--backends plain,citus]

``--backends`` runs the same soak once per backend, one after the other, in the same invocation:
``plain`` is embedded Postgres (or ``--database-url``); ``citus`` is a coordinator and
``--citus-workers`` workers on loopback (Citus built from ../shared/vendor by tests/citus/cluster.py,
as bench/citus.py does), the schema laid out by ``fleetscope db upgrade`` + ``fleetscope db
distribute`` and ``fleetscope serve --database-url`` pointed at the coordinator. Each backend is torn
down (server, senders, every postgres) before the next starts, failing or not.

Measured while it runs:

* ingest latency seen by a client: a probe posts a small batch (8 rank-steps + 32 collectives) to
  its own run every second and times the round trip — p50 / p99;
* the server's own batch time (``fleetscope_ingest_batch_seconds`` histogram over the soak);
* compaction backlog (``fleetscope_compaction_backlog_rows``) every ``--sample-s``: its slope over the
  second half of the soak (rows/s; ≤ 0 means compaction keeps up) and its maximum;
* server RSS (the serve process and its children) — first, max, last;
* Postgres database size growth, in bytes per hour;
* the dashboard's fleet and run pages while it runs: ``GET /`` (fleet page HTML), the fleet data
  (``/api/v1/runs``), a run summary — p50 / p99 over samples every 10 s;

then that every rank-step sent was stored exactly once (runs' ``rank_steps`` = ranks × steps), and
the database's growth on each node per rank-step stored (on Citus: the coordinator, and each worker
both per fleet rank-step and per rank-step of the runs whose shards it holds).
Prints ``<backend>_<name>: value unit`` lines per backend, then a side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

FS = [sys.executable, "-m", "fleetscope.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def _histogram(text: str, name: str) -> dict[float, float]:
    out = {}
    for le, v in re.findall(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} ([0-9.e+]+)$', text, re.M):
        out[float("inf") if le == "+Inf" else float(le)] = float(v)
    return out


def _hist_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan")
    for le, c in zip(les, counts, strict=True):
        if c >= q * total:
            return le
    return les[-1]


def _rss(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except psutil.Error:
        return 0


def _cpu(pid: int) -> float:
    """CPU seconds of a process and all its children: the ones it has reaped (a postmaster's exited
    backends) and the live ones."""
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for c in p.children(recursive=True):
            try:
                ct = c.cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return float("nan")


def _one(conn: Any, sql: str) -> Any:
    """The first column of the one row ``sql`` returns."""
    row = conn.execute(sql).fetchone()
    assert row is not None, sql
    return row[0]


def _postmaster(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


def _slope(ts: list[float], ys: list[float]) -> float:
    n = len(ts)
    if n < 2:
        return float("nan")
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den if den else float("nan")


class Probe(threading.Thread):
    """Posts a small batch every second and times it; samples the pages every 10 s."""

    def __init__(self, url: str, token: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, stop
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.ingest_s: list[float] = []
        self.pages: dict[str, list[float]] = {"fleet_page": [], "fleet_data": [], "run_summary": []}
        self.errors = 0

    def run(self) -> None:
        from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows
        from fleetscope.wire import COLLECTIVE_FIELDS, RANK_STEP_FIELDS, columns_from_rows, encode_batch

        spec = RunSpec(name="soak-probe", family="vla-7b", world_size=8, steps=100_000)
        rid = self.http.post("/api/v1/runs", json=spec.run_info()).json()["id"]
        gen = rank_step_rows(spec)
        last_pages = 0.0
        while not self.stop.wait(1.0):
            step, rows = next(gen)
            batch = {"v": 1, "run_id": rid, "rank_steps": columns_from_rows(rows, RANK_STEP_FIELDS),
                     "collectives": columns_from_rows(collective_rows(spec, step, rows), COLLECTIVE_FIELDS)}
            body, headers = encode_batch(batch)
            t0 = time.perf_counter()
            try:
                r = self.http.post("/api/v1/ingest", content=body, headers=headers)
                if r.status_code == 200:
                    self.ingest_s.append(time.perf_counter() - t0)
                else:
                    self.errors += 1
            except httpx.HTTPError:
                self.errors += 1
            if time.monotonic() - last_pages >= 10:
                last_pages = time.monotonic()
                for key, path in (("fleet_page", "/"), ("fleet_data", "/api/v1/runs?limit=200"),
                                  ("run_summary", f"/api/v1/runs/{rid}/summary")):
                    t0 = time.perf_counter()
                    try:
                        if self.http.get(path).status_code == 200:
                            self.pages[key].append(time.perf_counter() - t0)
                    except httpx.HTTPError:
                        self.errors += 1


ROOT = Path(__file__).resolve().parents[1]

#: a per-run table's total size (heap + indexes + TOAST), per table, on plain Postgres
_PER_RUN_TABLES_PG = """
SELECT c.relname::text, pg_total_relation_size(c.oid) FROM pg_class c
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'run_id' AND a.attnotnull AND NOT a.attisdropped
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
"""
#: the same on Citus, per node holding shards (read on the coordinator)
_PER_RUN_TABLES_CITUS = """
SELECT nodeport, table_name::text, sum(shard_size) FROM citus_shards
WHERE citus_table_type = 'distributed' GROUP BY 1, 2
"""
#: the fragment queue: rows wait there until compacted, then are deleted (space reused after vacuum)
QUEUE = "ingest_fragments"


class Backend:
    """A database for one soak: the URL the server uses, and the same database on every node."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = ""
        self.nodes: dict[str, str] = {}  # node label -> libpq URL of the soak's database there
        self.ports: dict[int, str] = {}  # Citus: node port -> label
        self.setup_s = 0.0
        self._pg: Any = None  # EmbeddedPostgres
        self._cluster: Any = None  # tests/citus/cluster.py's CitusCluster

    def start(self, args: argparse.Namespace, tmp: Path) -> None:
        from fleetscope.server.db import EmbeddedPostgres, libpq_url

        t0 = time.monotonic()
        if self.name == "plain":
            if args.database_url:
                self.url = args.database_url
            else:
                self._pg = EmbeddedPostgres(tmp / "data")
                self.url = self._pg.start()
            subprocess.run([*FS, "db", "upgrade", "--database-url", self.url], check=True, capture_output=True)
            self.nodes = {"single": libpq_url(self.url)}
        elif self.name == "citus":
            sys.path.insert(0, str(ROOT / "tests" / "citus"))
            from cluster import CitusCluster  # noqa: PLC0415  (builds Citus from ../shared/vendor once)

            self._cluster = CitusCluster.start(workers=args.citus_workers, shard_count=args.shard_count)
            self.url = self._cluster.create_database("fleetscope")
            for cmd in ("upgrade", "distribute"):
                r = subprocess.run([*FS, "db", cmd, "--database-url", self.url], capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"fleetscope db {cmd} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            self.nodes = {n.name: n.url("fleetscope") for n in self._cluster.nodes}
            self.ports = {n.port: n.name for n in self._cluster.nodes}
        else:
            raise SystemExit(f"unknown backend {self.name!r} (plain, citus)")
        self.setup_s = time.monotonic() - t0

    def stop(self) -> None:
        try:
            if self._cluster is not None:
                self._cluster.stop()
        finally:
            if self._pg is not None:
                self._pg.stop()

    def cpu(self) -> dict[str, float]:
        """Per node: CPU seconds its PostgreSQL has used so far (postmaster and backends, alive or
        exited); empty for ``--database-url`` (not on this machine)."""
        dirs: dict[str, Path] = {}
        if self._pg is not None:
            dirs["single"] = self._pg.pgdata
        if self._cluster is not None:
            dirs = {n.name: n.pgdata for n in self._cluster.nodes}
        return {label: _cpu(_postmaster(d)) for label, d in dirs.items()}

    # -- sizes -----------------------------------------------------------------------------------
    def db_sizes(self) -> dict[str, int]:
        import psycopg

        out = {}
        for label, u in self.nodes.items():
            with psycopg.connect(u, autocommit=True) as c:
                out[label] = int(_one(c, "SELECT pg_database_size(current_database())"))
        return out

    def relation_sizes(self) -> dict[str, dict[str, int]]:
        """Per node: every relation of the database (catalogs included) -> bytes (``--verbose``)."""
        import psycopg

        out = {}
        for label, u in self.nodes.items():
            with psycopg.connect(u, autocommit=True) as c:
                out[label] = {f"{n}.{r}": int(b) for n, r, b in c.execute(
                    "SELECT nspname::text, relname::text, pg_relation_size(c.oid) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE relkind IN ('r', 'i', 't', 'm')")}
        return out

    def table_sizes(self) -> dict[str, dict[str, int]]:
        """Per node: per-run table -> bytes (on Citus, the node's shards of it)."""
        import psycopg

        out: dict[str, dict[str, int]] = {}
        if self.name == "plain":
            with psycopg.connect(self.nodes["single"], autocommit=True) as c:
                out["single"] = {t: int(b) for t, b in c.execute(_PER_RUN_TABLES_PG)}
        else:
            with psycopg.connect(self.url, autocommit=True) as c:
                for port, t, b in c.execute(_PER_RUN_TABLES_CITUS):
                    out.setdefault(self.ports.get(port, str(port)), {})[t] = int(b)
        return out

    def placement(self, run_ids: list[int]) -> dict[int, str]:
        """Citus: the node holding each run's shards (all per-run tables are co-located)."""
        if self.name != "citus":
            return {}
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as c:
            table = _one(c, "SELECT logicalrelid::regclass::text FROM pg_dist_partition WHERE partmethod = 'h' "
                            "ORDER BY 1 LIMIT 1")
            out = {}
            for rid in run_ids:
                port = c.execute("SELECT nodeport FROM citus_shards WHERE shardid = "
                                 "get_shard_id_for_distribution_column(%s, %s::bigint) LIMIT 1", (table, rid)).fetchone()
                out[rid] = self.ports.get(port[0], str(port[0])) if port else "?"
        return out


def soak(backend: Backend, args: argparse.Namespace, tmp: Path) -> dict:
    """One soak against ``backend`` (started); every process it starts is stopped before it returns."""
    url_db = backend.url
    procs: list[subprocess.Popen] = []
    try:
        token = subprocess.run([*FS, "token", "create", "--name", f"soak-{os.getpid()}", "--database-url", url_db],
                               check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        port = _port()
        url = f"http://127.0.0.1:{port}"
        log = open(tmp / "serve.log", "w")  # noqa: SIM115
        env = {**os.environ, "FLEETSCOPE_ALERTS_ENABLED": "false"}
        server = subprocess.Popen([*FS, "serve", "--port", str(port), "--database-url", url_db,
                                   "--compaction-workers", str(args.compaction_workers)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(server)
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start: " + (tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.2)

        size0, tables0 = backend.db_sizes(), backend.table_sizes()
        rels0 = backend.relation_sizes() if args.verbose else {}
        m0 = httpx.get(f"{url}/metrics", timeout=10).text
        cpu0, serve_cpu0, tc0 = backend.cpu(), _cpu(server.pid), time.monotonic()
        runs = math.ceil(args.ranks / args.ranks_per_run)
        senders = []
        for i in range(runs):
            n = min(args.ranks_per_run, args.ranks - i * args.ranks_per_run)
            senders.append(subprocess.Popen(
                [*FS, "simulate", "--server", url, "--token", token, "--run", f"soak-{i}", "--family", "vla-7b",
                 "--ranks", str(n), "--steps", str(args.duration), "--step-ms", "1000", "--realtime",
                 "--seed", str(i)],
                stdout=subprocess.DEVNULL, stderr=open(tmp / f"sender-{i}.log", "w"),  # noqa: SIM115
                env={**os.environ, "FLEETSCOPE_SPOOL_DIR": str(tmp / f"spool-{i}")}))
        procs.extend(senders)
        stop = threading.Event()
        probe = Probe(url, token, stop)
        probe.start()
        t0 = time.monotonic()
        load0 = os.getloadavg()
        samples: list[tuple[float, float, int]] = []  # (t, backlog rows, server rss)
        while any(s.poll() is None for s in senders):
            time.sleep(args.sample_s)
            try:
                m = httpx.get(f"{url}/metrics", timeout=30).text
                samples.append((time.monotonic() - t0, _metric(m, "fleetscope_compaction_backlog_rows"),
                                _rss(server.pid)))
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > args.duration * 3 + 300:
                raise SystemExit("senders did not finish in 3x the duration: the server does not keep up")
        wall = time.monotonic() - t0
        load1 = os.getloadavg()
        stop.set()
        probe.join(30)
        bad = [i for i, s in enumerate(senders) if s.returncode != 0]
        m1 = httpx.get(f"{url}/metrics", timeout=30).text
        # let compaction finish, then check every rank-step landed once
        deadline = time.monotonic() + args.drain_timeout
        want = {f"soak-{i}": min(args.ranks_per_run, args.ranks - i * args.ranks_per_run) * args.duration
                for i in range(runs)}
        while True:
            listed = httpx.get(f"{url}/api/v1/runs", params={"limit": 1000}, timeout=30).json()["runs"]
            got = {r["name"]: r["rank_steps"] for r in listed}
            if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
                break
            time.sleep(2)
        drain_s = time.monotonic() - t0 - wall
        cpu1, serve_cpu1, tc1 = backend.cpu(), _cpu(server.pid), time.monotonic()
        size1, tables1 = backend.db_sizes(), backend.table_sizes()
        if args.verbose:  # where each node's bytes went: the relations that grew most
            for label, rels in backend.relation_sizes().items():
                grew = sorted(((b - rels0.get(label, {}).get(k, 0), k) for k, b in rels.items()), reverse=True)[:6]
                print(f"{backend.name} {label} grew: " + ", ".join(f"{k} {d / 2**20:.1f} MiB" for d, k in grew if d),
                      flush=True)
        ids = {r["name"]: r["id"] for r in listed}
        place = backend.placement(list(ids.values()))
        half = [s for s in samples if s[0] >= wall / 2]
        stored = sum(int(r["rank_steps"] or 0) for r in listed)  # the probe's run included
        held: dict[str, int] = {}
        for r in listed:
            held[place.get(r["id"], "single")] = held.get(place.get(r["id"], "single"), 0) + int(r["rank_steps"] or 0)
        nodes = {}
        for label in backend.nodes:
            data = sum(tables1.get(label, {}).values()) - sum(tables0.get(label, {}).values())
            queue = tables1.get(label, {}).get(QUEUE, 0) - tables0.get(label, {}).get(QUEUE, 0)
            nodes[label] = {"db_growth": size1[label] - size0[label], "per_run_growth": data - queue,
                            "queue_growth": queue, "held_rank_steps": held.get(label, 0),
                            "cpu_s": cpu1.get(label, float("nan")) - cpu0.get(label, float("nan")),
                            "runs": sorted(n for n, rid in ids.items() if place.get(rid) == label)}
        hist0 = _histogram(m0, "fleetscope_ingest_batch_seconds")
        hist1 = _histogram(m1, "fleetscope_ingest_batch_seconds")
        if args.verbose:
            print(json.dumps({"backend": backend.name, "samples": samples[-5:], "sender_failures": bad, "got": got},
                             default=str)[:2000], flush=True)
        return {
            "setup_s": backend.setup_s, "load": (load0, load1), "wall": wall, "drain": drain_s,
            "rate": sum(want.values()) / wall, "exact": all(got.get(k) == v for k, v in want.items()),
            "sent": sum(want.values()), "stored_soak": sum(int(got.get(k) or 0) for k in want), "stored": stored,
            "sender_failures": bad,
            "ingest_p50": _pct(probe.ingest_s, 0.5), "ingest_p99": _pct(probe.ingest_s, 0.99),
            "ingest_n": len(probe.ingest_s),
            "batch_p50": _hist_quantile(hist0, hist1, 0.5), "batch_p99": _hist_quantile(hist0, hist1, 0.99),
            "slope": _slope([s[0] for s in half], [s[1] for s in half]),
            "backlog_max": max((s[1] for s in samples), default=float("nan")),
            "rss": [s[2] for s in samples if s[2]],
            "db_growth_gib_h": sum(size1[k] - size0[k] for k in size1) / wall * 3600 / 2**30,
            "pages": {k: (_pct(xs, 0.5), _pct(xs, 0.99), len(xs)) for k, xs in probe.pages.items()},
            "probe_errors": probe.errors, "nodes": nodes,
            "cpu_window_s": tc1 - tc0, "serve_cpu_s": serve_cpu1 - serve_cpu0,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def report(name: str, r: dict) -> None:
    ms = 1e3
    print(f"{name}_setup_s: {r['setup_s']:.1f} s (database up, migrated{', distributed' if name == 'citus' else ''})")
    print(f"{name}_load: {r['load'][0][0]:.2f} at start, {r['load'][1][0]:.2f} at end (1-min load average)")
    print(f"{name}_soak_duration_s: wall {r['wall']:.0f} s, drain after {r['drain']:.0f} s")
    print(f"{name}_soak_rank_steps_per_s: {r['rate']:.0f} rank-steps/s")
    print(f"{name}_soak_stored_exactly: {r['exact']} ({r['stored_soak']:,} of {r['sent']:,} rank-steps; "
          f"sender failures {r['sender_failures'] or 'none'})")
    print(f"{name}_soak_ingest_latency_p50: {r['ingest_p50'] * ms:.1f} ms (probe round trip, {r['ingest_n']} samples)")
    print(f"{name}_soak_ingest_latency_p99: {r['ingest_p99'] * ms:.1f} ms (probe round trip)")
    print(f"{name}_soak_server_batch_p50: {r['batch_p50'] * ms:.0f} ms (histogram bucket bound)")
    print(f"{name}_soak_server_batch_p99: {r['batch_p99'] * ms:.0f} ms (histogram bucket bound)")
    print(f"{name}_soak_backlog_slope: {r['slope']:.1f} rows/s (second half)")
    print(f"{name}_soak_backlog_max: {r['backlog_max']:.0f} rows")
    if r["rss"]:
        rss = r["rss"]
        print(f"{name}_soak_server_rss_mib: first {rss[0] / 2**20:.0f}, max {max(rss) / 2**20:.0f}, "
              f"last {rss[-1] / 2**20:.0f} MiB")
    print(f"{name}_soak_db_growth: {r['db_growth_gib_h']:.2f} GiB/hour (all nodes)")
    for k, (p50, p99, n) in r["pages"].items():
        print(f"{name}_soak_{k}_p50: {p50 * ms:.0f} ms, p99 {p99 * ms:.0f} ms ({n} samples)")
    print(f"{name}_soak_probe_errors: {r['probe_errors']}")
    win = r["cpu_window_s"]
    print(f"{name}_cpu_serve: {r['serve_cpu_s'] / r['stored'] * 1e6:.0f} µs per rank-step "
          f"({100 * r['serve_cpu_s'] / win:.0f}% of one core over {win:.0f} s; the serve process, compaction included)")
    for label, nd in r["nodes"].items():
        if nd["cpu_s"] == nd["cpu_s"]:  # not NaN
            print(f"{name}_cpu_{label}: {nd['cpu_s'] / r['stored'] * 1e6:.0f} µs per fleet rank-step "
                  f"({100 * nd['cpu_s'] / win:.0f}% of one core over {win:.0f} s; its PostgreSQL processes)"
                  + (f", {nd['cpu_s'] / nd['held_rank_steps'] * 1e6:.0f} µs per rank-step it holds"
                     if name == "citus" and nd["held_rank_steps"] else ""))
    for label, nd in r["nodes"].items():
        held = (f", {nd['per_run_growth'] / nd['held_rank_steps']:.0f} B per rank-step it holds "
                f"({nd['held_rank_steps']:,} rank-steps, runs {','.join(nd['runs'])})"
                if name == "citus" and nd["held_rank_steps"] else "")
        print(f"{name}_bytes_per_rank_step_{label}: database {nd['db_growth'] / r['stored']:.0f} B, "
              f"per-run tables without the queue {nd['per_run_growth'] / r['stored']:.0f} B, "
              f"queue {nd['queue_growth'] / r['stored']:.0f} B per fleet rank-step{held}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--duration", type=int, default=600, help="seconds (= steps at 1 step/s)")
    ap.add_argument("--ranks-per-run", type=int, default=1024)
    ap.add_argument("--compaction-workers", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--backends", default="plain", help="comma-separated, run in order: plain, citus")
    ap.add_argument("--database-url", default=None, help="plain backend: a Postgres URL (default: embedded, in a temp dir)")
    ap.add_argument("--citus-workers", type=int, default=2)
    ap.add_argument("--shard-count", type=int, default=32, help="shards per distributed table (Citus' default)")
    ap.add_argument("--drain-timeout", type=float, default=300, help="seconds to wait for compaction after the soak")
    ap.add_argument("--verbose", action="store_true", help="print the last samples and the runs' counts")
    args = ap.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    import signal

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # the finally blocks stop what was started

    signal.signal(signal.SIGTERM, _interrupt)
    t_all = time.monotonic()
    print(f"{args.ranks} ranks x {args.duration} s per backend ({', '.join(backends)}); "
          f"load before: {os.getloadavg()}", flush=True)
    results: dict[str, dict] = {}
    for name in backends:
        tmp = Path(tempfile.mkdtemp(prefix=f"fs-fleet-{name}-"))
        backend = Backend(name)
        try:
            backend.start(args, tmp)
            results[name] = soak(backend, args, tmp)
        finally:
            backend.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        report(name, results[name])
        sys.stdout.flush()
    print(f"total_wall_s: {time.monotonic() - t_all:.0f} s; load after: {os.getloadavg()}")
    if len(results) > 1:
        def row(label: str, f) -> None:  # noqa: ANN001
            print(f"| {label} | " + " | ".join(f(r) for r in results.values()) + " |")

        print("\n| figure | " + " | ".join(results) + " |")
        print("|---|" + "---|" * len(results))
        row("rank-steps/s sustained", lambda r: f"{r['rate']:.0f}")
        row("stored exactly once", lambda r: f"{r['stored_soak']:,} of {r['sent']:,} ({r['exact']})")
        row("ingest p50 / p99 ms", lambda r: f"{r['ingest_p50'] * 1e3:.1f} / {r['ingest_p99'] * 1e3:.1f}")
        row("server batch p50 / p99 ms (bucket)", lambda r: f"≤ {r['batch_p50'] * 1e3:.0f} / ≤ {r['batch_p99'] * 1e3:.0f}")
        row("backlog slope rows/s, max rows", lambda r: f"{r['slope']:+.1f}, {r['backlog_max']:.0f}")
        for k in ("fleet_page", "fleet_data", "run_summary"):
            row(f"{k} p50 / p99 ms", lambda r, k=k: f"{r['pages'][k][0] * 1e3:.0f} / {r['pages'][k][1] * 1e3:.0f}")
        row("DB growth GiB/h (all nodes)", lambda r: f"{r['db_growth_gib_h']:.2f}")
        row("CPU µs per rank-step: serve", lambda r: f"{r['serve_cpu_s'] / r['stored'] * 1e6:.0f}")
        row("CPU µs per rank-step: each node's PostgreSQL", lambda r: ", ".join(
            f"{k} {v['cpu_s'] / r['stored'] * 1e6:.0f}" for k, v in r["nodes"].items()))


if __name__ == "__main__":
    main()
