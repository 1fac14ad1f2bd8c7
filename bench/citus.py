"""Citus benchmark: the same ingest on plain Postgres (embedded) and on a 3-node Citus cluster on this
machine (coordinator + two workers, Citus built from ../shared/vendor), in the same run; then a third
worker added under load (``citus_add_node`` + ``citus_rebalance_start`` while ``fleetscope simulate``
streams) with every record counted.

    python bench/citus.py [--runs 4] [--ranks 64] [--steps 200] [--senders 3] [--grow-runs 2 --grow-steps 150]

Per backend: sustained rank-steps/s (accepted over HTTP and compacted: the server's own compactor),
summary latency (first call, which computes the run's figures, and warm median), and bytes per
rank-step on each node. Prints `name: value unit` lines (docs/benchmarks.md, "Citus").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "citus"))

from cluster import CitusCluster  # noqa: E402
from fleetscope.server.db import EmbeddedPostgres, libpq_url, upgrade  # noqa: E402
from ingest import encode_batches, make_rows  # noqa: E402


def _serve(url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLEETSCOPE_COMPACT_GRACE_S": "2", "FLEETSCOPE_COMPACT_INTERVAL_S": "0.5"}
    p = subprocess.Popen([sys.executable, "-m", "fleetscope.cli", "serve", "--database-url", url, "--port", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return p
        except httpx.TransportError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: {p.stderr.read().decode()[-2000:] if p.stderr else ''}")
        time.sleep(0.2)


def _token(url: str) -> str:
    from fleetscope.server.auth import create_token
    from fleetscope.server.db import make_engine

    eng = make_engine(url, pool_size=1)
    try:
        return create_token(eng, "bench", scope="admin", replace=True)
    finally:
        eng.dispose()


def ingest(url: str, port: int, args: argparse.Namespace, rows: list[tuple], colls: list[tuple]) -> dict[str, Any]:
    """Send ``args.runs`` runs of the same rows over HTTP; wait until compacted."""
    with psycopg.connect(libpq_url(url), autocommit=True) as c:
        ids = [c.execute("INSERT INTO runs (name, world_size) VALUES (%s, %s) RETURNING id",
                         (f"bench-{k}", args.ranks)).fetchone()[0] for k in range(args.runs)]
    token = _token(url)
    by_run = [encode_batches(rid, rows, colls, args.batch) for rid in ids]
    batches = [b[i] for i in range(max(map(len, by_run))) for b in by_run if i < len(b)]
    n = len(rows) * len(ids)
    server = _serve(url, port)
    try:
        base = f"http://127.0.0.1:{port}"
        q = list(range(len(batches)))
        lock = threading.Lock()
        retries = [0]

        def sender() -> None:
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120) as h:
                while True:
                    with lock:
                        if not q:
                            return
                        i = q.pop(0)
                    body, headers = batches[i]
                    while True:
                        r = h.post("/api/v1/ingest", content=body, headers=headers)
                        if r.status_code in (429, 503):
                            retries[0] += 1
                            time.sleep(float(r.headers.get("Retry-After", "1")))
                            continue
                        r.raise_for_status()
                        break

        t0 = time.perf_counter()
        threads = [threading.Thread(target=sender) for _ in range(args.senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            while c.execute("SELECT count(*) FROM ingest_fragments").fetchone()[0] > 0:
                time.sleep(0.05)
            t_done = time.perf_counter() - t0
            stored = c.execute("SELECT sum(rank_steps) FROM runs WHERE id = ANY(%s)", (ids,)).fetchone()[0]
        assert int(stored) == n, (stored, n)
        first, warm = [], []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120) as h:
            for rid in ids:
                t = time.perf_counter()
                s = h.get(f"/api/v1/runs/{rid}/summary")
                first.append(time.perf_counter() - t)
                assert s.status_code == 200 and s.json()["decomposition"]["step_s"] > 0, s.text[:300]
                for _ in range(5):
                    t = time.perf_counter()
                    h.get(f"/api/v1/runs/{rid}/summary").raise_for_status()
                    warm.append(time.perf_counter() - t)
    finally:
        server.terminate()
        server.wait(30)
    return {"n": n, "rate": n / t_done, "retries": retries[0], "first_ms": 1e3 * float(np.median(first)),
            "warm_ms": 1e3 * float(np.median(warm)), "warm_p95_ms": 1e3 * float(np.percentile(warm, 95))}


_PER_RUN_BYTES_PG = """
SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND a.attname = 'run_id' AND a.attnotnull
"""


def grow_under_load(cluster: CitusCluster, url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """Stream `fleetscope simulate` runs; meanwhile add a worker and rebalance; count what landed."""
    token = _token(url)
    server = _serve(url, port)
    base = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    try:
        sims = [subprocess.Popen(
            [sys.executable, "-m", "fleetscope.cli", "simulate", "--server", base, "--token", token,
             "--run", f"grow-{k}", "--family", "vla-7b", "--ranks", str(args.ranks), "--steps", str(args.grow_steps),
             "--seed", str(k), "--realtime", "--step-ms", str(args.grow_step_ms)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for k in range(args.grow_runs)]
        time.sleep(3)
        t0 = time.perf_counter()
        out["streaming_at_start"] = sum(p.poll() is None for p in sims)
        node = cluster.add_worker()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("SELECT citus_rebalance_start()")
            while True:
                st = c.execute("SELECT state FROM citus_rebalance_status() ORDER BY job_id DESC LIMIT 1").fetchone()
                if st is None or st[0] in ("finished", "failed", "cancelled"):
                    break
                time.sleep(0.5)
            out["rebalance_state"] = st[0] if st else "none"
            out["rebalance_s"] = time.perf_counter() - t0
            out["new_worker_shards"] = c.execute("SELECT count(*) FROM citus_shards WHERE nodeport = %s",
                                                 (node.port,)).fetchone()[0]
            out["streaming_during_rebalance"] = sum(p.poll() is None for p in sims)
        for p in sims:
            p.wait(600)
            if p.returncode != 0:
                raise SystemExit(f"simulate failed: {p.stderr.read().decode()[-2000:] if p.stderr else ''}")
        with psycopg.connect(url, autocommit=True) as c:
            deadline = time.monotonic() + 120
            while c.execute("SELECT count(*) FROM ingest_fragments").fetchone()[0] > 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            got = c.execute("SELECT coalesce(sum(rank_steps), 0) FROM runs WHERE name LIKE 'grow-%'").fetchone()[0]
        out["expected"] = args.grow_runs * args.ranks * args.grow_steps
        out["stored"] = int(got)
    finally:
        server.terminate()
        server.wait(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--senders", type=int, default=3)
    ap.add_argument("--shard-count", type=int, default=32, help="shards per distributed table (Citus' default)")
    ap.add_argument("--grow-runs", type=int, default=2)
    ap.add_argument("--grow-steps", type=int, default=500)
    ap.add_argument("--grow-step-ms", type=float, default=100.0)
    ap.add_argument("--port", type=int, default=18531)
    args = ap.parse_args()

    rows, colls = make_rows(args.ranks, args.steps)
    print(f"{args.runs} runs x {args.ranks} ranks x {args.steps} steps ({args.runs * len(rows):,} rank-steps, "
          f"4 collectives each); load before: {os.getloadavg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fsbc-", dir="/tmp"))
    pg = EmbeddedPostgres(tmp)
    cluster = None
    res: dict[str, dict[str, Any]] = {}
    try:
        url = pg.start()
        upgrade(url)
        res["postgres"] = ingest(url, args.port, args, rows, colls)
        with psycopg.connect(libpq_url(url), autocommit=True) as c:
            c.execute("VACUUM ANALYZE")
            res["postgres"]["bytes"] = {"single": int(c.execute(_PER_RUN_BYTES_PG).fetchone()[0])}
        pg.stop()
        print(f"postgres: {res['postgres']}", flush=True)

        cluster = CitusCluster.start(workers=2, shard_count=args.shard_count)
        curl = cluster.create_database("fleetscope")
        r = subprocess.run([sys.executable, "-m", "fleetscope.cli", "db", "distribute", "--database-url", curl],
                           capture_output=True, text=True, check=True)
        print(r.stdout.strip(), flush=True)
        per_node_sql = ("SELECT nodename || ':' || nodeport, sum(shard_size) FROM citus_shards "
                        "WHERE citus_table_type = 'distributed' GROUP BY 1 ORDER BY 1")
        with psycopg.connect(curl, autocommit=True) as c:
            c.execute("VACUUM ANALYZE")
            empty = dict(c.execute(per_node_sql).fetchall())  # the shards' own size before any data
        res["citus"] = ingest(curl, args.port + 1, args, rows, colls)
        with psycopg.connect(curl, autocommit=True) as c:
            c.execute("VACUUM ANALYZE")
            per_node = {k: v - empty.get(k, 0) for k, v in c.execute(per_node_sql).fetchall()}
            ref = c.execute("SELECT sum(shard_size) FROM citus_shards WHERE citus_table_type = 'reference' "
                            "AND nodeport = %s", (cluster.coordinator.port,)).fetchone()[0]
        res["citus"]["empty_bytes"] = {k: int(v) for k, v in empty.items()}
        res["citus"]["bytes"] = {k: int(v) for k, v in per_node.items()}
        res["citus"]["reference_bytes_per_node"] = int(ref or 0)
        print(f"citus: {res['citus']}", flush=True)
        grow = grow_under_load(cluster, curl, args.port + 2, args)
        print(f"grow: {grow}", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    p, c_ = res["postgres"], res["citus"]
    print(f"load after: {os.getloadavg()}")
    print(f"postgres_sustained_rate: {p['rate']:,.0f} rank-steps/s")
    print(f"citus_sustained_rate: {c_['rate']:,.0f} rank-steps/s (3 nodes on this machine)")
    print(f"citus_vs_postgres_ratio: {c_['rate'] / p['rate']:.2f} x")
    print(f"postgres_summary_ms: first {p['first_ms']:.0f}, warm median {p['warm_ms']:.0f}, p95 {p['warm_p95_ms']:.0f}")
    print(f"citus_summary_ms: first {c_['first_ms']:.0f}, warm median {c_['warm_ms']:.0f}, p95 {c_['warm_p95_ms']:.0f}")
    print(f"postgres_bytes_per_rank_step: {p['bytes']['single'] / p['n']:.1f} B (per-run tables)")
    for node, b in c_["bytes"].items():
        print(f"citus_bytes_per_rank_step_{node}: {b / c_['n']:.1f} B (growth of its shards of the per-run tables; "
              f"the {c_['empty_bytes'].get(node, 0) / 1e6:.1f} MB of empty shards before excluded)")
    print(f"citus_bytes_per_rank_step_all_workers: {sum(c_['bytes'].values()) / c_['n']:.1f} B")
    print(f"grow_rebalance: {grow['rebalance_state']} in {grow['rebalance_s']:.1f}s, "
          f"{grow['new_worker_shards']} shards on the new worker; simulate streams running at its start "
          f"{grow['streaming_at_start']}, at its end {grow['streaming_during_rebalance']} of {args.grow_runs}")
    print(f"grow_records_lost: {grow['expected'] - grow['stored']} of {grow['expected']:,} rank-steps")


if __name__ == "__main__":
    main()
