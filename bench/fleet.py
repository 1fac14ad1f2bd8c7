"""The fleet soak (issue #13): R ranks at 1 step/s, 4 collectives per rank-step, for D seconds,
through ``fleetscope simulate --realtime`` (one sender process per run of ``--ranks-per-run`` ranks)
into a real ``fleetscope serve`` on a real Postgres — bounded, loopback only.

    python bench/fleet.py [--ranks 4096] [--duration 600] [--ranks-per-run 1024]
                          [--compaction-workers 0] [--sample-s 5]

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

then that every rank-step sent was stored exactly once (runs' ``rank_steps`` = ranks × steps).
Prints ``name: value unit`` lines last.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--duration", type=int, default=600, help="seconds (= steps at 1 step/s)")
    ap.add_argument("--ranks-per-run", type=int, default=1024)
    ap.add_argument("--compaction-workers", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--database-url", default=None, help="a Postgres URL (default: embedded, in a temp dir)")
    args = ap.parse_args()

    from fleetscope.server.db import EmbeddedPostgres

    tmp = Path(tempfile.mkdtemp(prefix="fs-fleet-"))
    pg = None
    procs: list[subprocess.Popen] = []
    try:
        url_db = args.database_url
        if url_db is None:
            pg = EmbeddedPostgres(tmp / "data")
            url_db = pg.start()
        subprocess.run([*FS, "db", "upgrade", "--database-url", url_db], check=True, capture_output=True)
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
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start: " + (tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.2)

        import psycopg

        def db_size() -> int:
            with psycopg.connect(url_db) as c:
                return int(c.execute("SELECT pg_database_size(current_database())").fetchone()[0])

        size0 = db_size()
        m0 = httpx.get(f"{url}/metrics", timeout=10).text
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
        stop.set()
        probe.join(30)
        bad = [i for i, s in enumerate(senders) if s.returncode != 0]
        m1 = httpx.get(f"{url}/metrics", timeout=30).text
        # let compaction finish, then check every rank-step landed once
        deadline = time.monotonic() + 300
        want = {f"soak-{i}": min(args.ranks_per_run, args.ranks - i * args.ranks_per_run) * args.duration
                for i in range(runs)}
        while True:
            got = {r["name"]: r["rank_steps"] for r in
                   httpx.get(f"{url}/api/v1/runs", params={"limit": 1000}, timeout=30).json()["runs"]}
            if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
                break
            time.sleep(2)
        drain_s = time.monotonic() - t0 - wall
        size1 = db_size()
        half = [s for s in samples if s[0] >= wall / 2]
        slope = _slope([s[0] for s in half], [s[1] for s in half])
        rss = [s[2] for s in samples if s[2]]
        hist0 = _histogram(m0, "fleetscope_ingest_batch_seconds")
        hist1 = _histogram(m1, "fleetscope_ingest_batch_seconds")
        print(json.dumps({"samples": samples[-5:], "sender_failures": bad, "got": got}, default=str)[:2000])
        print(f"load: {os.getloadavg()}")
        print(f"soak_ranks: {args.ranks}")
        print(f"soak_duration_s: {args.duration} s (wall {wall:.0f} s, drain after {drain_s:.0f} s)")
        print(f"soak_rank_steps_per_s: {sum(want.values()) / wall:.0f} rank-steps/s")
        print(f"soak_stored_exactly: {all(got.get(k) == v for k, v in want.items())}")
        print(f"soak_ingest_latency_p50: {_pct(probe.ingest_s, 0.5) * 1e3:.1f} ms (probe round trip)")
        print(f"soak_ingest_latency_p99: {_pct(probe.ingest_s, 0.99) * 1e3:.1f} ms (probe round trip)")
        print(f"soak_server_batch_p50: {_hist_quantile(hist0, hist1, 0.5) * 1e3:.0f} ms (histogram bucket bound)")
        print(f"soak_server_batch_p99: {_hist_quantile(hist0, hist1, 0.99) * 1e3:.0f} ms (histogram bucket bound)")
        print(f"soak_backlog_slope: {slope:.1f} rows/s (second half)")
        print(f"soak_backlog_max: {max((s[1] for s in samples), default=float('nan')):.0f} rows")
        if rss:
            print(f"soak_server_rss_mib: first {rss[0] / 2**20:.0f}, max {max(rss) / 2**20:.0f}, "
                  f"last {rss[-1] / 2**20:.0f} MiB")
        print(f"soak_db_growth: {(size1 - size0) / wall * 3600 / 2**30:.2f} GiB/hour")
        for k, xs in probe.pages.items():
            print(f"soak_{k}_p50: {_pct(xs, 0.5) * 1e3:.0f} ms, p99 {_pct(xs, 0.99) * 1e3:.0f} ms ({len(xs)} samples)")
        print(f"soak_probe_errors: {probe.errors}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
