"""What a Prometheus scrape of ``/metrics`` costs with per-run gauges for N live runs.

    python bench/metrics_scrape.py [--runs 200] [--world-size 8] [--steps 5] [--scrapes 30]

One embedded Postgres, N running runs (each ``--steps`` steps of ``--world-size`` ranks, compacted),
and two ``fleetscope serve`` processes on it: one exporting the per-run gauges (``--metrics-max-runs
N``), one without them (``--metrics-max-runs 0``), scraped alternately, so the ratio is a same-run
comparison. Reports, per server: the first scrape (per-run figures not yet in this process's cache),
then the median and p95 of ``--scrapes`` scrapes, the exposition size and its series count.
Prints ``name: value unit`` lines last.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FS = [sys.executable, "-m", "fleetscope.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(url: str, cap: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    p = subprocess.Popen([*FS, "serve", "--port", str(port), "--database-url", url, "--metrics-max-runs", str(cap)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return p, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.kill()
    raise SystemExit("server did not start")


def _scrape(base: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    r = httpx.get(f"{base}/metrics", timeout=60)
    dt = time.perf_counter() - t0
    assert r.status_code == 200
    series = sum(1 for line in r.text.splitlines() if line and not line.startswith("#"))
    return dt, len(r.content), series


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--scrapes", type=int, default=30)
    args = ap.parse_args()

    from fleetscope.server.auth import create_token
    from fleetscope.server.db import EmbeddedPostgres, make_engine

    from fleetscope.client import Client
    from fleetscope.synthetic import RunSpec, collective_rows, rank_step_rows

    d = Path(tempfile.mkdtemp(prefix="fsb-", dir="/tmp"))
    pg = EmbeddedPostgres(d)
    url = pg.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with_runs, base = _serve(url, args.runs)
        procs.append(with_runs)
        without, base0 = _serve(url, 0)
        procs.append(without)
        eng = make_engine(url, pool_size=1)
        token = create_token(eng, "bench", scope="admin")
        eng.dispose()
        t0 = time.monotonic()
        with Client(base, token) as c:
            for i in range(args.runs):
                spec = RunSpec(name=f"scrape-{i:04d}", family=f"fam-{i % 5}", world_size=args.world_size,
                               steps=args.steps, seed=i)
                rid = c.register_run(spec.run_info())
                for step, rows in rank_step_rows(spec):
                    c.ingest_rows(rid, rows, collective_rows(spec, step, rows))
        load_s = time.monotonic() - t0
        deadline = time.monotonic() + 300  # every run compacted: its steps counted
        while time.monotonic() < deadline:
            runs = httpx.get(f"{base}/api/v1/runs", params={"limit": args.runs}, timeout=60).json()["runs"]
            if len(runs) == args.runs and all(r["steps"] >= args.steps for r in runs):
                break
            time.sleep(1)
        res = {}
        for name, b in (("per_run", base), ("no_per_run", base0)):
            first = _scrape(b)
            res[name] = {"first": first, "times": []}
        for _ in range(args.scrapes):
            for name, b in (("per_run", base), ("no_per_run", base0)):
                res[name]["times"].append(_scrape(b)[0])
        up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"# {args.runs} running runs × {args.world_size} ranks × {args.steps} steps, loaded in {load_s:.0f} s; {up}")
        for name, r in res.items():
            ts = sorted(r["times"])
            first_s, size, series = r["first"]
            print(f"scrape_{name}_first: {first_s * 1e3:.1f} ms")
            print(f"scrape_{name}_median: {statistics.median(ts) * 1e3:.1f} ms")
            print(f"scrape_{name}_p95: {ts[int(0.95 * (len(ts) - 1))] * 1e3:.1f} ms")
            print(f"scrape_{name}_bytes: {size} B")
            print(f"scrape_{name}_series: {series} series")
        ratio = statistics.median(res["per_run"]["times"]) / statistics.median(res["no_per_run"]["times"])
        print(f"scrape_per_run_vs_without: {ratio:.2f} x")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        pg.stop()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
